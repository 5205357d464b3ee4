"""Adaptive checkpoint interval (``checkpoint_every="auto"``): Young/Daly from measurements.

The interval of compute between two checkpoints that minimises the expected waste, for
interruptions arriving as a Poisson process with mean time between interruptions ``M``
and a checkpoint that costs ``δ`` seconds of training time, is to first order

    T = sqrt(2 δ M)

(J. W. Young, "A first order approximation to the optimum checkpoint interval",
Communications of the ACM 17(9):530-531, 1974; J. T. Daly, "A higher order estimate of
the optimum checkpoint interval for restart dumps", Future Generation Computer Systems
22(3):303-312, 2006, eq. 37 refines it and is :func:`daly_interval`).  Daly's complete
model gives the expected wall time per interval, hence :func:`expected_goodput`.  The
formulas are in :mod:`ckrun.checkpoint.young_daly`; this module measures their inputs.

Inputs, in order of precedence:

* ``δ``: the save cost measured in this process (the stall of an ``async_save``, the
  duration of a ``save``), else the median of the run's recorded save costs: the stalls
  of the library's ``save`` events in ``events.jsonl`` (what the training loop waited),
  or for attempts without them the ``save_duration_s`` of their commits (recorded at each
  attempt's end; for an async save the time to durable, an upper bound).
* ``M``: ``mtbi_s`` given by the caller or the profile (``CKRUN_MTBI_S``), else the run's
  history: ``(exposure + PRIOR_MTBI_S) / (interruptions + 1)`` where exposure is the wall
  time of all attempts and an interruption is an attempt with a ``notice`` or
  ``preempted`` event (a Gamma prior worth one interruption per :data:`PRIOR_MTBI_S`; with
  no history the estimate is the prior, and it approaches the observed rate as history
  accumulates).

The interval is clamped to ``[min_interval_s, max_interval_s]`` and never below the last
time to durable of an async save (at most one save is in flight).

Usage (the decision is time-based; pass ``sync=True`` with several ranks)::

    ckpt = ckrun.Checkpointer.from_env(compat, checkpoint_every="auto")
    for step in range(start, steps):
        train_step()
        if ckrun.preemption_requested():
            ckpt.save(step, state)
            sys.exit(ckrun.ExitCode.PREEMPTED)
        if ckpt.should_save(step):
            ckpt.async_save(step, state)

``ckpt.interval()`` returns the current :class:`IntervalEstimate`; :func:`status_line`
is the line ``ckrun status`` prints.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckrun.checkpoint.young_daly import daly_interval, expected_goodput, young_daly_interval
from ckrun.errors import ConfigError
from ckrun.notices import parse_utc, utcnow
from ckrun.runlog import read_events

if TYPE_CHECKING:  # torch: not imported by ``ckrun status``
    from ckrun.checkpoint.async_save import AsyncSaver
    from ckrun.checkpoint.pipeline import CommitContext

__all__ = [
    "AutoInterval",
    "History",
    "IntervalEstimate",
    "daly_interval",
    "expected_goodput",
    "parse_every",
    "should_save",
    "status_line",
    "young_daly_interval",
]

#: Prior mean time between interruptions, seconds (one per hour: a spot VM's worst case).
PRIOR_MTBI_S = 3600.0
MIN_INTERVAL_S = 10.0
MAX_INTERVAL_S = 6 * 3600.0
INTERRUPTION_KINDS = frozenset({"notice", "preempted"})


@dataclass(frozen=True)
class History:
    """What a run's ``events.jsonl`` says about interruptions and save costs.

    Attributes:
        exposure_s: wall seconds of all attempts (spawn to end, or now).
        interruptions: attempts that got a ``notice`` or were ``preempted``.
        save_costs_s: what each save cost the training, seconds: the stall of every
            ``save`` event the library recorded (the time the training loop waited: for
            an ``async_save`` its snapshot, not its time to durable), and for an attempt
            without such events the ``save_s`` of the commits recorded at its end (start
            of the save to its commit: for an async save an upper bound).
    """

    exposure_s: float
    interruptions: int
    save_costs_s: tuple[float, ...]

    def mtbi_s(self, prior_s: float = PRIOR_MTBI_S) -> float:
        """``(exposure + prior) / (interruptions + 1)``, seconds (see module docstring)."""
        return (self.exposure_s + prior_s) / (self.interruptions + 1)


def read_history(events_path: str, now: float | None = None) -> History:
    """Summarise ``events_path`` (a missing file is an empty history).

    Args:
        now: epoch seconds used as the end of an attempt still running (default: now).
    """
    spawn: dict[int, float] = {}
    end: dict[int, float] = {}
    hit: set[int] = set()
    stalls: dict[int, list[float]] = {}  # per attempt: the library's save events
    commits: dict[int, list[float]] = {}  # per attempt: save_s of its commits
    for ev in read_events(events_path):
        try:
            a, kind = int(ev.get("attempt", 0)), ev.get("kind")
            t = parse_utc(str(ev["utc"])).timestamp()
        except (KeyError, TypeError, ValueError):
            continue
        if kind == "spawn":
            spawn[a] = t
        elif kind == "save" and isinstance(ev.get("seconds"), (int, float)):
            stalls.setdefault(a, []).append(float(ev["seconds"]))
        elif kind == "attempt_end":
            end[a] = t
            commits.setdefault(a, []).extend(
                float(c["save_s"])
                for c in ev.get("commits") or []
                if isinstance(c, dict) and isinstance(c.get("save_s"), (int, float))
            )
        elif kind in INTERRUPTION_KINDS:
            hit.add(a)
    stop = utcnow().timestamp() if now is None else now
    exposure = sum(max(0.0, end.get(a, stop) - t) for a, t in spawn.items())
    costs = [c for a in sorted(stalls.keys() | commits.keys()) for c in stalls.get(a) or commits[a]]
    return History(exposure, len(hit), tuple(costs))


@dataclass(frozen=True)
class IntervalEstimate:
    """The interval ``checkpoint_every="auto"`` picks, with its inputs.

    Attributes:
        interval_s: compute seconds between checkpoints.
        save_cost_s: δ used, seconds (None: unknown, the interval is the minimum).
        mtbi_s: M used, seconds.
        mtbi_source: ``"given"``, ``"history"`` or ``"prior"``.
        interruptions: interruptions seen in the history.
        exposure_s: wall seconds of history.
        goodput: expected goodput at ``interval_s`` (None when δ is unknown).
    """

    interval_s: float
    save_cost_s: float | None
    mtbi_s: float
    mtbi_source: str
    interruptions: int
    exposure_s: float
    goodput: float | None

    def describe(self) -> str:
        """One line for ``ckrun status``."""
        if self.save_cost_s is None:
            return (
                f"checkpoint interval (auto): {_dur(self.interval_s)} until a save cost "
                f"is measured (MTBI {_dur(self.mtbi_s)}, {self.mtbi_source})"
            )
        gp = f"{100 * self.goodput:.1f} %" if self.goodput is not None else "n/a"
        if self.mtbi_source == "history":
            src = (
                f"{self.interruptions} interruptions in {_dur(self.exposure_s)} of history"
                f" and a prior of one per {_dur(PRIOR_MTBI_S)}"
            )
        else:
            src = {"given": "given", "prior": "prior, no history"}[self.mtbi_source]
        return (
            f"checkpoint interval (auto, Young/Daly): {_dur(self.interval_s)} from save "
            f"cost {self.save_cost_s:.2f} s and MTBI {_dur(self.mtbi_s)} ({src}); "
            f"expected goodput {gp}"
        )


def _dur(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def estimate(
    save_cost_s: float | None,
    history: History,
    *,
    mtbi_s: float | None = None,
    min_interval_s: float = MIN_INTERVAL_S,
    max_interval_s: float = MAX_INTERVAL_S,
    floor_s: float = 0.0,
) -> IntervalEstimate:
    """The clamped Young/Daly interval for a save cost and a history (see module doc).

    Args:
        save_cost_s: δ in seconds, or None to use the history's median save cost.
        mtbi_s: M given by the caller/profile; None derives it from ``history``.
        floor_s: lower bound besides ``min_interval_s`` (the last time to durable).
    """
    if save_cost_s is None and history.save_costs_s:
        save_cost_s = statistics.median(history.save_costs_s)
    if mtbi_s is not None:
        m, src = mtbi_s, "given"
    else:
        m, src = history.mtbi_s(), "history" if history.exposure_s > 0 else "prior"
    lo = max(min_interval_s, floor_s)
    if save_cost_s is None:
        return IntervalEstimate(lo, None, m, src, history.interruptions, history.exposure_s, None)
    t = min(max(young_daly_interval(save_cost_s, m), lo), max(max_interval_s, lo))
    return IntervalEstimate(
        t,
        save_cost_s,
        m,
        src,
        history.interruptions,
        history.exposure_s,
        expected_goodput(t, save_cost_s, m),
    )


def from_history(state_root: str, *, mtbi_s: float | None = None) -> IntervalEstimate:
    """The interval ``auto`` would pick for the run whose state directory is ``state_root``.

    Uses ``<state_root>/events.jsonl`` only (save costs from the attempts' recorded
    commits); for ``ckrun status``.  ``mtbi_s`` defaults to ``CKRUN_MTBI_S``.

    Raises:
        ConfigError: ``CKRUN_MTBI_S`` is not a positive number.
    """
    if mtbi_s is None:
        mtbi_s = env_mtbi()
    return estimate(None, read_history(os.path.join(state_root, "events.jsonl")), mtbi_s=mtbi_s)


def env_mtbi() -> float | None:
    """``CKRUN_MTBI_S`` (the profile's mean time between interruptions), or None.

    Raises:
        ConfigError: not a positive number.
    """
    raw = os.environ.get("CKRUN_MTBI_S")
    if not raw:
        return None
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not (v > 0 and math.isfinite(v)):
        raise ConfigError(f"CKRUN_MTBI_S={raw!r}: expected a positive number of seconds")
    return v


class AutoInterval:
    """The time-based save decision behind ``Checkpointer.should_save`` with ``"auto"``.

    The clock restarts when :meth:`due` returns True (the caller saves then); it returns
    True again once ``interval + cost`` seconds have passed, i.e. ``interval`` seconds of
    compute plus the save itself.

    Args:
        cost: returns the current save cost in seconds (None: unknown) and the floor
            (the last time to durable of an async save), both measured in-process.
        events_path: the run's ``events.jsonl`` (None: no history).
        mtbi_s: M given by the caller; default ``CKRUN_MTBI_S``, else the history.
        clock: monotonic clock, seconds (tests inject one).
    """

    def __init__(
        self,
        cost: Callable[[], tuple[float | None, float]],
        *,
        events_path: str | None = None,
        mtbi_s: float | None = None,
        min_interval_s: float = MIN_INTERVAL_S,
        max_interval_s: float = MAX_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cost = cost
        self._history = read_history(events_path) if events_path else History(0.0, 0, ())
        self._mtbi = mtbi_s if mtbi_s is not None else env_mtbi()
        self._bounds = (min_interval_s, max_interval_s)
        self._clock = clock
        self._since = clock()

    def current(self) -> IntervalEstimate:
        """The estimate with the latest in-process measurements."""
        cost, floor = self._cost()
        return estimate(
            cost,
            self._history,
            mtbi_s=self._mtbi,
            min_interval_s=self._bounds[0],
            max_interval_s=self._bounds[1],
            floor_s=floor,
        )

    def due(self) -> bool:
        """True when the interval (plus the save cost) has elapsed since the last True."""
        est = self.current()
        now = self._clock()
        if now - self._since >= est.interval_s + (est.save_cost_s or 0.0):
            self._since = now
            return True
        return False


def parse_every(value: Any) -> int | str | None:
    """Validate ``checkpoint_every``: None, a positive int (steps) or ``"auto"``.

    Raises:
        ConfigError: anything else.
    """
    if value is None or value == "auto":
        return value  # type: ignore[no-any-return]
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ConfigError(
        f"checkpoint_every={value!r}: use a positive number of steps, "
        '"auto" (Young/Daly from measured costs) or None'
    )


def events_path_for(storage: Any) -> str | None:
    """The run's ``events.jsonl`` as seen from the child: next to ``CKRUN_CONTROL_DIR``
    (``<state root>/control[/rankN]``), else in a local run root; None when unknown."""
    from ckrun.runlog import child_events_path

    path = child_events_path()
    if path is not None:
        return path
    local = getattr(storage, "local_path", None)
    path = local("events.jsonl") if callable(local) else None
    return path if isinstance(path, str) and os.path.exists(path) else None


def auto_for(
    ctx: CommitContext, saver: Callable[[], AsyncSaver | None], *, mtbi_s: float | None
) -> AutoInterval:
    """The :class:`AutoInterval` of a Checkpointer: in-process save costs (the last async
    stall and durable time, else the last synchronous save's duration), the run's history
    of interruptions (``events.jsonl``) unless ``mtbi_s`` is given."""

    def cost() -> tuple[float | None, float]:
        a, w = saver(), ctx.written
        if a is not None and a.last_stall_s is not None:
            return float(a.last_stall_s), float(a.last_durable_s or 0.0)
        return (float(w.save_duration_s) if w is not None else None), 0.0

    return AutoInterval(cost, events_path=events_path_for(ctx.storage), mtbi_s=mtbi_s)


def should_save(
    every: int | str | None, auto: AutoInterval | None, step: int, *, sync: bool = False
) -> bool:
    """The decision of ``Checkpointer.should_save`` (see there).

    Raises:
        ConfigError: ``every`` is None.
    """
    if every is None:
        raise ConfigError(
            "should_save() needs Checkpointer(checkpoint_every=N) (steps) or "
            'checkpoint_every="auto"'
        )
    if isinstance(every, int):
        due = step > 0 and step % every == 0
    else:
        assert auto is not None
        due = auto.due()
    if sync:
        import torch
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([int(due)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            due = bool(flag.item())
    return due


def status_line(state_root: str) -> str:
    """The ``ckrun status`` line: the interval ``"auto"`` would pick for this run and the
    goodput it expects (never raises: a bad ``CKRUN_MTBI_S`` is reported in the line)."""
    try:
        return from_history(state_root).describe()
    except ConfigError as e:
        return f"checkpoint interval (auto): {e}"
