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
changes nothing about the comparison.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckrun.errors import CheckpointError, CkrunError, UsageError

UNINTERRUPTED = "uninterrupted"
INTERRUPTED = "interrupted"

# Entry-path prefixes in causal order, with the usual cause of a divergence there.
_HINTS: list[tuple[str, str]] = [
    (
        "step",
        "the runs ended on different steps: the loop's start step after load() "
        "must be manifest.step + 1",
    ),
    (
        "user.progress",
        "the training progress differs (global step, epoch, batches consumed in the "
        "epoch, per-step log): the data position was not restored, or the resumed run "
        "ran another number of steps",
    ),
    (
        "user.sampler",
        "the data order differs after resume: put a resumable sampler "
        "(ckrun.ResumableSampler or a StatefulDataLoader) in `state` and do not "
        "re-seed or re-create it after load()",
    ),
    (
        "user.scheduler",
        "the LR schedule differs: include the scheduler in `state` and do not step it on resume",
    ),
    ("user.scaler", "the AMP GradScaler state differs: include the scaler in `state`"),
    (
        "user.optimizer.param_groups",
        "the learning rate or another optimizer "
        "hyper-parameter differs: the LR scheduler is not in "
        "`state`, or it is stepped again on resume",
    ),
    (
        "user.model",
        "the parameters diverged after a resume: something the loop depends on "
        "is not restored — the data order (put a ckrun.ResumableSampler or a "
        "StatefulDataLoader in `state`), RNG draws made between load() and the "
        "first step, a generator of your own — or kernels are non-deterministic "
        "(torch.use_deterministic_algorithms(True))",
    ),
    (
        "user.optimizer",
        "the optimizer state differs: include the optimizer in `state` and "
        "load it before the first step",
    ),
    (
        "user",
        "a value in `state` differs after resume: make sure everything the loop "
        "mutates is in `state`",
    ),
    ("rng", "an RNG state differs"),
]


class NoCkrunCheckpoints(UsageError):
    """The checked command committed no checkpoint through ckrun (exit 2, not 5)."""


@dataclass
class Divergence:
    """The first entry that differs between the two final states."""

    path: str
    detail: str
    hint: str


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


def flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield ``(dotted.path, leaf)`` for every leaf of nested dicts / lists / tuples."""
    if isinstance(tree, Mapping):
        for k in sorted(tree, key=str):
            yield from flatten(tree[k], f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from flatten(v, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, tree


def _rank(path: str) -> int:
    for i, (p, _) in enumerate(_HINTS):
        if path == p or path.startswith(p + "."):
            return i
    return len(_HINTS)


def _hint(path: str) -> str:
    i = _rank(path)
    return _HINTS[i][1] if i < len(_HINTS) else "this entry differs after resume"


def _differs(a: Any, b: Any) -> str | None:
    """None when equal, else a one-line description of the difference."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"type {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        if torch.equal(a, b):
            return None
        if a.is_floating_point() or a.is_complex():
            d = (a.double() - b.double()).abs().max().item()
            return f"max abs diff {d:.3g}"
        n = int((a != b).sum().item())
        return f"{n} of {a.numel()} elements differ"
    np = sys.modules.get("numpy")
    if np is not None and isinstance(a, np.ndarray):
        return None if np.array_equal(a, b) else "numpy arrays differ"
    return None if a == b else f"{a!r} vs {b!r}"


def compare_trees(
    ref: Mapping[str, Any], got: Mapping[str, Any]
) -> tuple[int, Divergence | None, list[str]]:
    """Compare two loaded run-state trees entry by entry, in causal order.

    Only the training outcome decides: the step and every entry of the user's state.
    RNG states are diagnostics — a generator that was never seeded (numpy's global one
    in most scripts) differs between any two processes without changing the result —
    so their differences are returned separately, as evidence for the hint.

    Returns:
        ``(entries compared, first diverging outcome entry or None, RNG paths that
        differ)``.
    """
    a, b = dict(flatten(ref)), dict(flatten(got))
    paths = sorted(a.keys() | b.keys(), key=lambda p: (_rank(p), p))
    first: Divergence | None = None
    rng: list[str] = []
    for p in paths:
        if p not in a or p not in b:
            side = "interrupted" if p not in a else "uninterrupted"
            d: str | None = f"only in the {side} run"
        else:
            d = _differs(a[p], b[p])
        if d is None:
            continue
        if p == "rng" or p.startswith("rng."):
            rng.append(p)
        elif first is None:
            first = Divergence(p, d, _hint(p))
    return len(paths), first, rng


def load_final(run_root: str) -> tuple[int, dict[str, Any]]:
    """The final checkpoint of a run: ``(step, tree)`` with ``step`` added to the tree.

    A file set (Hugging Face, Lightning, a script's own checkpoint files) is decoded by
    :func:`ckrun.cli.resume_artifacts.file_set_tree`.

    Raises:
        NoCkrunCheckpoints: the run committed nothing at all (the command does not use
            ckrun, or saves outside it).
        CheckpointError: the run has checkpoints but no final one (it did not complete).
    """
    from ckrun.checkpoint import discovery, fileset, reshard
    from ckrun.checkpoint.env import open_storage_from_env
    from ckrun.checkpoint.manifest import ManifestKind
    from ckrun.checkpoint.shard_reader import read_shard
    from ckrun.cli.resume_artifacts import file_set_tree

    storage = open_storage_from_env(run_root)
    ms = discovery.committed(storage)
    if not ms:
        raise NoCkrunCheckpoints(
            f"the command exited 0 but committed no checkpoint through ckrun in {run_root}, "
            "so there is nothing to compare: check-resume needs a command that saves with "
            "ckrun (Checkpointer.finalize, ckrun.save, the Hugging Face or Lightning "
            "callback of ckrun.integrations) or, for a script that keeps its own "
            "checkpoint file, --checkpoint-path FILE (see the README)"
        )
    finals = [m for m in ms if m.kind == ManifestKind.FINAL]
    if not finals:
        raise CheckpointError(
            f"{run_root} has no final checkpoint: the run did not complete "
            "(see its events.jsonl and the output above)"
        )
    m = finals[0]
    if fileset.is_file_set(m):
        return m.step, file_set_tree(m.step, _file_set_contents(fileset.read_files(storage, m)))
    tree: dict[str, Any] = {"step": m.step}
    for s in sorted(m.shards, key=lambda s: s.rank):
        if m.tensor_layout is not None:  # format 2: global tensors span the shards
            shard = reshard.full_state(storage, m, s.rank)
        else:
            with storage.open_read(s.key) as f:
                shard = read_shard(f, size_bytes=s.size_bytes, checksum=s.checksum, key=s.key)
        tree.update(shard if m.world_size == 1 else {f"rank{s.rank}": shard})
    return m.step, tree


def _file_set_contents(fs: Any) -> dict[str, Any]:
    """Every file of the final file set ``fs`` in memory, each checked: check-resume
    decodes and compares them all (the artifacts of the small runs it drills)."""
    return {name: fs.read(name) for name in fs.files}


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
