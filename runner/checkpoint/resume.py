"""The load path of :class:`ckrun.Checkpointer`, over its commit context.

Load = discover the committed manifests newest first → compat gate (a strict difference
refuses the resume, :class:`~ckrun.errors.IncompatibleCheckpoint`) → read and verify
this rank's shard (size, CRC32C) → restore in place, resharding when the world size
changed.  A corrupt or missing shard is reported and the next older checkpoint is tried;
with more than one rank every rank falls back together (DESIGN.md §3).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

from ckrun.checkpoint import collective, inplace_load, reshard, signature
from ckrun.checkpoint.compat import DEFAULT_POLICY, compare
from ckrun.checkpoint.discovery import Scan, scan
from ckrun.checkpoint.manifest import Manifest
from ckrun.checkpoint.pipeline import CommitContext
from ckrun.checkpoint.shard_reader import read_shard
from ckrun.checkpoint.state import restore
from ckrun.checkpoint.verify import shard_present, verify_manifest
from ckrun.errors import (
    CheckpointError,
    CorruptCheckpoint,
    CorruptObject,
    IncompatibleCheckpoint,
    NoUsableCheckpoint,
    ObjectNotFound,
    StateUnusable,
)

log = logging.getLogger(__name__)


def gate(
    ctx: CommitContext,
    m: Manifest,
    current: Mapping[str, Any],
    *,
    allow_change: Sequence[str],
    policy: Mapping[str, str] | None,
) -> list[str]:
    """The compat gate of ``m`` against the current compat block; returns the drift.

    Raises:
        IncompatibleCheckpoint: a refusing difference (``.diff`` holds the lines).
    """
    allow = tuple(allow_change) + collective.allowed_changes(m, ctx.world_size)
    cmp = compare(current, m.compat, allow_change=allow, policy=policy)
    shapes, modules = signature.compare(
        ctx.signature,
        m.signature,
        allow_change=allow,
        policy=DEFAULT_POLICY if policy is None else policy,
    )
    cmp.refuse += shapes.refuse
    cmp.warn += shapes.warn
    cmp.allowed += shapes.allowed
    if cmp.refuse:
        what = (
            f"does not fit the parameters of {', '.join(map(repr, modules))}"
            if modules
            else "belongs to a different experiment"
        )
        raise IncompatibleCheckpoint(
            f"checkpoint step {m.step} in {ctx.storage.url} {what}:\n  "
            + "\n  ".join(cmp.refuse)
            + "\nrestore the original "
            "settings, allow the change (allow_change=(FIELD,) or --allow-change FIELD) "
            "or start a new run directory (a parameter's name, shape or dtype: "
            "allow_change=('signature',) if the model change is intended)",
            diff=cmp.refuse,
            step=m.step,
        )
    for w in cmp.warn:
        log.warning("checkpoint step %d differs (recorded): %s", m.step, w)
    return cmp.drift


def read(
    ctx: CommitContext,
    m: Manifest,
    want: Mapping[str, Any],
    bulk: Callable[[], Mapping[str, Any]] | None = None,
) -> Any:
    """This rank's state tree of ``m``, read and verified: its shard (format 1), or
    ranged reads of what it needs (format 2, :mod:`ckrun.checkpoint.reshard`; ``want``:
    the targets of the state being restored; ``bulk``: its global tensors read in place,
    :func:`ckrun.checkpoint.inplace_load.bulk_reader`).

    Raises:
        CheckpointError: ``m`` was saved on another world size in a format that does
            not reshard.
        CorruptCheckpoint, ObjectNotFound: the shard is missing, truncated or corrupt.
    """
    if m.world_size != ctx.world_size and not collective.reshards(m):
        raise CheckpointError(
            f"checkpoint step {m.step} has {m.world_size} shards in a "
            "format that does not reshard; resume it on "
            f"{m.world_size} ranks"
        )
    src = collective.source_rank(m, ctx.rank, ctx.world_size)
    if m.tensor_layout is not None:  # format 2: ranged reads of what this rank needs
        return reshard.load_tree(ctx.storage, m, source_rank=src, want=want, bulk=bulk)
    s = next(s for s in m.shards if s.rank == src)
    shard_present(ctx.storage, s, m.step)
    try:
        with ctx.storage.open_read(s.key) as f:
            _advise_sequential(f)
            return read_shard(f, size_bytes=s.size_bytes, checksum=s.checksum, key=s.key)
    except CorruptObject as e:  # the store's checksum/length check: the shard is bad
        raise CorruptCheckpoint(f"{s.key}: {e}", key=s.key, step=m.step) from e


def load(
    ctx: CommitContext,
    state: MutableMapping[str, Any],
    current: Mapping[str, Any],
    *,
    allow_change: Sequence[str],
    policy: Mapping[str, str] | None,
    seed: int,
    resume_step: int | None,
    skipped: list[str],
) -> Manifest | None:
    """Restore the newest good, compatible checkpoint into ``state`` in place (see
    :meth:`ckrun.Checkpointer.load`); unusable ones are appended to ``skipped``.

    Format-2 tensors are read straight into the live tensors where they fit; a
    checkpoint that fails verification after that is restored over by the next older
    one (:mod:`ckrun.checkpoint.inplace_load`, the transaction).

    Returns:
        Its manifest, or None when there is nothing to resume.

    Raises:
        IncompatibleCheckpoint: as :func:`gate`; nothing is restored.
        CheckpointError: the checkpoint does not fit the state (wrong model).
        StateUnusable: a damaged checkpoint was partly read in place and no older one
            restored over it: the process must stop (the supervisor restarts it).
        NoUsableCheckpoint: the run has checkpoints but none is usable (never a
            silent start from step 0).
    """
    txn = inplace_load.Transaction(ctx)
    found = scan(ctx.storage)
    before = len(skipped)
    try:
        m = _load(ctx, state, current, txn, found, allow_change, policy, seed, resume_step, skipped)
    except StateUnusable:
        raise
    except BaseException as e:
        txn.aborted(e)
        raise
    if m is None:
        txn.exhausted()
        _refuse_when_damaged(ctx, found, skipped[before:])
    return m


def _refuse_when_damaged(ctx: CommitContext, found: Scan, unusable: Sequence[str]) -> None:
    """No checkpoint was restored: fine for a run that has none, a refusal for one
    whose every checkpoint is damaged (starting from step 0 would throw its work away).

    Raises:
        NoUsableCheckpoint: committed manifests exist (or unparsable ones), none usable.
    """
    whys = list(unusable) + [f"manifest {key} is unreadable: {why}" for key, why in found.problems]
    if not whys:
        return
    raise NoUsableCheckpoint(
        f"the run in {ctx.storage.url} has checkpoints but none can be restored: "
        + "; ".join(whys)
        + ". Nothing was loaded, and nothing is deleted. Inspect them with `ckrun verify "
        f"{ctx.storage.url}`; to start from scratch on purpose, move the damaged step "
        "directories out of the run directory first."
    )


def _load(
    ctx: CommitContext,
    state: MutableMapping[str, Any],
    current: Mapping[str, Any],
    txn: inplace_load.Transaction,
    found: Scan,
    allow_change: Sequence[str],
    policy: Mapping[str, str] | None,
    seed: int,
    resume_step: int | None,
    skipped: list[str],
) -> Manifest | None:
    want: dict[str, Any] | None = None
    for m in found.manifests:
        drift = gate(ctx, m, current, allow_change=allow_change, policy=policy)
        tree, why = None, ""
        try:
            if m.tensor_layout is not None and want is None:
                want = reshard.targets(state)  # where each global tensor goes
            bulk = inplace_load.bulk_reader(ctx, state, m, want or {}, txn.attempt())
            tree = read(ctx, m, want or {}, bulk)
        except (CorruptCheckpoint, ObjectNotFound) as e:
            why = str(e)
        ok, whys = ctx.group.all_ok(tree is not None, why)  # all ranks fall back together
        if not ok or tree is None:
            txn.failed(m.step)
            msg = f"checkpoint step {m.step} is unusable: {'; '.join(whys)}"
            log.error("%s; falling back to an older checkpoint", msg)
            skipped.append(msg)
            continue
        where = f"checkpoint step {m.step}"
        signature.remap_tree(tree, m.signature, state, ctx.signature, where=where)
        if m.world_size != ctx.world_size:
            collective.restore_resharded(
                state, tree, m, rank=ctx.rank, world_size=ctx.world_size, seed=seed
            )
        else:
            restore(state, tree, where=f"checkpoint step {m.step}")
        txn.restored(state, m.step)
        ctx.resumed_from, ctx.drift = m.step, drift
        ctx.verified.add(m.key)
        if resume_step is not None and resume_step != m.step:
            log.warning("resumed step %d, the supervisor expected %d", m.step, resume_step)
        return m
    return None


def latest(
    ctx: CommitContext,
    current: Mapping[str, Any],
    *,
    allow_change: Sequence[str],
    policy: Mapping[str, str] | None,
    only_current: bool,
) -> Manifest | None:
    """The newest committed, verified (re-hashed unless this process wrote or loaded
    it), compatible manifest; None when there is none or the newest good one is
    incompatible.  ``only_current``: compare only the fields ``current`` has."""
    for m in scan(ctx.storage).manifests:
        if m.key not in ctx.verified:
            problems = verify_manifest(ctx.storage, m)
            if problems:
                log.warning("latest(): skipping step %d: %s", m.step, "; ".join(problems))
                continue
            ctx.verified.add(m.key)
        allow = tuple(allow_change) + collective.allowed_changes(m, ctx.world_size)
        cmp = compare(
            current, m.compat, allow_change=allow, policy=policy, only_current=only_current
        )
        return None if cmp.refuse else m
    return None


def _advise_sequential(f: Any) -> None:
    try:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
    except (AttributeError, OSError, ValueError):
        pass
