"""The optimum checkpoint interval and the goodput it yields (Young 1974, Daly 2006).

For interruptions arriving as a Poisson process with mean time between interruptions
``M`` and a checkpoint that costs ``δ`` seconds of training time: J. W. Young, "A first
order approximation to the optimum checkpoint interval", Communications of the ACM
17(9):530-531, 1974 (:func:`young_daly_interval`); J. T. Daly, "A higher order estimate of
the optimum checkpoint interval for restart dumps", Future Generation Computer Systems
22(3):303-312, 2006 (:func:`daly_interval`, eq. 37; :func:`expected_goodput`, eq. 20).
Pure functions of seconds; :mod:`ckrun.checkpoint.interval` measures the inputs.
"""

from __future__ import annotations

import math

__all__ = ["daly_interval", "expected_goodput", "young_daly_interval"]


def young_daly_interval(save_cost_s: float, mtbi_s: float) -> float:
    """First-order optimum compute time between checkpoints, sqrt(2 δ M) (Young 1974).

    Args:
        save_cost_s: δ, training time one checkpoint costs, seconds (>= 0).
        mtbi_s: M, mean time between interruptions, seconds (> 0).

    Returns:
        The interval in seconds.

    Raises:
        ValueError: a negative cost or a non-positive MTBI.
    """
    _check(save_cost_s, mtbi_s)
    return math.sqrt(2.0 * save_cost_s * mtbi_s)


def daly_interval(save_cost_s: float, mtbi_s: float) -> float:
    """Daly's higher-order optimum (Daly 2006, eq. 37), seconds.

    ``sqrt(2δM)·[1 + sqrt(δ/2M)/3 + (δ/2M)/9] − δ`` for ``δ < 2M``, else ``M``.

    Raises:
        ValueError: as :func:`young_daly_interval`.
    """
    _check(save_cost_s, mtbi_s)
    d, m = save_cost_s, mtbi_s
    if d >= 2.0 * m:
        return m
    r = d / (2.0 * m)
    return math.sqrt(2.0 * d * m) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - d


def expected_goodput(
    interval_s: float, save_cost_s: float, mtbi_s: float, restart_s: float = 0.0
) -> float:
    """Expected fraction of wall time that becomes kept progress (Daly 2006, eq. 20).

    Wall time per ``interval_s`` of work: ``M e^{R/M} (e^{(T+δ)/M} − 1)`` for Poisson
    interruptions with mean ``M``, a checkpoint cost ``δ`` and a restart cost ``R``.

    Args:
        interval_s: T, compute seconds between checkpoints (> 0).
        save_cost_s: δ, seconds per checkpoint.
        mtbi_s: M, seconds.
        restart_s: R, seconds from an interruption to training again (>= 0).

    Returns:
        Goodput in (0, 1].

    Raises:
        ValueError: non-positive interval or MTBI, negative cost or restart.
    """
    _check(save_cost_s, mtbi_s)
    if interval_s <= 0 or restart_s < 0:
        raise ValueError(
            f"interval_s must be > 0 and restart_s >= 0 (got {interval_s}, {restart_s})"
        )
    m = mtbi_s
    wall = m * math.exp(restart_s / m) * math.expm1((interval_s + save_cost_s) / m)
    return min(1.0, interval_s / wall)


def _check(save_cost_s: float, mtbi_s: float) -> None:
    if not (save_cost_s >= 0 and mtbi_s > 0) or math.isinf(save_cost_s):
        raise ValueError(f"need save_cost_s >= 0 and mtbi_s > 0 (got {save_cost_s}, {mtbi_s})")
