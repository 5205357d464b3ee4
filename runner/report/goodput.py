"""Where a run's wall time went, and its goodput.

Definition (after Google Cloud's *ML Productivity Goodput*: "Goodput: a new metric to
measure AI productivity", Google Cloud blog, 2024, and its ``ml-goodput-measurement``
library: goodput is the fraction of time spent on *productive* training, where work that
is recomputed after a failure is not productive):

    goodput = productive / wall

* **wall**: from the run's submission (or first spawn) to the end of its last attempt
  (now, while it runs).
* **productive**: time the training loop spent in steps whose results survive to the
  newest commit.  An attempt's steps survive up to its *kept* step: the newest checkpoint
  it committed that is not beyond the step a later attempt resumed from (a later attempt
  that resumed from an older checkpoint recomputes the rest) nor beyond the run's newest
  commit.  Its productive time is the training from its training start to the moment the
  kept step's state was captured (the start of that save's stall), save stalls excluded.

Overheads, each reported (all seconds):

* **startup**: spawn to the start of the restore (process, interpreter, imports, model);
* **restore**: ``Checkpointer.load``;
* **saving**: every stall of the training loop for a save (a whole synchronous save, an
  ``async_save``'s snapshot);
* **lost**: training after the kept state, recomputed by a later attempt (with the lost
  steps: counted when the attempt saved its last step, else estimated at its step rate);
* **shutdown**: from the end of the last save of an attempt that saved and stopped
  (preemption, completion) to the child being gone;
* **waiting**: between attempts (backoff, the scheduler's requeue and queueing) and from
  submission to the first spawn;
* **unsaved**: training of the attempt still running that no checkpoint holds yet (not
  lost yet, not productive yet).

They add up to the wall time.  Steps are counted as the library's examples number them
(checkpoint ``N`` holds training step ``N``, 0-based): an attempt resumed from ``R`` that
keeps ``K`` did ``K - R`` steps; a fresh start that keeps ``K`` did ``K + 1``.

An attempt whose training process did not report its training start (a log from before
that event existed, or a child that does not use the library) cannot be split: its
start-up and restore count as training.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckrun.report.history import Attempt, History

#: Segment categories in timeline order (also the keys of :attr:`Accounting.totals`).
CATEGORIES = (
    "startup",
    "restore",
    "productive",
    "saving",
    "lost",
    "shutdown",
    "unsaved",
    "waiting",
)


@dataclass(frozen=True)
class Segment:
    """``[start, end)`` of one category within (or between) attempts; epoch seconds."""

    category: str
    start: float
    end: float
    attempt: int | None

    @property
    def seconds(self) -> float:
        """Its duration."""
        return max(0.0, self.end - self.start)


@dataclass
class AttemptAccount:
    """One attempt's accounting.

    Attributes:
        attempt: its number.
        base: the step it resumed from (-1: fresh start).
        kept: the step up to which its work survives (``base``: none of it).
        reached: the newest step it saved, when known.
        lost_steps: steps of its training that were lost (None: no rate to estimate).
        lost_estimated: True when ``lost_steps`` is an estimate from the step rate.
        segments: its timeline.
    """

    attempt: int
    base: int
    kept: int
    reached: int | None
    lost_steps: float | None
    lost_estimated: bool
    outcome: str
    measured: bool
    segments: list[Segment] = field(default_factory=list)

    def seconds(self, category: str) -> float:
        """Total seconds of ``category`` in this attempt."""
        return sum(s.seconds for s in self.segments if s.category == category)

    @property
    def productive_steps(self) -> int:
        """Steps of this attempt that survive."""
        return max(0, self.kept - self.base)


@dataclass
class Accounting:
    """A run's accounting: segments, totals per category, goodput."""

    start: float
    end: float
    attempts: list[AttemptAccount]
    waits: list[Segment]
    final_step: int | None

    @property
    def wall_s(self) -> float:
        """Wall seconds from the start to the end."""
        return max(0.0, self.end - self.start)

    @property
    def totals(self) -> dict[str, float]:
        """Seconds per category (:data:`CATEGORIES`)."""
        out = dict.fromkeys(CATEGORIES, 0.0)
        for a in self.attempts:
            for s in a.segments:
                out[s.category] += s.seconds
        for w in self.waits:
            out["waiting"] += w.seconds
        return out

    @property
    def goodput(self) -> float | None:
        """productive / wall in [0, 1]; None for an empty history."""
        return self.totals["productive"] / self.wall_s if self.wall_s > 0 else None

    @property
    def productive_steps(self) -> int:
        """Steps whose results survive."""
        return sum(a.productive_steps for a in self.attempts)

    @property
    def lost_steps(self) -> float | None:
        """Steps recomputed (None when an attempt's loss could not be estimated)."""
        vals = [a.lost_steps for a in self.attempts]
        if any(v is None for v in vals):
            return None
        return float(sum(v for v in vals if v is not None))


def _kept(a: Attempt, bound: int | None, base: int) -> int:
    ok = [c.step for c in a.commits if bound is None or c.step <= bound]
    return max([base, *ok])


def _capture_time(a: Attempt, step: int) -> float | None:
    """When the state of ``step`` was captured: the start of its save's stall (the
    reported save, else the commit minus its save duration)."""
    for s in a.saves:
        if s.step == step:
            return s.start
    for c in a.commits:
        if c.step == step:
            return c.committed - c.save_s
    return None


def _stalls(a: Attempt) -> list[tuple[float, float, int]]:
    """The loop's save stalls ``(start, end, step)``: reported saves, else (for an
    attempt that reported none) its commits."""
    if a.saves:
        return sorted((s.start, s.end, s.step) for s in a.saves)
    return sorted((c.committed - c.save_s, c.committed, c.step) for c in a.commits)


def _split(out: list[Segment], t0: float, t1: float, keep_t: float, n: int, after: str) -> None:
    """Training in ``[t0, t1)``: productive before ``keep_t``, ``after`` from it."""
    if t1 <= t0:
        return
    if keep_t > t0:
        out.append(Segment("productive", t0, min(t1, keep_t), n))
    if t1 > keep_t:
        out.append(Segment(after, max(t0, keep_t), t1, n))


def account_attempt(a: Attempt, bound: int | None, now: float) -> AttemptAccount:
    """Segments of one attempt; ``bound`` is the newest step its work may keep (see the
    module docstring), ``now`` the end of a running attempt."""
    base = a.resume if a.resume is not None else -1
    kept = _kept(a, bound, base)
    end = a.end if a.end is not None else now
    segs: list[Segment] = []
    t = a.spawn
    if a.train_start is not None:
        ts = min(max(a.train_start, a.spawn), end)
        rs = max(a.spawn, ts - (a.restore_s or 0.0))
        if rs > a.spawn:
            segs.append(Segment("startup", a.spawn, rs, a.attempt))
        if ts > rs:
            segs.append(Segment("restore", rs, ts, a.attempt))
        t = ts
    keep_t = t
    if kept > base:
        cap = _capture_time(a, kept)
        keep_t = cap if cap is not None else t
    running = a.end is None
    after = "unsaved" if running else "lost"
    stalls = [(max(s0, t), min(s1, end), st) for s0, s1, st in _stalls(a) if s1 > t and s0 < end]
    last_step: int | None = None
    for s0, s1, st in stalls:
        _split(segs, t, s0, keep_t, a.attempt, after)
        if s1 > s0:
            segs.append(Segment("saving", max(s0, t), s1, a.attempt))
        t = max(t, s1)
        last_step = st
    stopped = a.outcome in ("preempted", "completed", "cancelled") and last_step is not None
    if stopped and not running and last_step == kept:
        if end > t:
            segs.append(Segment("shutdown", t, end, a.attempt))
    else:
        _split(segs, t, end, keep_t, a.attempt, after)
    reached = max((s.step for s in a.saves), default=None)
    if reached is None and a.commits:
        reached = max(c.step for c in a.commits)
    lost_s = sum(s.seconds for s in segs if s.category == "lost")
    lost_steps: float | None
    estimated = False
    if lost_s == 0:
        lost_steps = 0.0
    elif stopped and last_step is not None and last_step == reached and a.outcome != "failure":
        lost_steps = float(max(0, reached - kept))
    else:
        prod = sum(s.seconds for s in segs if s.category == "productive")
        rate = (kept - base) / prod if prod > 0 and kept > base else None
        lost_steps = round(lost_s * rate, 1) if rate is not None else None
        estimated = True
    return AttemptAccount(
        a.attempt, base, kept, reached, lost_steps, estimated, a.outcome, a.measured, segs
    )


def account(h: History, now: float, newest_step: int | None = None) -> Accounting:
    """The :class:`Accounting` of a history.

    Args:
        h: the parsed history.
        now: epoch seconds taken as the end of a running attempt.
        newest_step: the run's newest committed step as storage says (default: the
            newest the attempts recorded).
    """
    steps = [c.step for a in h.attempts for c in a.commits]
    final = newest_step if newest_step is not None else (max(steps) if steps else None)
    accs: list[AttemptAccount] = []
    for i, a in enumerate(h.attempts):
        later = [b.resume if b.resume is not None else -1 for b in h.attempts[i + 1 :]]
        bounds = [x for x in (*later, final) if x is not None]
        accs.append(account_attempt(a, min(bounds) if bounds else None, now))
    waits: list[Segment] = []
    if h.attempts and h.submitted is not None and h.submitted < h.attempts[0].spawn:
        waits.append(Segment("waiting", h.submitted, h.attempts[0].spawn, None))
    for prev, nxt in zip(h.attempts, h.attempts[1:], strict=False):
        if prev.end is not None and nxt.spawn > prev.end:
            waits.append(Segment("waiting", prev.end, nxt.spawn, None))
    if h.attempts:
        start = min([h.attempts[0].spawn, *([h.submitted] if h.submitted else [])])
        last = h.attempts[-1]
        end = last.end if last.end is not None else now
    else:
        start = end = h.submitted or now
    return Accounting(start, end, accs, waits, final)
