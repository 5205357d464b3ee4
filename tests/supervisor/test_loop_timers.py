"""The supervisor loop in process: fake clock, scripted processes (tests/supervisor/fakes.py),
real run directory, real local storage and scheduler.  Timing contracts of issue 11
(items 1, 3, 4, 7, 9, 13) checked to the tick; the same items run end to end with real
processes in test_lifecycle.py."""

from __future__ import annotations

import io
import json
import signal
from pathlib import Path
from typing import Any

from ckrun.config import resolve
from ckrun.scheduler.base import get_scheduler
from ckrun.supervisor.budgets import RunBudgets, RunDirBudgets
from ckrun.supervisor.loop import Supervisor
from ckrun.supervisor.rundir import RunDir
from fakes import FakeClock, FakeProcesses, Script

TICK = 0.1


def supervisor(
    tmp_path: Path, scripts: list[Script], **cfg: Any
) -> tuple[Supervisor, FakeClock, FakeProcesses, io.StringIO]:
    c = resolve(
        "local",
        {"storage": str(tmp_path), **{k: str(v) for k, v in cfg.items()}},
        {},
        run="r",
        command=("train",),
    )
    rd = RunDir(c.state_root)
    rd.freeze(c)
    clock = FakeClock()
    procs = FakeProcesses(clock, scripts)
    out = io.StringIO()
    sched = get_scheduler("local")
    sup = Supervisor(
        c,
        rd,
        sched,
        sched.current(),
        [],
        out=out,
        tick_s=TICK,
        clock=clock,
        procs=procs,
        restore_signals=True,
    )
    return sup, clock, procs, out


def events(tmp_path: Path) -> list[dict[str, Any]]:
    lines = (tmp_path / "r" / "events.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


class At:
    """Deliver signal ``sig`` to the supervisor once the fake clock passes ``t`` seconds
    after the first spawn (hooked into the clock's wait)."""

    def __init__(self, sup: Supervisor, clock: FakeClock, procs: FakeProcesses) -> None:
        self.plan: list[tuple[float, int]] = []
        wait = clock.wait

        def hooked(fd: int, timeout_s: float) -> None:
            wait(fd, timeout_s)
            if procs.children:
                t0 = procs.children[0].started
                while self.plan and clock.t - t0 >= self.plan[0][0] - 1e-9:
                    sup.signal(self.plan.pop(0)[1])

        clock.wait = hooked  # type: ignore[method-assign]

    def at(self, t: float, sig: int) -> At:
        self.plan.append((t, sig))
        self.plan.sort()
        return self


def test_strays_get_term_then_kill_within_seconds_of_the_command_exit(tmp_path: Path) -> None:
    # item 3: the command exits 0 at t=1 s leaving a process that ignores TERM
    sup, clock, procs, out = supervisor(
        tmp_path, [Script(exit_after=1.0, strays=1, strays_die_on_term=False)], grace_s=60
    )
    t0 = clock.t
    assert sup.run() == 0
    sent = procs.sent(0)
    assert [s for _, s in sent] == ["SIGTERM", "SIGKILL"]
    term_t, kill_t = sent[0][0], sent[1][0]
    assert 1.0 + 2.0 <= term_t <= 1.0 + 2.0 + 2 * TICK  # stray_s after the exit
    assert term_t + 2.0 <= kill_t <= term_t + 2.0 + 2 * TICK
    assert clock.t - t0 < 1.0 + 4.0 + 1.0  # not the 60 s grace
    assert "processes left" in out.getvalue()


def test_strays_do_not_wait_for_a_notice_deadline(tmp_path: Path) -> None:
    # item 3 under a notice: the command saved and exited; a helper it left behind must not
    # hold the supervisor until the 60 s deadline (Kubernetes would SIGKILL PID 1 at 30 s)
    sup, clock, procs, _ = supervisor(
        tmp_path, [Script(notice_exit_after=0.5, strays=1, strays_die_on_term=True)], grace_s=60
    )
    At(sup, clock, procs).at(1.0, signal.SIGUSR1).at(1.0, signal.SIGTERM)
    t0 = clock.t
    assert sup.run() == 76
    assert clock.t - t0 < 1.0 + 0.5 + 2.0 + 1.0
    assert [s for _, s in procs.sent(0)] == ["SIGUSR1", "SIGTERM"]


def test_term_and_kill_land_inside_the_grace_period(tmp_path: Path) -> None:
    # item 4: grace 10 s, margin 1 s, kill delay 3 s: TERM at 6 s, KILL at 9 s, exit < 10 s
    sup, clock, procs, out = supervisor(
        tmp_path,
        [Script(notice_exit_after=None, dies_on_term=False)],
        grace_s=10,
        margin_s=1,
        kill_delay_s=3,
    )
    At(sup, clock, procs).at(1.0, signal.SIGTERM)
    assert sup.run() == 76
    sent = procs.sent(0)
    assert [s for _, s in sent] == ["SIGUSR1", "SIGTERM", "SIGKILL"]
    notice_t = sent[0][0]
    assert abs(sent[1][0] - (notice_t + 6.0)) <= TICK + 1e-6
    assert abs(sent[2][0] - (notice_t + 9.0)) <= TICK + 1e-6
    assert clock.t - procs.children[0].started - notice_t <= 10.0


def test_short_notice_halves_the_kill_delay(tmp_path: Path) -> None:
    # a 4 s notice with margin 1 and kill delay 10: TERM at 1.5 s, KILL at 3 s
    sup, clock, procs, _ = supervisor(
        tmp_path,
        [Script(notice_exit_after=None, dies_on_term=False)],
        grace_s=4,
        margin_s=1,
        kill_delay_s=10,
    )
    At(sup, clock, procs).at(1.0, signal.SIGTERM)
    assert sup.run() == 76
    sent = procs.sent(0)
    notice_t = sent[0][0]
    assert abs(sent[1][0] - notice_t - 1.5) <= TICK + 1e-6
    assert abs(sent[2][0] - notice_t - 3.0) <= TICK + 1e-6


def test_unhandled_notice_is_delivered_as_term_at_once(tmp_path: Path) -> None:
    # item 13: nothing catches SIGUSR1 (a plain script): TERM at once, not after the grace
    sup, clock, procs, out = supervisor(
        tmp_path, [Script(catches_notice=False, dies_on_term=True)], grace_s=60
    )
    At(sup, clock, procs).at(1.0, signal.SIGTERM)
    assert sup.run() == 76
    sent = procs.sent(0)
    assert sent[0][1] == "SIGTERM" and sent[0][0] <= 1.0 + 2 * TICK
    assert "delivered the notice as SIGTERM" in out.getvalue()


def test_plain_script_finishing_after_a_notice_completes_and_is_not_restarted(
    tmp_path: Path,
) -> None:
    # item 13: the script ignores the notice and exits 0: COMPLETED, one start
    sup, clock, procs, out = supervisor(
        tmp_path, [Script(exit_after=3.0, status=0, notice_exit_after=None, dies_on_term=False)]
    )
    At(sup, clock, procs).at(1.0, signal.SIGUSR1)
    assert sup.run() == 0
    assert len(procs.children) == 1
    assert sup.state.phase.value == "COMPLETED"


def test_two_notices_one_preemption_one_requeue(tmp_path: Path) -> None:
    # item 9: USR1, USR1 and TERM while draining and while requeueing count once
    sup, clock, procs, _ = supervisor(tmp_path, [Script(notice_exit_after=1.0)])
    At(sup, clock, procs).at(1.0, signal.SIGUSR1).at(1.5, signal.SIGUSR1).at(2.0, signal.SIGTERM)
    assert sup.run() == 76
    evs = events(tmp_path)
    assert [e["kind"] for e in evs].count("preempted") == 1
    assert sup.state.preemptions == 1
    assert RunDirBudgets(str(tmp_path / "r")).load().preemptions == 1


def test_first_ctrl_c_saves_and_cancels_with_130(tmp_path: Path) -> None:
    # item 1: SIGINT is a notice (the command saves), the run is CANCELLED, exit 130
    sup, clock, procs, out = supervisor(tmp_path, [Script(notice_exit_after=0.5)])
    At(sup, clock, procs).at(1.0, signal.SIGINT)
    assert sup.run() == 130
    assert [s for _, s in procs.sent(0)] == ["SIGUSR1"]
    assert sup.state.phase.value == "CANCELLED"
    assert "Ctrl-C" in out.getvalue()


def test_second_ctrl_c_kills_at_once(tmp_path: Path) -> None:
    sup, clock, procs, _ = supervisor(
        tmp_path, [Script(notice_exit_after=None, dies_on_term=False)], grace_s=60
    )
    At(sup, clock, procs).at(1.0, signal.SIGINT).at(2.0, signal.SIGINT)
    assert sup.run() == 130
    sent = procs.sent(0)
    assert [s for _, s in sent] == ["SIGUSR1", "SIGKILL"]
    assert sent[1][0] <= 2.0 + 2 * TICK


def test_no_progress_preemptions_stop_with_back_off_and_persist(tmp_path: Path) -> None:
    # item 7: the command exits 75 at every start without a commit
    sup, clock, procs, out = supervisor(
        tmp_path, [Script(exit_after=0.2, status=75)], no_progress_preemptions=3, backoff_s=1
    )
    assert sup.run() == 1
    assert len(procs.children) == 3
    starts = [c.started for c in procs.children]
    assert starts[2] - starts[1] >= 0.2 + 1.0  # back-off before the 3rd start
    assert "requeue storm" in out.getvalue()
    assert RunDirBudgets(str(tmp_path / "r")).load() == RunBudgets(
        preemptions=3, failures=0, no_progress=0, streak=3
    )
    # a new supervisor of the same run continues the count: it does not start at all
    sup2, _, procs2, out2 = supervisor(tmp_path, [Script(exit_after=0.2, status=75)])
    sup2.cfg = sup.cfg
    sup2.state = type(sup2.state)(policy=sup.state.policy)
    assert sup2.run() == 1
    assert procs2.children == [] and "requeue storm" in out2.getvalue()
