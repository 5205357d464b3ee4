"""The state of the supervisor's pure machine (:mod:`ckrun.supervisor.machine`).

Times are ``time.monotonic()`` seconds.  Every timer the supervisor keeps (notice
escalation, stray processes, restart back-off, second Ctrl-C) is a field here, so a
scripted history of ``step()`` calls is a plain table and the loop only executes actions.

Timing contract of a notice (DESIGN.md §4.5, issue 11 item 4)::

    notice ──────────────── TERM ──── KILL ── margin ── deadline
    now                    term_at   kill_at            min(notice deadline, now + grace_s)

``grace_s`` is the longest time from a notice to the supervisor's own exit: KILL lands
``margin_s`` before the deadline (the margin is the supervisor's own time to check
storage and requeue), TERM lands ``kill_delay_s`` before KILL, shortened to half of the
time left when the notice is too short for the full ``kill_delay_s``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckrun.config import RunConfig


class Phase(str, enum.Enum):
    """Supervisor phases (DESIGN.md §4.5)."""

    PREFLIGHT = "PREFLIGHT"
    RUNNING = "RUNNING"
    DRAINING = "DRAINING"
    STOPPING = "STOPPING"
    COMPLETED = "COMPLETED"
    ALREADY_COMPLETE = "ALREADY_COMPLETE"
    INCOMPATIBLE = "INCOMPATIBLE"
    FAILED = "FAILED"
    PREEMPTED = "PREEMPTED"
    REQUEUE_FAILED = "REQUEUE_FAILED"
    CANCELLED = "CANCELLED"
    LEASE_LOST = "LEASE_LOST"  # another supervisor took the run over: exit 2


TERMINAL = frozenset(
    {
        Phase.COMPLETED,
        Phase.ALREADY_COMPLETE,
        Phase.INCOMPATIBLE,
        Phase.FAILED,
        Phase.REQUEUE_FAILED,
        Phase.CANCELLED,
        Phase.LEASE_LOST,
    }
)


@dataclass(frozen=True)
class Policy:
    """Limits and timings (seconds) from the RunConfig.

    Attributes:
        grace_s: longest time from a notice to the supervisor's own exit.
        margin_s: KILL lands this long before the deadline.
        kill_delay_s: TERM → KILL delay (shortened when the notice is short).
        stray_s: once the command's own process has exited (and no notified process is
            still saving), what is left of its session gets TERM after ``stray_s`` and
            KILL ``stray_s`` later.
        no_progress_preemptions: preemptions in a row without a new checkpoint that stop
            the run (requeue-storm guard); 0 disables the guard.
        interrupt_window_s: a second SIGINT within this time of the first stops at once.
    """

    max_requeues: int = 100
    max_failures: int = 3
    crash_loop_failures: int = 2
    grace_s: float = 60.0
    margin_s: float = 2.0
    kill_delay_s: float = 10.0
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    stray_s: float = 2.0
    no_progress_preemptions: int = 5
    interrupt_window_s: float = 5.0

    def escalation(self, notice_at: float, deadline: float) -> tuple[float, float]:
        """``(term_at, kill_at)`` of a notice seen at ``notice_at`` with ``deadline``.

        KILL at ``deadline - margin_s``; TERM ``kill_delay_s`` earlier, or half-way from
        the notice to KILL when the notice is shorter than that (both inside the grace).
        """
        kill_at = max(notice_at, deadline - self.margin_s)
        delay = min(self.kill_delay_s, (kill_at - notice_at) / 2)
        return kill_at - delay, kill_at

    def describe(self) -> list[str]:
        """The notice timing these values give, in words (``ckrun config``)."""
        term_at, kill_at = self.escalation(0.0, self.grace_s)
        return [
            f"a notice: the command saves; TERM at +{term_at:g} s if it has not exited, "
            f"KILL at +{kill_at:g} s, the supervisor exits by +{self.grace_s:g} s at the "
            "latest (grace_s: notice to the supervisor's exit; KILL margin_s before it, "
            "TERM kill_delay_s before KILL)",
            "a notice signal no process catches is delivered as SIGTERM at once",
            f"processes left after the command exits: TERM at +{self.stray_s:g} s, KILL at "
            f"+{2 * self.stray_s:g} s (stray_s)",
            f"{self.no_progress_preemptions} preemptions in a row without a new checkpoint "
            "stop the run (no_progress_preemptions; 0: no limit); Ctrl-C saves and stops "
            f"(exit 130), twice within {self.interrupt_window_s:g} s stops at once",
        ]

    def backoff(self, n: int) -> float:
        """Delay before the restart after the ``n``-th failure or no-progress preemption:
        ``min(backoff_max_s, backoff_s * 2**(n-1))`` seconds."""
        return float(min(self.backoff_max_s, self.backoff_s * 2 ** max(0, n - 1)))


def policy_of(cfg: RunConfig) -> Policy:
    """The machine's :class:`Policy` from a run's config."""
    return Policy(
        max_requeues=cfg.max_requeues,
        max_failures=cfg.max_failures,
        crash_loop_failures=cfg.crash_loop_failures,
        grace_s=cfg.grace_s,
        margin_s=cfg.margin_s,
        kill_delay_s=cfg.kill_delay_s,
        backoff_s=cfg.backoff_s,
        backoff_max_s=cfg.backoff_max_s,
        stray_s=cfg.stray_s,
        no_progress_preemptions=cfg.no_progress_preemptions,
    )


@dataclass(frozen=True)
class State:
    """Supervisor state; times are monotonic seconds.

    Attributes:
        attempt: attempts started so far in this run (the next attempt's 0-based id).
        failures / preemptions / no_progress / streak: the run's budgets (persisted
            with the run by the loop, :mod:`ckrun.supervisor.budgets`): failures of the
            command, preemptions, failures in a row without progress (crash-loop guard),
            preemptions in a row without a new checkpoint (requeue-storm guard).
        base_step: newest committed step when the current attempt started (None: none).
        child: a child of the current attempt is alive (not yet reaped with its session).
        notice_at / deadline: drain start and deadline (see the module docstring).
        kill_at: KILL time once TERM was sent (STOPPING).
        leader_status: the command's own process exited with this status while other
            processes of its session are left (strays).
        strays_term_at / strays_kill_at: TERM / KILL times of those strays.
        respawn_at: restart after a failure's back-off.
        requeue_at: ask for the requeue after a no-progress preemption's back-off.
        notice_pending: a notice arrived during preflight: do not start the command.
        self_term: the supervisor itself got SIGTERM, or a notice source said this
            machine goes away (cloud, scheduler): never restart in place.
        cancel: ``ckrun cancel`` or Ctrl-C: stop after the save; ``ctrl_c``: by SIGINT
            (exit 130), ``interrupt_at``: when the first SIGINT came.
        interrupted: HUP/QUIT forwarded to the child (it is being stopped by the user).
    """

    policy: Policy = field(default_factory=Policy)
    phase: Phase = Phase.PREFLIGHT
    attempt: int = 0
    failures: int = 0
    preemptions: int = 0
    no_progress: int = 0
    streak: int = 0
    base_step: int | None = None
    child: bool = False
    notice_kind: str | None = None
    notice_source: str | None = None
    notice_at: float | None = None
    deadline: float | None = None
    kill_at: float | None = None
    killed: bool = False
    leader_status: int | None = None
    strays_term_at: float | None = None
    strays_kill_at: float | None = None
    respawn_at: float | None = None
    requeue_at: float | None = None
    notice_pending: bool = False
    cancel: bool = False
    ctrl_c: bool = False
    interrupt_at: float | None = None
    self_term: bool = False
    lease_lost: bool = False
    interrupted: int | None = None
    pending_code: int | None = None
    exit_code: int | None = None
    why: str = ""

    @property
    def terminal(self) -> bool:
        """The run is over for this supervisor: a phase of :data:`TERMINAL`, or the exit
        code decided (a PREEMPTED run the scheduler requeued).  The machine ignores
        every later event and the loop returns :attr:`exit_code`."""
        return self.phase in TERMINAL or self.exit_code is not None
