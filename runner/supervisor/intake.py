"""What the supervisor takes in each round, as the machine's events (DESIGN.md §4.5).

* Signals (:mod:`ckrun.supervisor.signals`): SIGTERM and the notice signal (default
  USR1) become notices (the notice signal inside a Slurm job warns of the time limit,
  not of a preemption), SIGINT (Ctrl-C) a save-and-stop :class:`Interrupt`, HUP/QUIT are
  forwarded to the child's group (the library takes them as a notice and saves: the run
  then stops CANCELLED, resumable; a plain script dying of them fails), USR2 and CHLD
  only wake the loop.
* ``ckrun preempt`` / ``ckrun cancel`` requests from the run directory.
* A peer notice (``peer-notice.json``: the child's ranks agreed to stop for a notice that
  reached another node of a multi-node job, :func:`ckrun.control.write_peer_notice`),
  which drains this node like a notice of its own, without a restart in place.
* The notice sources (scheduler's, cloud, chaos): a cloud or scheduler notice means this
  machine goes away (``self_term``); a drill does not.
* A lost lease (the heartbeat found the run taken over): the child is told and drained,
  then exit 2, no requeue.

Every notice's deadline is on the monotonic clock at detection: the stated time is
believed only within the provider's window (:func:`ckrun.notices.believed_lead`).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Sequence
from typing import Any

from ckrun import control_files
from ckrun.config import RunConfig
from ckrun.notices import (
    DRILL,
    PREEMPTION,
    TERMINATION,
    TIME_LIMIT,
    Notice,
    NoticeSource,
    believed_lead,
)
from ckrun.scheduler.base import JobInfo
from ckrun.supervisor.messages import Event, Forward, Interrupt, NoticeEvent
from ckrun.supervisor.rundir import CANCEL_REQUEST, PREEMPT_REQUEST, RunDir
from ckrun.supervisor.signals import FORWARD


class NoticeIntake:
    """Turns the supervisor's inputs into :class:`NoticeEvent` and friends.

    Args:
        cfg: the run's config (``grace_s`` is every notice's own lead time).
        job: the job the supervisor runs in (None outside a scheduler's job).
        rundir: the run's state directory (requests, control directory).
        sources: the notice sources polled every round (closed by :meth:`close`).
        notice_sig: the notice signal.
        say: prints one ``[ckrun]`` line.
        append: appends one event to the run log (``kind``, then fields).
    """

    def __init__(
        self,
        cfg: RunConfig,
        job: JobInfo | None,
        rundir: RunDir,
        sources: Sequence[NoticeSource],
        notice_sig: int,
        say: Callable[[str], None],
        append: Callable[..., None],
    ) -> None:
        self.cfg, self.job, self.rundir, self.notice_sig = cfg, job, rundir, notice_sig
        self.sources = sources
        self.say, self.append = say, append
        #: the last notice turned into an event (its detail goes into notice.json)
        self.last_notice: Notice | None = None
        #: True once the lost lease was announced (it is announced once)
        self.lost_sent = False

    def notice_event(
        self, n: Notice, now: float, window_s: float | None = None, **kw: Any
    ) -> NoticeEvent:
        """``n`` as an event with its deadline ``now + believed lead`` (seconds,
        monotonic); ``window_s`` is the provider's notice window, ``kw`` the event's flags
        (``self_term``, ``cancel``, ``lease_lost``)."""
        lead, skew = believed_lead(n, window_s)
        if skew:
            self.say(skew)
            self.append("notice_skew", message=skew, source=n.source)
        self.last_notice = n
        return NoticeEvent(n.kind, n.source, now + lead, now, **kw)

    def from_signal(self, sig: int, now: float) -> Event | None:
        """The event for a recorded signal; None for one that only wakes the loop."""
        name = signal.Signals(sig).name
        grace = self.cfg.grace_s
        if sig == signal.SIGTERM:
            n = Notice.with_lead(TERMINATION, f"signal:{name}", grace)
            return self.notice_event(n, now, self_term=True)
        if sig == self.notice_sig:
            # Slurm's --signal lead time warns of the time limit, not of a preemption
            slurm = self.job is not None and self.job.backend == "slurm"
            n = Notice.with_lead(TIME_LIMIT if slurm else PREEMPTION, f"signal:{name}", grace)
            return self.notice_event(n, now)
        if sig == signal.SIGINT:
            return Interrupt(now)
        if sig in FORWARD:
            return Forward(sig, now)
        return None

    def from_signals(
        self, sigs: Sequence[int], now: float, resize: Callable[[], None]
    ) -> list[Event]:
        """The events of signals taken from the inbox, in order; ``resize`` is called for
        SIGWINCH (the console was resized: the child's pty follows)."""
        out: list[Event] = []
        for sig in sigs:
            if sig == signal.SIGWINCH:
                resize()
            elif (ev := self.from_signal(sig, now)) is not None:
                out.append(ev)
        return out

    def requests(self, now: float) -> list[Event]:
        """``ckrun preempt`` (a drill) and ``ckrun cancel`` requests, taken once each."""
        out: list[Event] = []
        req = self.rundir.take_request(PREEMPT_REQUEST)
        if req is not None:
            lead = float(req.get("lead_s") or self.cfg.grace_s)
            n = Notice.with_lead(DRILL, "cli:preempt", lead, {"requested_by": req})
            out.append(self.notice_event(n, now))
        req = self.rundir.take_request(CANCEL_REQUEST)
        if req is not None:
            n = Notice.with_lead(TERMINATION, "cli:cancel", self.cfg.grace_s)
            out.append(self.notice_event(n, now, cancel=True))
        return out

    def peer_notice(self, now: float) -> list[Event]:
        """Drain on a peer notice (taken once; [] when there is none).  Not ``self_term``:
        this machine stays; the scheduler decides (Kubernetes, Slurm: requeued, exit 75;
        the local backend restarts here)."""
        body = control_files.take_peer_notice(self.rundir.control_dir)
        if body is None:
            return []
        n = Notice.with_lead(PREEMPTION, "peer:agreed-step", self.cfg.grace_s, body)
        return [self.notice_event(n, now)]

    def poll(self, now: float) -> list[Event]:
        """One poll of every notice source."""
        out: list[Event] = []
        for src in self.sources:
            n = src.poll()
            if n is not None:  # a cloud/scheduler notice means this machine goes away
                lead = getattr(src, "lead_s", None)
                out.append(self.notice_event(n, now, lead, self_term=n.kind != DRILL))
        return out

    def lease_lost(self, why: str, now: float) -> NoticeEvent:
        """The heartbeat found the lease taken over: tell the child, stop (exit 2)."""
        self.lost_sent = True
        self.say(why)
        n = Notice.with_lead(TERMINATION, "lease:lost", self.cfg.grace_s, {"reason": why})
        return self.notice_event(n, now, lease_lost=True)

    def drill(self, source: str, now: float) -> NoticeEvent:
        """A drill notice from ``source`` with the run's grace period as its lead time."""
        return self.notice_event(Notice.with_lead(DRILL, source, self.cfg.grace_s), now)

    def attempt_started(self) -> None:
        """Tell the sources that time attempts (the chaos drill) that one started."""
        for src in self.sources:
            hook = getattr(src, "attempt_started", None)
            if hook is not None:
                hook(control_dir=self.rundir.control_dir)

    def close(self) -> None:
        """Close every notice source."""
        for src in self.sources:
            src.close()
