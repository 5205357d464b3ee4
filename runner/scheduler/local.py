"""The local backend (the embedded default): runs on this machine, restarts in place.

``submit`` starts a detached supervisor (``python -m ckrun.cli run ...`` in its own
session, output to ``supervisor.log``); the foreground path of ``ckrun submit`` runs the
supervisor in-process instead.  ``requeue`` answers ``RESTART_HERE``: the supervisor loop
starts the next attempt itself.

``chaos_preempt_every`` (profile key, CLI ``--chaos-preempt-every 20s``) delivers a drill
notice every N seconds of the child's training (counted from its first training step), a
one-command demonstration of the resume path.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckrun.errors import SchedulerError
from ckrun.notices import DRILL, Notice, NoticeSource
from ckrun.procs import spawn_session
from ckrun.scheduler.base import JobInfo, JobSpec, JobState, RequeueOutcome

log = logging.getLogger(__name__)

#: A drill notice's own lead time, seconds; the supervisor caps it by ``grace_s``.
CHAOS_LEAD_S = 3600.0


def spawn_detached(argv: list[str], env: dict[str, str], *, output_fd: int) -> int:
    """Start ``argv`` in a new session (no controlling terminal, its own process group),
    stdout and stderr on ``output_fd``, default signal dispositions and no blocked
    signals; returns its pid.  Unlike the supervisor's training child
    (:func:`ckrun.supervisor.process.spawn`), nothing ties its life to this process: no
    parent-death signal (:func:`ckrun.procs.spawn_session` with ``death_signal=0``).

    Raises:
        OSError: the command cannot be executed (the message names it).
    """
    return spawn_session(argv, env, output_fd=output_fd, death_signal=0)


@dataclass(frozen=True)
class Options:
    """Local-profile keys.

    Attributes:
        chaos_preempt_every: deliver a drill notice every this many seconds of child
            runtime (0 = off). Accepts durations such as ``20s`` or ``2m``.
    """

    chaos_preempt_every: float = 0.0


class ChaosSource:
    """A :class:`NoticeSource` that emits one drill notice per ``every_s`` of training.

    The interval counts from the child's first training step (the ``training.json`` the
    child writes, :func:`ckrun.control.mark_training`), not from its spawn: start-up
    (interpreter, imports, restore) is not part of it, so every attempt gets ``every_s``
    of training.  A child that never reports a training start (it uses neither
    ``Checkpointer.load`` nor ``preemption_requested``, so it could not act on a notice)
    is not drilled.  Without a control directory (``attempt_started()`` called bare) the
    interval counts from the spawn.

    When the history of the run (``events.jsonl`` next to the control directory) shows a
    start-up plus save longer than ``every_s``, a warning says that attempts spend more
    time starting and saving than training.

    The supervisor calls :meth:`attempt_started` when it spawns a child; clocks are
    ``time.monotonic`` (spawn) and the wall clock (the child's training stamp).
    """

    name = "chaos"

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.interval_s = min(0.1, every_s)
        self._started: float | None = None
        self._cdir: str | None = None
        self.warning: str | None = None

    def attempt_started(self, now: float | None = None, control_dir: str | None = None) -> None:
        """Arm the timer for a new attempt (``now`` in monotonic seconds; ``control_dir``
        the child's ``CKRUN_CONTROL_DIR``)."""
        self._started = time.monotonic() if now is None else now
        self._cdir = control_dir
        if control_dir is not None:
            self.warning = slow_start_warning(self.every_s, control_dir)
            if self.warning:
                log.warning("%s", self.warning)

    def poll(self) -> Notice | None:
        """A drill notice once the child has trained ``every_s`` seconds, else None."""
        if self._started is None:
            return None
        if self._cdir is None:
            if time.monotonic() - self._started < self.every_s:
                return None
        else:
            from ckrun.control import training_started

            t0 = training_started(self._cdir)
            if t0 is None or time.time() - t0 < self.every_s:
                return None
        self._started = None
        return Notice.with_lead(DRILL, "chaos", CHAOS_LEAD_S, {"every_s": self.every_s})

    def close(self) -> None:
        """Nothing to release."""
        self._started = None


def measured_start_and_save(
    events: Iterable[Mapping[str, Any]],
) -> tuple[float | None, float | None]:
    """(start-up, save) seconds measured in a run's events (``events.jsonl``): the
    longest time from an attempt's ``spawn`` to its training start (``restore``/
    ``train_start`` event), and the longest ``save`` stall; None where nothing was
    measured."""
    from ckrun.notices import parse_utc

    spawn: dict[int, float] = {}
    starts: list[float] = []
    saves: list[float] = []
    for ev in events:
        try:
            a, kind, t = int(ev.get("attempt", 0)), ev.get("kind"), ev.get("utc")
            when = parse_utc(str(t)).timestamp()
        except (TypeError, ValueError):
            continue
        if kind == "spawn":
            spawn[a] = when
        elif kind in ("restore", "train_start") and a in spawn:
            starts.append(when - spawn.pop(a))
        elif kind == "save" and isinstance(ev.get("seconds"), (int, float)):
            saves.append(float(ev["seconds"]))
    return (max(starts) if starts else None), (max(saves) if saves else None)


def slow_start_warning(every_s: float, control_dir: str) -> str | None:
    """The warning of :class:`ChaosSource` for the run whose child has ``control_dir``
    (None when the interval is long enough)."""
    from ckrun.runlog import read_events

    root = os.path.normpath(control_dir)
    if os.path.basename(root).startswith("rank"):
        root = os.path.dirname(root)
    return chaos_warning(every_s, read_events(os.path.join(os.path.dirname(root), "events.jsonl")))


def chaos_warning(every_s: float, events: Iterable[Mapping[str, Any]]) -> str | None:
    """The warning for a chaos interval of ``every_s`` seconds given the run's events so
    far: start-up plus save longer than the interval (None when it is long enough)."""
    start, save = measured_start_and_save(events)
    if start is None:
        return None
    cost = start + (save or 0.0)
    if every_s >= cost:
        return None
    return (
        f"chaos_preempt_every {every_s:g} s is shorter than the measured start-up "
        f"{start:.1f} s + save {save or 0.0:.1f} s: each attempt spends more time starting "
        f"and saving than training; use --chaos-preempt-every {max(1, round(2 * cost))}s or more"
    )


class LocalScheduler:
    """The local backend (see module docstring)."""

    name = "local"

    def __init__(self, options: Options | None = None) -> None:
        self.options = options or Options()

    def _argv(self, spec: JobSpec) -> list[str]:
        return [
            sys.executable,
            "-m",
            "ckrun.cli",
            "run",
            "--run",
            spec.run,
            *spec.supervisor_args,
            "--",
            *spec.command,
        ]

    def render(self, spec: JobSpec) -> str:
        """The detached supervisor's command line (shell-quoted)."""
        return shlex.join(self._argv(spec))

    def submit(self, spec: JobSpec) -> str:
        """Start a detached supervisor; return its pid as the job id.

        Output goes to ``spec.env["CKRUN_SUPERVISOR_LOG"]`` (default
        ``<spec.storage>/supervisor.log``), appended.

        Raises:
            SchedulerError: the supervisor could not be started.
        """
        log = spec.env.get("CKRUN_SUPERVISOR_LOG") or os.path.join(spec.storage, "supervisor.log")
        os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
        env = dict(os.environ, **spec.env)
        try:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                pid = spawn_detached(self._argv(spec), env, output_fd=fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise SchedulerError(f"cannot start the local supervisor: {e}") from e
        return str(pid)

    def log_files(self, spec: JobSpec, job_id: str) -> list[str]:
        """The detached supervisor's log (its output and its child's)."""
        return [
            spec.env.get("CKRUN_SUPERVISOR_LOG") or os.path.join(spec.storage, "supervisor.log")
        ]

    def status(self, job_id: str) -> JobState:
        """RUNNING while the supervisor pid exists, else UNKNOWN (see ``ckrun status``)."""
        try:
            os.kill(int(job_id), 0)
        except (ProcessLookupError, ValueError):
            return JobState.UNKNOWN
        except PermissionError:
            return JobState.RUNNING
        return JobState.RUNNING

    def cancel(self, job_id: str) -> None:
        """SIGTERM the supervisor (it drains the child and does not restart); idempotent."""
        try:
            os.kill(int(job_id), signal.SIGTERM)
        except (ProcessLookupError, ValueError):
            pass

    def current(self) -> JobInfo:
        """This process as a local job (job id = supervisor pid)."""
        return JobInfo(backend="local", job_id=str(os.getpid()))

    def requeue(self, job: JobInfo) -> RequeueOutcome:
        """Always ``RESTART_HERE``: the supervisor starts the next attempt itself."""
        return RequeueOutcome.RESTART_HERE

    def notice_sources(self, job: JobInfo | None) -> list[NoticeSource]:
        """The chaos drill source when ``chaos_preempt_every`` > 0."""
        every = self.options.chaos_preempt_every
        return [ChaosSource(every)] if every > 0 else []
