"""The supervisor's part of a run's state directory (by default the run root).

Layout::

    <state root>/run.json            frozen RunConfig (written by submit / first run)
    <state root>/events.jsonl        the event log (ckrun.runlog)
    <state root>/supervisor.log      output of a detached supervisor
    <state root>/job.json            backend + job id of a submitted job
    <state root>/cancelled.json      `ckrun cancel` happened: starts refuse to run
    <state root>/control/            CKRUN_CONTROL_DIR: notice.json, escalate,
                                     preempt-request.json, cancel-request.json
    <state root>/locks/supervisor.lock   filelock (flock) held by the live supervisor
    <state root>/locks/supervisor.json   its holder record: host, pid, attempt, started

The lock is an advisory ``flock`` (``filelock``) on a descriptor that is not inherited by
the child (PEP 446), so it dies with the supervisor process, never with a stale file.
"""

from __future__ import annotations

import json
import os
import socket
from types import TracebackType
from typing import Any

from ckrun.checkpoint.lock import holder_dead, take_over
from ckrun.config import RunConfig
from ckrun.errors import ConfigError, RunLocked, map_os_error
from ckrun.notices import iso_utc, utcnow
from ckrun.storage.fsutil import write_json_atomic
from filelock import FileLock, Timeout

PREEMPT_REQUEST = "preempt-request.json"
CANCEL_REQUEST = "cancel-request.json"


def read_json(path: str) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when absent or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            body = json.load(f)
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


class SupervisorLock:
    """The held supervisor lock; release with :meth:`release` or ``with``."""

    def __init__(self, rundir: RunDir, lock: FileLock, holder: dict[str, Any]) -> None:
        self._rundir = rundir
        self._lock = lock
        self.holder = holder

    def update(self, **fields: Any) -> None:
        """Update the holder record (e.g. ``attempt=3``)."""
        self.holder.update(fields)
        write_json_atomic(self._rundir.holder_path, self.holder, durable=False)

    def release(self) -> None:
        """Remove the holder record and release the lock; idempotent."""
        if self._lock.is_locked:
            try:
                os.unlink(self._rundir.holder_path)
            except FileNotFoundError:
                pass
            self._lock.release(force=True)

    def __enter__(self) -> SupervisorLock:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class RunDir:
    """Paths and helpers of one run's state directory ``root``.

    Args:
        root: the state directory.
        rank: the supervisor's node rank.  On a multi-node job every node runs a
            supervisor on the same (shared) state directory; ranks other than 0 get their
            own lock, control directory and event log (``locks/supervisor-rank1.lock``,
            ``control/rank1/``, ``events-rank1.jsonl``) so they neither refuse each other
            nor clear each other's notices.
    """

    def __init__(self, root: str, rank: int = 0) -> None:
        self.root = os.path.abspath(root)
        self.rank = rank
        sfx = f"-rank{rank}" if rank else ""
        self.run_json = os.path.join(self.root, "run.json")
        self.events_path = os.path.join(self.root, f"events{sfx}.jsonl")
        self.log_path = os.path.join(self.root, "supervisor.log")
        self.job_json = os.path.join(self.root, "job.json")
        self.cancelled_path = os.path.join(self.root, "cancelled.json")
        self.control_dir = os.path.join(self.root, "control", *([f"rank{rank}"] if rank else []))
        self.locks_dir = os.path.join(self.root, "locks")
        self.lock_path = os.path.join(self.locks_dir, f"supervisor{sfx}.lock")
        self.holder_path = os.path.join(self.locks_dir, f"supervisor{sfx}.json")

    def create(self) -> None:
        """Create the directory tree (idempotent).

        Raises:
            StorageError: the state directory cannot be written (read-only, denied,
                full: exit 5); the message names the path and the fix.
        """
        for d in (self.root, self.control_dir, self.locks_dir):
            try:
                os.makedirs(d, exist_ok=True)
            except OSError as e:
                raise map_os_error(e, path=d) from e

    def exists(self) -> bool:
        """True when the run has been frozen (``run.json`` exists)."""
        return os.path.exists(self.run_json)

    def freeze(self, cfg: RunConfig) -> None:
        """Write ``cfg`` to ``run.json`` atomically."""
        self.create()
        try:
            write_json_atomic(self.run_json, cfg.to_json())
        except OSError as e:
            raise map_os_error(e, path=self.run_json) from e

    def load_config(self) -> RunConfig | None:
        """The frozen config, or None when the run was never frozen.

        Raises:
            ConfigError: when ``run.json`` exists but is not valid.
        """
        if not os.path.exists(self.run_json):
            return None
        body = read_json(self.run_json)
        if body is None:
            raise ConfigError(f"{self.run_json} is not valid JSON: fix or delete it")
        return RunConfig.from_json(body)

    def lock(self, run: str, attempt: int = 0) -> SupervisorLock:
        """Take the supervisor lock without waiting.

        Raises:
            RunLocked: another live process holds it; the message names the holder.
        """
        self.create()
        lock = FileLock(self.lock_path, timeout=0)
        try:
            lock.acquire(timeout=0)
        except Timeout as e:  # (a TimeoutError, so an OSError: caught first)
            holder = read_json(self.holder_path) or {}
            stale = take_over(self.lock_path, holder, f"run {run!r} supervisor lock")
            if stale is None:
                raise self._locked(run, holder) from e
            lock = stale
        except OSError as e:
            raise map_os_error(e, path=self.lock_path) from e
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "attempt": attempt,
            "run": run,
            "rank": self.rank,
            "started_utc": iso_utc(utcnow()),
        }
        held = SupervisorLock(self, lock, holder)
        try:
            held.update()
        except OSError as e:
            held.release()
            raise map_os_error(e, path=self.holder_path) from e
        return held

    def _locked(self, run: str, holder: dict[str, Any]) -> RunLocked:
        where = str((read_json(self.run_json) or {}).get("storage") or "")
        at = f" --storage {where}" if where else ""
        return RunLocked(
            f"run {run!r} is alive: supervisor pid {holder.get('pid', '?')} on host "
            f"{holder.get('host', '?')} (attempt {holder.get('attempt', '?')}, since "
            f"{holder.get('started_utc', '?')}) holds {self.lock_path}; use "
            f"`ckrun status {run}{at}` or `ckrun cancel {run}{at}`, or pick another --run",
            holder=holder,
        )

    def live_holder(self) -> dict[str, Any] | None:
        """The holder record when a live supervisor holds the lock, else None."""
        if not os.path.exists(self.lock_path):
            return None
        probe = FileLock(self.lock_path, timeout=0)
        try:
            probe.acquire(timeout=0)
        except Timeout:
            holder = read_json(self.holder_path) or {"pid": None}
            return None if holder_dead(holder) else holder
        probe.release(force=True)
        return None

    def request(self, name: str, body: dict[str, Any]) -> None:
        """Leave a request file for the live supervisor in ``control/`` (not fsynced:
        only that supervisor reads it, see :func:`ckrun.control_files.write_notice`)."""
        write_json_atomic(os.path.join(self.control_dir, name), body, durable=False)

    def take_request(self, name: str) -> dict[str, Any] | None:
        """Consume a request file from ``control/``; None when there is none."""
        path = os.path.join(self.control_dir, name)
        if not os.path.exists(path):
            return None
        body = read_json(path) or {}
        try:
            os.unlink(path)
        except FileNotFoundError:
            return None
        return body
