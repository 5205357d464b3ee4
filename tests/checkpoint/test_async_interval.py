"""``checkpoint_every="auto"``: the Young/Daly formulas against hand-computed values, the
history read from a synthetic events.jsonl, and the decision of ``should_save``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import ckrun
import pytest
import torch
from ckrun.checkpoint import interval as iv
from ckrun.errors import ConfigError


def test_young_daly_hand_computed() -> None:
    assert iv.young_daly_interval(2.0, 3600.0) == pytest.approx(120.0)  # sqrt(2*2*3600)
    assert iv.young_daly_interval(0.5, 7200.0) == pytest.approx(84.8528137)  # sqrt(7200)
    assert iv.young_daly_interval(0.0, 100.0) == 0.0
    # Daly eq. 37, δ=2, M=3600: r=δ/2M=1/3600; 120*(1 + (1/60)/3 + (1/3600)/9) - 2
    assert iv.daly_interval(2.0, 3600.0) == pytest.approx(118.6703704, abs=1e-6)
    assert iv.daly_interval(10.0, 4.0) == 4.0  # δ >= 2M: M
    for bad in ((-1.0, 10.0), (1.0, 0.0), (math.inf, 1.0)):
        with pytest.raises(ValueError):
            iv.young_daly_interval(*bad)


def test_expected_goodput_hand_computed() -> None:
    # T=120, δ=2, M=3600: wall = 3600*(e^(122/3600)-1) = 124.0906 s per 120 s of work
    assert iv.expected_goodput(120.0, 2.0, 3600.0) == pytest.approx(0.967035, abs=2e-6)
    # with a 60 s restart: wall *= e^(60/3600) = 1.016806
    assert iv.expected_goodput(120.0, 2.0, 3600.0, 60.0) == pytest.approx(0.951052, abs=2e-6)
    # goodput is highest near the Young/Daly interval
    g = [iv.expected_goodput(t, 2.0, 3600.0) for t in (30.0, 118.67, 480.0)]
    assert g[1] > g[0] and g[1] > g[2]


def _ev(kind: str, attempt: int, t: float, **kw: object) -> str:
    import datetime as dt

    utc = dt.datetime.fromtimestamp(1_800_000_000 + t, dt.timezone.utc)
    return (
        json.dumps(
            {
                "utc": utc.isoformat().replace("+00:00", "Z"),
                "run": "r",
                "attempt": attempt,
                "kind": kind,
                **kw,
            }
        )
        + "\n"
    )


def _history(tmp_path: Path) -> Path:
    lines = [
        _ev("spawn", 0, 0),
        _ev("notice", 0, 3000),
        _ev("preempted", 0, 3005),
        _ev(
            "attempt_end",
            0,
            3010,
            commits=[{"step": 100, "save_s": 1.0}, {"step": 200, "save_s": 3.0}],
        ),
        _ev("spawn", 1, 3020),
        _ev("attempt_end", 1, 6020, commits=[{"step": 300, "save_s": 2.0}]),
        '{"torn line\n',
    ]
    (tmp_path / "events.jsonl").write_text("".join(lines))
    return tmp_path


def test_history_from_synthetic_events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKRUN_MTBI_S", raising=False)
    root = _history(tmp_path)
    h = iv.read_history(str(root / "events.jsonl"))
    assert h.exposure_s == pytest.approx(3010 + 3000) and h.interruptions == 1
    assert h.save_costs_s == (1.0, 3.0, 2.0)
    # M = (6010 + 3600) / (1 + 1) = 4805; δ = median(1, 3, 2) = 2; T = sqrt(2*2*4805)
    est = iv.from_history(str(root))
    assert est.mtbi_s == pytest.approx(4805.0) and est.save_cost_s == 2.0
    assert est.interval_s == pytest.approx(138.6362146)
    assert est.goodput == pytest.approx(iv.expected_goodput(138.6362146, 2.0, 4805.0))
    assert "Young/Daly" in est.describe() and "1 interruptions" in est.describe()
    monkeypatch.setenv("CKRUN_MTBI_S", "800")  # the profile's value wins: sqrt(2*2*800)
    assert iv.from_history(str(root)).interval_s == pytest.approx(56.5685425)
    monkeypatch.setenv("CKRUN_MTBI_S", "soon")
    with pytest.raises(ConfigError, match="CKRUN_MTBI_S"):
        iv.from_history(str(root))


def test_an_async_save_costs_the_training_its_stall_not_its_time_to_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """δ of Young/Daly is what a save costs the training loop.  For an ``async_save``
    that is its snapshot stall (the library's ``save`` event), not the 2 s from its start
    to its commit that the manifest records: the history took the manifest's figure, so
    ``ckrun status`` and the first interval of each attempt suggested checkpointing
    about sqrt(2.0 / 0.05) = 6x too rarely.  An attempt without save events (a script
    with its own checkpoints) still counts its commits."""
    monkeypatch.delenv("CKRUN_MTBI_S", raising=False)
    lines = [
        _ev("spawn", 0, 0),
        _ev("save", 0, 100, step=100, seconds=0.05, mode="async"),
        _ev("save", 0, 200, step=200, seconds=0.07, mode="async"),
        _ev("notice", 0, 3000),
        _ev("save", 0, 3001, step=250, seconds=0.5, mode="sync"),
        _ev("attempt_end", 0, 3010, commits=[{"step": s, "save_s": 2.0} for s in (100, 200, 250)]),
        _ev("spawn", 1, 3020),
        _ev("attempt_end", 1, 6020, commits=[{"step": 300, "save_s": 4.0}]),
        _ev("spawn", 2, 6030),  # still running (or killed): its saves count already
        _ev("save", 2, 6100, step=310, seconds=0.06, mode="async"),
    ]
    (tmp_path / "events.jsonl").write_text("".join(lines))
    h = iv.read_history(str(tmp_path / "events.jsonl"))
    assert h.save_costs_s == (0.05, 0.07, 0.5, 4.0, 0.06)
    est = iv.from_history(str(tmp_path))
    assert est.save_cost_s == pytest.approx(0.07)  # the median


def test_no_history_uses_the_prior_and_bounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CKRUN_MTBI_S", raising=False)
    est = iv.from_history(str(tmp_path))
    assert est.mtbi_source == "prior" and est.save_cost_s is None
    assert est.interval_s == iv.MIN_INTERVAL_S
    empty = iv.History(0.0, 0, ())
    assert iv.estimate(0.001, empty).interval_s == iv.MIN_INTERVAL_S  # sqrt(7.2) < 10 s
    assert iv.estimate(5000.0, empty, mtbi_s=1e6).interval_s == iv.MAX_INTERVAL_S  # 1e5 s
    assert iv.estimate(2.0, empty, floor_s=300.0).interval_s == 300.0  # time to durable


def test_auto_interval_decision_with_a_clock() -> None:
    now = [0.0]
    auto = iv.AutoInterval(lambda: (2.0, 0.0), mtbi_s=3600.0, clock=lambda: now[0])
    assert auto.current().interval_s == pytest.approx(120.0)
    for t, want in (
        (0.0, False),
        (121.0, False),
        (122.0, True),
        (123.0, False),
        (243.0, False),
        (244.0, True),
    ):
        now[0] = t
        assert auto.due() is want, t


def test_checkpointer_should_save(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with ckrun.Checkpointer(storage=str(run_dir), checkpoint_every=4) as ck:
        assert [s for s in range(13) if ck.should_save(s)] == [4, 8, 12]
        assert ck.interval() is None
    with (
        ckrun.Checkpointer(storage=str(run_dir), lock=False) as ck,
        pytest.raises(ConfigError, match="checkpoint_every"),
    ):
        ck.should_save(1)
    for bad in ("sometimes", 0, 2.5, True):
        with pytest.raises(ConfigError):
            ckrun.Checkpointer(storage=str(run_dir), checkpoint_every=bad)
    monkeypatch.delenv("CKRUN_CONTROL_DIR", raising=False)
    with ckrun.Checkpointer(
        storage=str(run_dir), checkpoint_every="auto", mtbi_s=50.0, lock=False
    ) as ck:
        assert ck.should_save(1) is False  # nothing measured yet: the minimum interval
        ck.async_save(1, {"w": torch.ones(10)}).result(30)
        est = ck.interval()
        assert est is not None and est.mtbi_source == "given"
        assert est.save_cost_s == ck._async.last_stall_s
