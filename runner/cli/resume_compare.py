"""``ckrun check-resume``'s comparison: the two runs' final states, entry by entry.

:func:`load_final` reads a run's final checkpoint as one tree (the step, every rank's
shard, or a file set decoded by :func:`ckrun.cli.resume_artifacts.file_set_tree`);
:func:`compare_trees` walks two such trees in causal order — the step, the data position
and LR schedule, then model and optimizer, RNG last and only as evidence — and returns
the first entry that differs (``torch.equal``; the max abs diff for floating tensors)
with the usual cause of a divergence there (:data:`HINTS`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ckrun.errors import CheckpointError, UsageError

#: Entry-path prefixes in causal order, with the usual cause of a divergence there.
HINTS: list[tuple[str, str]] = [
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
    for i, (p, _) in enumerate(HINTS):
        if path == p or path.startswith(p + "."):
            return i
    return len(HINTS)


def _hint(path: str) -> str:
    i = _rank(path)
    return HINTS[i][1] if i < len(HINTS) else "this entry differs after resume"


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
