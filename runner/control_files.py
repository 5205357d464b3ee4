"""The files of the supervisor ↔ child control channel (DESIGN.md §3, "Supervisor ↔ child").

The control directory (``CKRUN_CONTROL_DIR``) holds one file per message, each written
atomically: ``notice.json`` (reason, source, deadline UTC; the supervisor writes it
*before* it signals the child, :func:`write_notice`), ``escalate`` (the grace period is
over, :func:`write_escalation`), ``training.json`` (the child's training start, read by
:func:`training_started`), ``peer-notice.json`` (the ranks agreed to stop for a notice
that reached another node, consumed by :func:`take_peer_notice`) and
``exit-reason.json``.  :func:`clear` removes them before a new attempt.

Exit reasons (issue 11 item 8): a user script may exit 3, 4, 5, 75 or 76 for its own
reasons.  Before the library ends the process for one of ckrun's reasons it writes an
exit-reason record (:func:`write_exit_reason`, ``exit-reason.json``: ``reason``,
``code``, ``message``); the supervisor reads it (:func:`read_exit_reason`) and only the
record makes an exit 4 "incompatible", a 3 "invalid config", a 5 "storage full",
"storage denied" or "checkpoints unusable" (every committed checkpoint damaged; not
retried), and a status 0 after a notice a preemption.  The
supervisor reserves the record's blocks before each start (:func:`reserve_exit_reason`)
so that a StorageFull exit can be recorded on the full disk that caused it.

The child side (signal handlers, the preemption flag, the training-start and peer-notice
writes) is :mod:`ckrun.control`, which re-exports these names.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ckrun.notices import Notice
from ckrun.storage.fsutil import write_json_atomic

NOTICE_FILE = "notice.json"
ESCALATE_FILE = "escalate"
EXIT_REASON_FILE = "exit-reason.json"
#: Exit reasons the library records (see the module docstring).
EXIT_REASONS = (
    "preempted",
    "incompatible",
    "config_invalid",
    "storage_full",
    "storage_denied",
    "checkpoints_unusable",
)
TRAINING_FILE = "training.json"
PEER_NOTICE_FILE = "peer-notice.json"


def control_dir() -> str | None:
    """The control directory of the current run (``CKRUN_CONTROL_DIR``), if supervised."""
    return os.environ.get("CKRUN_CONTROL_DIR") or None


def write_notice(cdir: str, notice: Notice) -> None:
    """Supervisor: publish ``notice`` atomically in ``cdir/notice.json``.

    Not fsynced, as every file of the control channel: it is read on this machine
    while its processes live, and a flush would first wait for the dirty data of every
    other writer on the disk (5.3 s with a 300 MB write in flight on a 50 MB/s volume,
    where the unsynced write took 1 ms), delaying the notice signal sent after it.
    """
    write_json_atomic(os.path.join(cdir, NOTICE_FILE), notice.to_json(), durable=False)


def write_escalation(cdir: str) -> None:
    """Supervisor: mark that the grace period is over; the next SIGTERM is fatal (not
    fsynced, see :func:`write_notice`)."""
    write_json_atomic(os.path.join(cdir, ESCALATE_FILE), {"escalated": True}, durable=False)


def clear(cdir: str) -> None:
    """Supervisor: remove the notice, escalation, peer-notice, training-start and
    exit-reason files before a new attempt."""
    for name in (NOTICE_FILE, ESCALATE_FILE, PEER_NOTICE_FILE, TRAINING_FILE, EXIT_REASON_FILE):
        try:
            os.unlink(os.path.join(cdir, name))
        except FileNotFoundError:
            pass


def read_notice(cdir: str | None = None) -> Notice | None:
    """The notice published for this run, or None (also on a malformed file)."""
    cdir = cdir or control_dir()
    if not cdir:
        return None
    try:
        with open(os.path.join(cdir, NOTICE_FILE)) as f:
            return Notice.from_json(json.load(f))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def training_started(cdir: str) -> float | None:
    """Supervisor: epoch seconds at which the current child started training, or None
    while it has not (or does not report it: it uses neither ``load`` nor
    :func:`preemption_requested`)."""
    try:
        with open(os.path.join(cdir, TRAINING_FILE)) as f:
            body = json.load(f)
        from ckrun.notices import parse_utc

        return float(parse_utc(str(body["utc"])).timestamp())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def take_peer_notice(cdir: str) -> dict[str, Any] | None:
    """Supervisor: consume ``peer-notice.json``; None when there is none."""
    path = os.path.join(cdir, PEER_NOTICE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            body = json.load(f)
        os.unlink(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        body = {}
    return body if isinstance(body, dict) else {}


#: Size of the reserved exit-reason record: the supervisor allocates it before the start,
#: so the library can record a StorageFull exit on the full disk that caused it.
EXIT_REASON_BYTES = 4096


def reserve_exit_reason(cdir: str) -> bool:
    """Supervisor: allocate an empty (blank) exit-reason record before a start.

    Returns:
        False when it cannot be written (the child then writes a new file, if it can).
    """
    try:
        with open(os.path.join(cdir, EXIT_REASON_FILE), "wb") as f:
            f.write(b" " * EXIT_REASON_BYTES)
        return True
    except OSError:
        return False


def write_exit_reason(reason: str, code: int, message: str = "", cdir: str | None = None) -> None:
    """Child: record why this process is about to exit with ``code`` (one of
    :data:`EXIT_REASONS`); a no-op outside the supervisor.

    Overwrites the supervisor's reserved record in place (no new blocks: it works on a
    full disk), else writes a new file.  Never raises: a failing write must not turn a
    clean exit into a traceback (the supervisor then sees no record).
    """
    cdir = cdir or control_dir()
    if not cdir:
        return
    path = os.path.join(cdir, EXIT_REASON_FILE)
    body = {"reason": reason, "code": int(code), "message": message[:2000], "pid": os.getpid()}
    data = json.dumps(body).encode()[: EXIT_REASON_BYTES - 1]
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        try:
            write_json_atomic(path, body, durable=False)
        except OSError:
            pass
        return
    except OSError:
        return
    try:
        os.pwrite(fd, data.ljust(EXIT_REASON_BYTES), 0)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_exit_reason(cdir: str) -> dict[str, Any] | None:
    """Supervisor: the exit-reason record of the attempt's process, or None."""
    try:
        with open(os.path.join(cdir, EXIT_REASON_FILE), "rb") as f:
            text = f.read().strip()
        body = json.loads(text) if text else None
    except (OSError, ValueError):
        return None
    if not isinstance(body, dict) or body.get("reason") not in EXIT_REASONS:
        return None
    return body
