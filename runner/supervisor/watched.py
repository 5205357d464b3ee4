"""Own-checkpoint mode: the script's own checkpoint files are the commit (issue 15).

``ckrun submit train.py --checkpoint-path out/ckpt.pt --resume-args init_from=resume``
runs a script that saves with ``torch.save`` on its own schedule and knows nothing of
ckrun.  The supervisor:

* **commits** a new version of the named files: while the child runs, a file whose
  ``(inode, size, mtime)`` changed is committed once it is *finished* — no process of
  the child's session holds it open for writing (``/proc/PID/fd`` + ``fdinfo`` flags),
  and, for a zip file (``torch.save``'s format), its central directory and every member
  CRC check out (``zipfile.testzip``), for a file written by ``ckrun.save`` its CRC32C
  trailer; a file of another format must also be unchanged between two polls.  The copy is a ckrun
  file set (:mod:`ckrun.checkpoint.fileset`: CRC32C, manifest last, retention), numbered
  by version (the manifest "step" is the version, the script's own step counter is
  opaque to ckrun).  After the child is gone, a changed file is committed only if the
  child exited on its own (status 0, 75, 76) or its format validates: a file cut short by
  a kill mid-write is never committed.
* **restores** the newest verified version into place (temp file, fsync, rename) before
  every start, replacing whatever a killed attempt left there, and appends the resume
  arguments when it restored one;
* on exit 0 commits the files as the final artifact (``COMPLETE.json``).

What a preemption loses is the work since the script's last own save (reported on each
preemption): ckrun cannot make an unmodified script save at the notice.
"""

from __future__ import annotations

import logging
import os
import time
import zipfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckrun.storage.base import Storage

if TYPE_CHECKING:
    from ckrun.supervisor.process import Child

log = logging.getLogger(__name__)

_CLEAN_EXITS = (0, 75, 76)


@dataclass
class Version:
    """The newest committed version of the watched files."""

    step: int
    committed_at: float  # monotonic seconds


@dataclass
class WatchedFiles:
    """The own-checkpoint commit source of one run (module docstring).

    Args:
        paths: the files, relative to the child's working directory (the supervisor's).
        storage: the run root.
        run: run id for manifests.
        keep_last: retention of committed versions.
    """

    paths: tuple[str, ...]
    storage: Storage
    run: str
    keep_last: int = 3
    compat: dict[str, str] = field(default_factory=dict)
    last: Version | None = None
    _seen: dict[str, tuple[int, int, int] | None] = field(default_factory=dict)
    _pending: dict[str, tuple[int, int, int] | None] = field(default_factory=dict)
    _attempt: int = 0
    commits_this_attempt: int = 0

    # -- restore ----------------------------------------------------------------------

    def restore(self, attempt: int) -> int | None:
        """Put the newest verified version into place; returns its step, or None.

        Files of the newest version replace the local ones atomically; a local file
        the version does not hold is left alone.
        """
        from ckrun.checkpoint import (
            fileset,
            shard,  # noqa: F401  (torch: imported before the child runs)
        )

        self._attempt, self.commits_this_attempt = attempt, 0
        fs = fileset.newest(self.storage)
        if fs is None or not any(_name(p) in fs.files for p in self.paths):
            self._remember()
            return None
        for p in self.paths:
            if _name(p) in fs.files:
                fs.extract(_name(p), p)
        self._remember()
        self.last = Version(fs.manifest.step, time.monotonic())
        return fs.manifest.step

    def _remember(self) -> None:
        self._seen = {p: _sig(p) for p in self.paths}
        self._pending = dict(self._seen)

    # -- commits while the child runs --------------------------------------------------

    def poll(self, session: list[int]) -> int | None:
        """Commit a finished new version (see module docstring); returns its step."""
        cur = {p: _sig(p) for p in self.paths}
        if cur == self._seen:
            return None
        stable = cur == self._pending
        self._pending = cur
        if any(_open_for_write(p, session) for p in self.paths):
            return None
        # a checkable format (zip, ckrun.save) is committed at once; another only once it
        # stayed unchanged between two polls
        return self._commit(cur, validate_all=not stable)

    def after_exit(self, status: int, notice_at: float | None) -> int | None:
        """The child is gone: commit a last new version if it is trustworthy, and the
        final artifact on exit 0."""
        cur = {p: _sig(p) for p in self.paths}
        step = None
        if cur != self._seen:
            step = self._commit(cur, validate_all=status not in _CLEAN_EXITS)
        if status == 0 and any(s is not None for s in cur.values()):
            self._commit(cur, validate_all=False, kind="final")
        return step

    def _commit(
        self,
        cur: dict[str, tuple[int, int, int] | None],
        *,
        validate_all: bool,
        kind: str = "recovery",
    ) -> int | None:
        from ckrun.checkpoint import fileset
        from ckrun.checkpoint.discovery import committed

        files = {_name(p): p for p, s in cur.items() if s is not None}
        if not files:
            return None
        for p in files.values():
            problem = validate(p, require_known=validate_all)
            if problem is not None:
                log.warning("own checkpoint %s not committed: %s", p, problem)
                return None
        ms = committed(self.storage)
        step = (max(m.step for m in ms) + (0 if kind == "final" else 1)) if ms else 0
        try:
            m = fileset.commit_files(
                self.storage,
                step,
                files,
                run=self.run,
                attempt=self._attempt,
                kind=kind,
                compat=self.compat,
                keep_last=self.keep_last,
            )
        except fileset.FileSetChanged as e:
            log.info("%s; retrying at the next poll", e)
            return None
        self._seen = cur
        if kind != "final":
            self.last = Version(m.step, time.monotonic())
            self.commits_this_attempt += 1
        return m.step

    def lost_report(self, status: int, notice_at: float | None) -> str | None:
        """What a preemption (non-zero exit after a notice) lost, in one line."""
        if status == 0 or notice_at is None:
            return None
        if self.last is None:
            lost = "no version of the script's checkpoint exists: it restarts from scratch"
        else:
            ago = max(0.0, notice_at - self.last.committed_at)
            lost = (
                f"its newest version {self.last.step} was committed {ago:.1f} s before the "
                "notice: the work since the script's own last save is lost"
            )
        return f"own checkpoint {', '.join(self.paths)}: {lost}"

    def drill_due(self) -> bool:
        """``CKRUN_DRILL_AFTER_COMMITS`` (``ckrun check-resume`` in own-checkpoint mode):
        True right after this attempt's Nth committed version, N the attempt's entry of
        the comma-separated list — a drill lands on the step after a save."""
        spec = os.environ.get("CKRUN_DRILL_AFTER_COMMITS", "")
        try:
            counts = [int(x) for x in spec.split(",") if x.strip()]
        except ValueError:
            return False
        return self._attempt < len(counts) and self.commits_this_attempt == counts[self._attempt]


def mark_started(control_dir: str, pid: int) -> None:
    """Write the child's training-start stamp (``control_files.TRAINING_FILE``) on its behalf:
    an unmodified script cannot report its first step, so chaos drills count from spawn."""
    from ckrun.control_files import TRAINING_FILE
    from ckrun.notices import iso_utc, utcnow
    from ckrun.storage.fsutil import write_json_atomic

    write_json_atomic(
        os.path.join(control_dir, TRAINING_FILE),
        {"utc": iso_utc(utcnow()), "pid": pid},
        durable=False,
    )


def deliver_to_script(child: Child, sig: int) -> list[int]:
    """A notice for a script with its own checkpoint: ``sig`` to the processes that catch
    it, or to the whole session when none does (the script then stops at once; its last
    own save stands).  Returns the pids addressed."""
    from ckrun.supervisor import process

    sent = process.deliver(child, sig)
    if not sent:
        sent = process.members(child)
        process.signal_session(child, sig)
    return sent


def _name(path: str) -> str:
    rel = os.path.relpath(os.path.abspath(path))
    return rel if not rel.startswith("..") else os.path.abspath(path).lstrip("/")


def _sig(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def validate(path: str, *, require_known: bool) -> str | None:
    """None when ``path`` is a complete file, else the problem.

    Zip files (``torch.save``) must have a central directory and good member CRCs;
    ``ckrun.save`` files a good trailer and CRC32C.  Other formats cannot be checked:
    accepted unless ``require_known`` (after a kill), then refused.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        return f"cannot read ({e})"
    if head[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            return f"incomplete zip (torch.save) file: {e}"
        return None if bad is None else f"member {bad} fails its CRC"
    if head == b"CKRUNSH1":
        from ckrun.checkpoint.drop_in import load
        from ckrun.errors import CorruptCheckpoint

        try:
            load(path)
        except CorruptCheckpoint as e:
            return str(e)
        return None
    if require_known:
        return "the child was killed and the format cannot be checked (it may be cut short)"
    return None


def _open_for_write(path: str, session: list[int]) -> bool:
    """True when a process of ``session`` has ``path`` open for writing (Linux /proc)."""
    try:
        target = os.path.realpath(path)
    except OSError:
        return False
    for pid in session:
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") != target:
                    continue
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    flags = next((ln for ln in f if ln.startswith("flags:")), "flags: 0")
                if int(flags.split()[1], 8) & (os.O_WRONLY | os.O_RDWR):
                    return True
            except (OSError, ValueError):
                continue
    return False
