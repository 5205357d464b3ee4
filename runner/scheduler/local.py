"""The local backend (the embedded default): runs on this machine, restarts in place.

``submit`` starts a detached supervisor (``python -m ckrun.cli run ...`` in its own
session, output to ``supervisor.log``); the foreground path of ``ckrun submit`` runs the
supervisor in-process instead.  ``requeue`` answers ``RESTART_HERE``: the supervisor loop
starts the next attempt itself.

``chaos_preempt_every`` (profile key, CLI ``--chaos-preempt-every 20s``) delivers a drill
notice every N seconds of child runtime, a one-command demonstration of the resume path.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass

from ckrun.errors import SchedulerError
from ckrun.notices import DRILL, Notice, NoticeSource
from ckrun.scheduler.base import JobInfo, JobSpec, JobState, RequeueOutcome

#: A drill notice's own lead time, seconds; the supervisor caps it by ``grace_s``.
CHAOS_LEAD_S = 3600.0

#: Signals reset to their default action in the detached supervisor (Python ignores
#: SIGPIPE and SIGXFSZ; a caller may have handlers or ignores for the rest).
RESET_SIGNALS = tuple(
    getattr(signal, n)
    for n in (
        "SIGPIPE",
        "SIGXFSZ",
        "SIGTERM",
        "SIGINT",
        "SIGHUP",
        "SIGQUIT",
        "SIGUSR1",
        "SIGUSR2",
        "SIGCHLD",
        "SIGALRM",
    )
    if hasattr(signal, n)
)


def spawn_detached(argv: list[str], env: dict[str, str], *, output_fd: int) -> int:
    """Start ``argv`` in a new session (no controlling terminal, its own process group),
    stdout and stderr on ``output_fd``, default signal dispositions and no blocked
    signals; returns its pid.  Unlike the supervisor's training child
    (:func:`ckrun.supervisor.process.spawn`), nothing ties its life to this process.

    Raises:
        OSError: the command cannot be executed (the message names it).
    """
    actions = [(os.POSIX_SPAWN_DUP2, output_fd, 1), (os.POSIX_SPAWN_DUP2, output_fd, 2)]
    try:
        return os.posix_spawnp(
            argv[0],
            argv,
            env,
            file_actions=actions,
            setsid=True,
            setsigmask=(),
            setsigdef=RESET_SIGNALS,
        )
    except OSError as e:
        raise OSError(e.errno, f"cannot run {argv[0]!r}: {e.strerror}") from e


@dataclass(frozen=True)
class Options:
    """Local-profile keys.

    Attributes:
        chaos_preempt_every: deliver a drill notice every this many seconds of child
            runtime (0 = off). Accepts durations such as ``20s`` or ``2m``.
    """

    chaos_preempt_every: float = 0.0


class ChaosSource:
    """A :class:`NoticeSource` that emits one drill notice per ``every_s`` of child runtime.

    The supervisor calls :meth:`attempt_started` when it spawns a child; the clock is
    ``time.monotonic``.
    """

    name = "chaos"

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.interval_s = min(0.1, every_s)
        self._started: float | None = None

    def attempt_started(self, now: float | None = None) -> None:
        """Arm the timer for a new attempt (``now`` in monotonic seconds)."""
        self._started = time.monotonic() if now is None else now

    def poll(self) -> Notice | None:
        """A drill notice once the child has run ``every_s`` seconds, else None."""
        if self._started is None or time.monotonic() - self._started < self.every_s:
            return None
        self._started = None
        return Notice.with_lead(DRILL, "chaos", CHAOS_LEAD_S, {"every_s": self.every_s})

    def close(self) -> None:
        """Nothing to release."""
        self._started = None


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
