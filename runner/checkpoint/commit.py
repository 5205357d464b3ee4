"""Step 4 of a save: the manifest as a conditional create (DESIGN.md §3, commit protocol).

The manifest is written with ``put(key, body, if_absent=True)`` (local: ``link(2)``; S3:
``If-None-Match: *``), so two attempts can never both commit one step: the second one
gets ``ObjectExists`` and this module decides, after reading the existing manifest:

* it verifies (every shard present with its size and CRC32C) and names the same shard
  contents as ours (same sizes and checksums: a deterministic re-run of the step) — it
  is returned, nothing is overwritten;
* it verifies and differs — :class:`StepAlreadyCommitted` is raised: another writer
  committed this step; ours stays an uncommitted (invisible) shard;
* it is corrupt (unparseable, a shard missing, truncated or failing its checksum: e.g. a
  checkpoint ``load()`` skipped, and the run re-reached that step) — it is deleted (the
  manifest only: its shards are never named again and are collected by retention) and
  the create is retried once.

With ``after`` (the committed unreferenced shard writers of a
:class:`~ckrun.storage.base.PublishesAfter` storage, issue 19) the create is
``put_after``: the shards are made durable together with the manifest's data, before
the manifest's name is published.

Fencing (DESIGN.md §7, :mod:`ckrun.checkpoint.lease`): with a ``fence``, the lease epoch
is checked right before the create and again right after it; a manifest created by a
writer whose epoch stopped being current in between is deleted again (it is this
writer's own key: the create was conditional) and :class:`ckrun.errors.LeaseLost` is
raised, so a stale owner never leaves a commit behind.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

from ckrun.checkpoint.lease import Fence
from ckrun.checkpoint.manifest import Manifest
from ckrun.checkpoint.verify import verify_shards
from ckrun.errors import (
    CheckpointError,
    CorruptCheckpoint,
    LeaseLost,
    ObjectExists,
    ObjectNotFound,
)
from ckrun.storage.base import ObjectWriter, PublishesAfter, Storage

log = logging.getLogger(__name__)


class StepAlreadyCommitted(CheckpointError):
    """A verified manifest of this step, with other contents, exists (another writer)."""

    def __init__(self, message: str, *, existing: Manifest):
        super().__init__(message)
        self.existing = existing


def _existing(storage: Storage, key: str) -> tuple[Manifest | None, list[str]]:
    """The manifest under ``key`` and its problems (empty: it verifies)."""
    try:
        m = Manifest.loads(storage.get(key), key=key)
    except ObjectNotFound:
        return None, []
    except CorruptCheckpoint as e:
        return None, [str(e)]
    problems = verify_shards(storage, m)
    unchecked = [p.message for p in problems if not p.conclusive]
    if unchecked:  # never delete a manifest we could not read: it may be good
        raise CheckpointError(
            f"{key} exists and cannot be checked ({'; '.join(unchecked)}); "
            "retry the save once the storage is reachable"
        )
    return m, [p.message for p in problems]


def _same_contents(a: Manifest, b: Manifest) -> bool:
    def sig(m: Manifest) -> list[tuple[int, int, str]]:
        return sorted((s.rank, s.size_bytes, s.checksum) for s in m.shards)

    return a.kind == b.kind and a.world_size == b.world_size and sig(a) == sig(b)


def commit_manifest(
    storage: Storage,
    m: Manifest,
    fence: Fence | None = None,
    after: Sequence[ObjectWriter] = (),
) -> Manifest:
    """Create ``m.key`` only if absent; returns the manifest that is committed there.

    Args:
        fence: the writer's lease fence (None or unfenced: no check).
        after: committed unreferenced shard writers of ``storage`` (a
            :class:`~ckrun.storage.base.PublishesAfter`), made durable before the
            manifest is published (module docstring); empty: the shards are durable.

    Returns:
        ``m``, or an existing verified manifest of the same contents.

    Raises:
        StepAlreadyCommitted: a verified manifest with other contents exists.
        CheckpointError: a corrupt manifest came back after it was deleted (a concurrent
            writer).
        LeaseLost: the writer's lease epoch is no longer current (nothing is published).
        StorageError: the storage failed.
    """
    body = m.dumps()
    what = f"commit of step {m.step}"
    for retry in (False, True):
        if fence is not None:
            fence.check(what)
        try:
            if after:
                # ``after`` came from this storage's ``open_unreferenced``
                cast(PublishesAfter, storage).put_after(m.key, body, after, if_absent=True)
            else:
                storage.put(m.key, body, if_absent=True)
        except ObjectExists:
            pass
        else:
            _recheck(storage, m, fence, what)
            return m
        old, problems = _existing(storage, m.key)
        if old is None and not problems:
            continue  # deleted between the create and the read: try again
        if not problems:
            assert old is not None
            if _same_contents(old, m):
                log.info(
                    "step %d already committed with identical shards (attempt %d): "
                    "keeping that manifest",
                    m.step,
                    old.attempt,
                )
                return old
            raise StepAlreadyCommitted(
                f"{m.key}: step {m.step} was already committed by attempt {old.attempt} "
                f"at {old.committed_utc} with other contents, and that checkpoint verifies; "
                "it is not overwritten (two writers of one run?). Make sure a single "
                "process writes this run, or save under a new step or run directory",
                existing=old,
            )
        if retry:
            break
        log.warning(
            "%s exists but is corrupt (%s): deleting it and committing step %d again",
            m.key,
            "; ".join(problems),
            m.step,
        )
        storage.delete([m.key])
    raise CheckpointError(
        f"{m.key}: the manifest of step {m.step} could not be created: a "
        "corrupt one reappeared after it was deleted (another writer of "
        "this run?)"
    )


def _recheck(storage: Storage, m: Manifest, fence: Fence | None, what: str) -> None:
    """After the create: withdraw our manifest if the lease moved on meanwhile."""
    if fence is None or not fence.fenced:
        return
    try:
        fence.check(what)
    except LeaseLost:
        log.error("%s: the lease moved on during the commit; withdrawing %s", what, m.key)
        storage.delete([m.key])
        raise
