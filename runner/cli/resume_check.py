"""``ckrun check-resume``: prove that a training command resumes exactly.

Procedure:

1. run the command once, uninterrupted, under the supervisor (run ``uninterrupted``);
2. read its final checkpoint's step ``F`` and draw ``K`` distinct random steps in
   ``[0, F)``;
3. run it again (run ``interrupted``) with a drill notice at each of those steps: the
   library publishes the notice on the chosen call of ``ckrun.preemption_requested()``
   (``CKRUN_DRILL_AT_CHECKS``, one count per attempt), the child commits its emergency
   checkpoint and exits 75, the supervisor verifies the commit and restarts it, and the
   next attempt resumes;
4. compare the two final checkpoints entry by entry (``torch.equal``), in causal order —
   data position and LR schedule first, RNG next, then model and optimizer — and report
   PASS or the first diverging entry with its max abs diff and the usual cause.

This assumes the command calls ``preemption_requested()`` once per training step (as
the README's loop does); with more calls per step the drills land on other steps, which
changes nothing about the comparison.  Steps 1-3 live here; reading the final states
and comparing them (step 4) is :mod:`ckrun.cli.resume_compare`, whose names this module
re-exports.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckrun.cli.resume_compare import (
    Divergence,
    NoCkrunCheckpoints,
    compare_trees,
    flatten,
    load_final,
)
from ckrun.errors import CkrunError, UsageError

__all__ = [
    "INTERRUPTED", "UNINTERRUPTED", "CheckResult", "Divergence", "NoCkrunCheckpoints",
    "check_resume", "compare_trees", "drill_counts", "flatten", "load_final",
    "remove_runs", "run_progress",
]  # fmt: skip

UNINTERRUPTED = "uninterrupted"
INTERRUPTED = "interrupted"


@dataclass
class CheckResult:
    """Outcome of :func:`check_resume`.

    Attributes:
        passed: every compared entry is identical.
        interrupt_steps: the steps at which drills were requested.
        preemptions: preemptions the interrupted run actually went through.
        compared: number of entries compared.
        divergence: the first diverging entry, when not passed.
        workdir: where both runs' storage lives.
        seed: the seed the steps were drawn with (``--seed`` replays them).
        notes: remarks, e.g. drills that did not lead to a preemption.
    """

    passed: bool
    interrupt_steps: list[int]
    preemptions: int
    compared: int
    divergence: Divergence | None = None
    workdir: str = ""
    seed: int = 0
    notes: list[str] = field(default_factory=list)


def drill_counts(steps: Sequence[int]) -> list[int]:
    """Per-attempt check counts for drills at the sorted global ``steps``.

    Attempt 0 starts at step 0, so its drill is on check ``steps[0] + 1``; attempt i
    resumes at ``steps[i-1] + 1``, so its drill is on check ``steps[i] - steps[i-1]``.
    """
    out, prev = [], -1
    for s in steps:
        out.append(s - prev)
        prev = s
    return out


def _supervise(
    run: str,
    storage: str,
    command: Sequence[str],
    env: Mapping[str, str],
    log_path: str,
    timeout_s: float,
    own: Sequence[str] = (),
    progress: Any = None,
) -> int:
    """Run ``ckrun run`` for ``run`` under ``storage``, output to ``log_path``; returns
    its exit status; ``progress`` as in :func:`_wait_reporting`."""
    argv = [
        sys.executable,
        "-m",
        "ckrun",
        "run",
        "--run",
        run,
        "--storage",
        storage,
        *own,
        "--",
        *command,
    ]
    env = {"CKRUN_MAX_REQUEUES": "1000", "CKRUN_STEP_DIGEST": "1", **env}
    with open(log_path, "w") as log:
        p = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_reporting(p, os.path.join(storage, run), timeout_s, progress)
        except BaseException:
            p.kill()
            p.wait()
            raise
    return int(p.returncode)


#: Seconds between two progress lines of a run (a line also comes with every change of
#: the newest saved step once this much time has passed).
PROGRESS_EVERY_S = 5.0


def run_progress(run_root: str) -> tuple[int | None, int, int]:
    """(newest step saved, preemptions, attempts) of a run so far, from its event log."""
    from ckrun.runlog import read_events

    evs = read_events(os.path.join(run_root, "events.jsonl"))
    saved = [int(e["step"]) for e in evs if e.get("kind") == "save" and "step" in e]
    return (
        max(saved) if saved else None,
        sum(1 for e in evs if e.get("kind") == "preempted"),
        sum(1 for e in evs if e.get("kind") == "spawn"),
    )


def _wait_reporting(
    p: subprocess.Popen[bytes], run_root: str, timeout_s: float, progress: Any
) -> None:
    """Wait for ``p`` (``subprocess.TimeoutExpired`` after ``timeout_s``), calling
    ``progress(elapsed_s, step, preemptions, attempts)`` about every
    :data:`PROGRESS_EVERY_S` seconds while it runs."""
    t0 = time.monotonic()
    last = t0
    while True:
        try:
            p.wait(timeout=0.25)
            return
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if now - t0 > timeout_s:
            raise subprocess.TimeoutExpired(p.args, timeout_s)
        if progress is not None and now - last >= PROGRESS_EVERY_S:
            last = now
            progress(now - t0, *run_progress(run_root))


def remove_runs(workdir: str, created: bool) -> None:
    """After a PASS: remove what check-resume wrote (both runs and their logs), and the
    work directory itself when check-resume created it; a directory the user named is
    kept (only its two runs and logs go)."""
    import shutil

    if created:
        shutil.rmtree(workdir, ignore_errors=True)
        return
    for name in (UNINTERRUPTED, INTERRUPTED):
        shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)
        try:
            os.unlink(os.path.join(workdir, f"{name}.log"))
        except FileNotFoundError:
            pass


def _preemptions(run_root: str) -> int:
    from ckrun.runlog import read_events

    evs = read_events(os.path.join(run_root, "events.jsonl"))
    return sum(1 for ev in evs if ev.get("kind") == "preempted")


def check_resume(
    command: Sequence[str],
    *,
    interruptions: int = 3,
    seed: int | None = None,
    workdir: str | None = None,
    timeout_s: float = 3600.0,
    echo: Any = print,
    edges: bool = False,
    own_checkpoint: Sequence[str] = (),
) -> CheckResult:
    """Run ``command`` uninterrupted and with ``interruptions`` preemptions; compare.

    Args:
        command: the training command (argv).
        interruptions: K, the number of preemptions at random steps.
        seed: seed for drawing the steps (reported, so a failure can be replayed).
        workdir: where both runs' storage goes (default: a new temp dir, kept).
        timeout_s: limit for each of the two runs, in seconds.
        echo: callable taking one line, for progress output.
        edges: also drill at the first step, right after the first save, and at the
            last step (:mod:`ckrun.cli.resume_drills`).
        own_checkpoint: ``ckrun run`` options of own-checkpoint mode
            (``--checkpoint-path FILE``, ``--resume-args ARGS``): drills then land right
            after committed versions of the script's file.

    Raises:
        CkrunError: a run failed (its exit status and log path are named).
    """
    from ckrun.cli import resume_drills as drills

    own = list(own_checkpoint)
    watched = [own[i + 1] for i, o in enumerate(own[:-1]) if o == "--checkpoint-path"]
    for path in watched:
        if os.path.exists(path):
            raise UsageError(
                f"{path} exists: check-resume runs the command twice from scratch and "
                "removes the own-checkpoint files the first run wrote; move it away first"
            )
    created = workdir is None
    workdir = os.path.abspath(workdir or tempfile.mkdtemp(prefix="ckrun-check-resume-"))
    os.makedirs(workdir, exist_ok=True)
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    echo(
        f"[ckrun] check-resume: work directory {workdir} (removed on PASS, kept on FAIL), "
        f"seed {seed}"
    )
    echo(f"[ckrun] check-resume: 1/2 uninterrupted run ({' '.join(command)})")

    def progress(which: str) -> Any:
        def say(elapsed: float, step: int | None, pre: int, attempts: int) -> None:
            echo(
                f"[ckrun] check-resume: {which} {elapsed:.0f} s: newest saved step "
                f"{'-' if step is None else step}, {pre} preemption(s), {attempts} attempt(s); "
                f"log {os.path.join(workdir, which + '.log')}"
            )

        return say

    rc = _supervise(
        UNINTERRUPTED,
        workdir,
        command,
        {},
        os.path.join(workdir, "uninterrupted.log"),
        timeout_s,
        own=own,
        progress=progress(UNINTERRUPTED),
    )
    if rc != 0:
        raise CkrunError(
            f"the uninterrupted run exited {rc}; see {os.path.join(workdir, 'uninterrupted.log')}"
        )
    for path in watched:  # the first run's own files: the second run starts from scratch
        if os.path.exists(path):
            os.unlink(path)
    root = os.path.join(workdir, UNINTERRUPTED)
    final_step, ref = load_final(root)
    file_set = drills.is_file_set_run(root)
    if watched:
        marks = drills.commit_drills(drills.own_versions(root), interruptions, seed)
        steps, k = marks, len(marks)
        env = {"CKRUN_DRILL_AFTER_COMMITS": ",".join(map(str, drills.per_attempt(marks)))}
        where = "after committed versions"
    else:
        steps = drills.drill_steps(
            final_step,
            interruptions,
            seed,
            edges=edges,
            file_set=file_set,
            first_save=drills.first_save(root),
        )
        k = len(steps)
        env = {"CKRUN_DRILL_AT_CHECKS": ",".join(map(str, drill_counts(steps)))}
        where = "at steps"
    echo(
        f"[ckrun] check-resume: 2/2 run with {k} preemptions {where} "
        f"{', '.join(map(str, steps)) or '-'}"
    )
    rc = _supervise(
        INTERRUPTED,
        workdir,
        command,
        env,
        os.path.join(workdir, "interrupted.log"),
        timeout_s,
        own=own,
        progress=progress(INTERRUPTED),
    )
    if rc != 0:
        raise CkrunError(
            f"the interrupted run exited {rc}; see {os.path.join(workdir, 'interrupted.log')}"
        )
    _, got = load_final(os.path.join(workdir, INTERRUPTED))
    n_pre = _preemptions(os.path.join(workdir, INTERRUPTED))
    ref_steps, got_steps = drills.pop_steps(ref), drills.pop_steps(got)
    compared, div, rng = compare_trees(ref, got)
    if div is not None:
        div.hint += drills.rng_note(ref, got, rng)
        located = drills.step_note(ref_steps, got_steps, steps, file_set)
        if located:
            div.hint += "; " + located
    res = CheckResult(div is None, steps, n_pre, compared, div, workdir, seed)
    if res.passed:
        remove_runs(workdir, created)
        res.notes.append(
            f"removed the work directory {workdir}"
            if created
            else f"removed both runs and their logs from {workdir}"
        )
    last = final_step - 1 if file_set else final_step
    at_last = file_set and not watched and last in steps  # a notice there finalizes
    if n_pre < k - (1 if at_last else 0):
        res.notes.append(
            f"only {n_pre} of {k} drills led to a preemption: does the command "
            "call ckrun.preemption_requested() every step?"
        )
    if at_last:
        res.notes.append(
            f"the drill at the last step ({last}) completed the run instead of preempting it "
            "(the final save follows at once: nothing is left to resume)"
        )
    return res
