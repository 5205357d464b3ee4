"""The child's side of the supervisor ↔ child control channel (DESIGN.md §3,
"Supervisor ↔ child"); the channel's files and the supervisor's side of them are
:mod:`ckrun.control_files`, whose names this module re-exports (``ckrun.control.write_notice``,
``read_exit_reason``, ... keep working).

Child side (the training process): :func:`install_signal_handlers`
(:mod:`ckrun.notice_signals`) makes SIGTERM and the notice signal (``CKRUN_NOTICE_SIGNAL``,
default SIGUSR1) only set a flag, so the save runs at the next step boundary instead of
inside a signal handler;
:func:`preemption_requested` returns True once a notice has arrived by signal or by
``notice.json``.  With ``sync=True`` the flag is all-reduced (MAX) over the default
``torch.distributed`` process group so every rank stops at the same step; a rank that
learns of the notice only through that all-reduce (it reached another node: one pod of a
multi-node Kubernetes run is drained) leaves ``peer-notice.json`` in its own control
directory, so that its node's supervisor drains too (:func:`take_peer_notice`) and
judges the attempt by the commit instead of counting torchrun's exit as a failure.

Training start (:func:`mark_training`): the first of ``Checkpointer.load`` returning and
the first :func:`preemption_requested` check writes ``<control_dir>/training.json``
(``utc``, ``pid``) once per process, so the supervisor can count time from the child's
first training step rather than from its spawn (``--chaos-preempt-every``), and appends
``train_start`` to the run's event log when no ``load`` came first (see
:mod:`ckrun.runlog`).

A SIGTERM that arrives after :func:`write_escalation` (the supervisor's "time is up")
is not swallowed: the default action is restored and the signal re-raised.  Before it
is, the process writes where each of its threads was (:func:`dump_stacks`, to fd 2), so
a save that hangs past the grace period names the line it hangs on in the job's log.

Exit reasons (issue 11 item 8): before the library ends the process for one of ckrun's
reasons it writes an exit-reason record (:func:`ckrun.control_files.write_exit_reason`;
:func:`record_notice_save` after a notice's commit).

Under a supervisor, ``import ckrun`` already catches the notice signal (only it): the
process counts as one that handles notices while it still imports torch.

Once a notice has reached the process, no writer probe runs in it
(:func:`ckrun.storage.probe.defer_probes`): the emergency save writes its checkpoint,
not 144 MiB of throughput probe first.

Supervisor liveness (issue 11 item 2): the supervisor's children get
``PR_SET_PDEATHSIG`` (SIGTERM) at spawn, the library sets it again in its own process at
first use (a torchrun worker or a script under a shell wrapper then follows its parent),
and :func:`preemption_requested` treats a vanished supervisor (``CKRUN_SUPERVISOR_PID``
no longer alive) as a notice, so the process saves and stops instead of running on as
an orphan.

Environment read here: ``CKRUN_CONTROL_DIR``, ``CKRUN_NOTICE_SIGNAL``,
``CKRUN_SUPERVISOR_PID``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from ckrun import notice_signals
from ckrun.control_files import (
    ESCALATE_FILE,
    EXIT_REASON_BYTES,
    EXIT_REASON_FILE,
    EXIT_REASONS,
    NOTICE_FILE,
    PEER_NOTICE_FILE,
    TRAINING_FILE,
    clear,
    control_dir,
    read_exit_reason,
    read_notice,
    reserve_exit_reason,
    take_peer_notice,
    training_started,
    write_escalation,
    write_exit_reason,
    write_notice,
)
from ckrun.notice_signals import (
    dump_stacks,
    install_signal_handlers,
    notice_signal,
    received_signals,
    shield_from_dataloader_workers,
)
from ckrun.notices import Notice
from ckrun.storage.fsutil import write_json_atomic

__all__ = [
    "ESCALATE_FILE", "EXIT_REASONS", "EXIT_REASON_BYTES", "EXIT_REASON_FILE",
    "LIVENESS_INTERVAL_S", "NOTICE_FILE", "PEER_NOTICE_FILE", "TRAINING_FILE",
    "add_check_hook", "clear", "control_dir", "dump_stacks", "install_signal_handlers",
    "mark_training", "notice_pending", "notice_signal", "preemption_requested",
    "read_exit_reason", "read_notice",
    "received_signals", "record_notice_save", "reserve_exit_reason", "reset_for_tests",
    "supervisor_gone", "take_peer_notice", "training_started", "write_escalation",
    "write_exit_reason", "write_notice", "write_peer_notice",
]  # fmt: skip

#: Seconds between two checks that the supervisor is alive.
LIVENESS_INTERVAL_S = 1.0


_flag = notice_signals.flag  # also ckrun.control._flag: tests set it as the handler does
_notice_reached = notice_signals.notice_reached
_checks = [0]  # calls of preemption_requested() in this process
_hooks: list[Callable[[], None]] = []  # run at every check (per-step digests)
_liveness = [0.0]  # monotonic time of the last supervisor liveness check
_marked: list[str] = []  # how this process's training start was marked (at most one)
_peer_told = threading.Event()  # this process left its peer notice


def mark_training(how: str) -> None:
    """Child: record that training starts now (once per process; see the module doc).

    Args:
        how: ``restore`` (``Checkpointer.load`` returned; it logs its own ``restore``
            event) or ``step`` (the first step boundary, logged as ``train_start``).
    """
    if _marked:
        return
    _marked.append(how)
    cdir = control_dir()
    if not cdir:
        return
    from ckrun.notices import iso_utc, utcnow
    from ckrun.runlog import child_event

    utc = iso_utc(utcnow())
    try:
        write_json_atomic(
            os.path.join(cdir, TRAINING_FILE), {"utc": utc, "pid": os.getpid()}, durable=False
        )
    except OSError:
        pass
    if how == "step":
        child_event("train_start")


def write_peer_notice(cdir: str | None = None) -> None:
    """Child: the ranks agreed to stop for a notice that reached another node.

    Written once per process (every local rank may write it; the content is the same
    but for the pid), before the collective save, so the supervisor reads it before the
    child exits.
    """
    cdir = cdir or control_dir()
    if cdir and not _peer_told.is_set():
        _peer_told.set()
        write_json_atomic(
            os.path.join(cdir, PEER_NOTICE_FILE),
            {"pid": os.getpid(), "rank": os.environ.get("RANK"), "reason": "agreed step"},
            durable=False,
        )


def supervisor_gone() -> bool:
    """True when this process runs under a supervisor (``CKRUN_SUPERVISOR_PID``) that no
    longer exists (killed, OOM): the process is an orphan and should save and stop."""
    text = os.environ.get("CKRUN_SUPERVISOR_PID", "")
    if not text.isdigit():
        return False
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _drill_due() -> bool:
    """``CKRUN_DRILL_AT_CHECKS``: a drill notice on the Nth check of this attempt.

    The variable holds one count per attempt (``"13,40,7"``: attempt 0 is drilled on its
    13th call of :func:`preemption_requested`, attempt 1 on its 40th, ...).  Used by
    ``ckrun check-resume`` to interrupt a run at chosen steps; the notice is published
    through ``notice.json`` exactly as the supervisor would, so the supervisor sees a
    drill and the child's save path is the real one.
    """
    spec = os.environ.get("CKRUN_DRILL_AT_CHECKS")
    if not spec:
        return False
    try:
        counts = [int(x) for x in spec.split(",") if x.strip()]
        attempt = int(os.environ.get("CKRUN_ATTEMPT", "0"))
    except ValueError:
        return False
    if attempt >= len(counts) or _checks[0] != counts[attempt]:
        return False
    cdir = control_dir()
    if cdir:
        from ckrun.notices import DRILL

        write_notice(cdir, Notice.with_lead(DRILL, "check-resume", 60.0))
    return True


def add_check_hook(fn: Callable[[], None]) -> None:
    """Run ``fn`` at every :func:`preemption_requested` call, i.e. after every step
    (``ckrun check-resume``'s per-step digests, :func:`ckrun.checkpoint.state.record_step`)."""
    if fn not in _hooks:
        _hooks.append(fn)


def _local_flag() -> bool:
    _checks[0] += 1
    for hook in _hooks:
        hook()
    if not _marked:
        mark_training("step")
    if _flag.is_set():
        return True
    now = time.monotonic()
    if now - _liveness[0] >= LIVENESS_INTERVAL_S:
        _liveness[0] = now
        if supervisor_gone():
            print(
                "ckrun: the supervisor (pid "
                f"{os.environ.get('CKRUN_SUPERVISOR_PID')}) is gone: saving and stopping",
                file=sys.stderr,
                flush=True,
            )
            _notice_reached()
            return True
    if _drill_due():
        _notice_reached()
        return True
    cdir = control_dir()
    if cdir and os.path.exists(os.path.join(cdir, NOTICE_FILE)):
        _notice_reached()
        shield_from_dataloader_workers()
        return True
    return False


def preemption_requested(sync: bool = False) -> bool:
    """True once an interruption notice reached this process.

    Cheap enough to call every step (one flag test and, until a notice arrives, one
    ``stat`` of ``notice.json``).

    Args:
        sync: all-reduce the flag (MAX) over the default ``torch.distributed`` process
            group so every rank agrees; a collective, so every rank must call it at the
            same step.  Ignored when ``torch.distributed`` is not initialised.
    """
    install_signal_handlers()
    local = _local_flag()
    if not sync:
        return local
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return local
    if not (dist.is_available() and dist.is_initialized()):
        return local
    t = torch.tensor([1 if local else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    agreed = bool(int(t.item()))
    if agreed:
        _notice_reached()
        if not local:
            write_peer_notice()
    return agreed


def notice_pending() -> bool:
    """True once a notice has reached this process (the flag only: no check of
    ``notice.json``, no counting; callable from any thread).  Work that can wait, such
    as retention, yields to the emergency save and the exit then."""
    return _flag.is_set()


def record_notice_save(step: int) -> None:
    """Library: a checkpoint of ``step`` was committed after a notice reached this
    process; an exit now is a preemption with a commit (:func:`write_exit_reason`)."""
    if _flag.is_set():
        write_exit_reason("preempted", 75, f"checkpoint step {step} committed after the notice")


def reset_for_tests() -> None:
    """Clear the flag (tests only)."""
    _flag.clear()
    _peer_told.clear()
    notice_signals.received.clear()
    _checks[0] = 0
    _marked.clear()
    _liveness[0] = 0.0


notice_signals.follow_parent()  # at import: a torchrun worker or a wrapped script follows
notice_signals.catch_notice_early()  # its parent; the notice signal is caught at once
