"""Retention: which committed checkpoints to delete after a commit (no torch import).

Runs only after a commit (DESIGN.md §3 step 5).  Keeps the newest ``keep_last``
recovery checkpoints, every milestone (``kind == "milestone"`` or a step divisible by
``milestone_every``), the final artifact, and every protected step (the checkpoint this
attempt resumed from, the one just committed).  A deleted checkpoint loses its manifest
first, so it disappears atomically; its shards go next.  Shards no valid manifest names
(leftovers of killed saves and dead attempts) are collected up to the newest committed
step, except, in a fenced run (a lease: attempts numbered by the supervisor), those of a
newer attempt than the one retaining (a stale owner, between its fence check and its
deletes, must not collect the shard a new owner is writing: on local storage that shard
is written under its final key before its manifest, issue 19).
Only keys :func:`ckrun.checkpoint.layout.parse` recognises are ever deleted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ckrun.checkpoint import layout
from ckrun.checkpoint.discovery import scan
from ckrun.checkpoint.manifest import Manifest, ManifestKind
from ckrun.storage.base import Storage

log = logging.getLogger(__name__)


def select(
    steps: Mapping[int, str],
    *,
    keep_last: int,
    milestone_every: int | None = None,
    protect: Iterable[int] = (),
) -> set[int]:
    """Steps to delete among committed recovery/milestone checkpoints (pure).

    Args:
        steps: committed step → kind (``recovery``/``milestone``/``final``).
        keep_last: how many of the newest checkpoints to keep (>= 1).
        milestone_every: steps divisible by this are milestones, kept forever.
        protect: steps never deleted (resumed-from, just committed).

    Returns:
        A subset of ``steps``; never the newest, a protected step, a milestone or final.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    keep = set(sorted(steps, reverse=True)[:keep_last]) | set(protect)
    out = set()
    for step, kind in steps.items():
        milestone = kind == ManifestKind.MILESTONE or bool(
            milestone_every and step % milestone_every == 0
        )
        if step in keep or milestone or kind == ManifestKind.FINAL:
            continue
        out.add(step)
    return out


@dataclass
class Plan:
    """Keys retention will delete, in order.

    Attributes:
        manifests: manifest keys of the checkpoints to drop (deleted first).
        shards: their shard keys plus orphaned shards (deleted second).
    """

    manifests: list[str] = field(default_factory=list)
    shards: list[str] = field(default_factory=list)


def plan(
    storage: Storage,
    committed: Sequence[Manifest],
    *,
    keep_last: int,
    milestone_every: int | None,
    protect: Iterable[int],
    broken_steps: Iterable[int] = (),
    attempt: int | None = None,
) -> Plan:
    """The deletions for the ``checkpoints/`` area given its committed manifests.

    Args:
        committed: valid manifests (any area; only ``checkpoints`` ones are candidates).
        broken_steps: steps whose manifest exists but is invalid: left alone entirely.
        attempt: the retaining writer's attempt: orphaned shards of newer attempts are
            left alone (None: no such limit).
    """
    rec = {m.step: m for m in committed if m.area == "checkpoints"}
    drop = select(
        {s: m.kind for s, m in rec.items()},
        keep_last=keep_last,
        milestone_every=milestone_every,
        protect=protect,
    )
    p = Plan()
    live: set[str] = set()
    for step, m in rec.items():
        keys = [s.key for s in m.shards]
        if step in drop:
            p.manifests.append(m.key or layout.manifest_key(step))
            p.shards.extend(keys)
        else:
            live.update(keys)
    if rec:
        newest = max(rec)
        skip = set(broken_steps)
        for info in storage.list(layout.CHECKPOINTS):
            k = layout.parse(info.key)
            if (
                k is not None
                and not k.is_manifest
                and k.area == "checkpoints"
                and k.step <= newest
                and k.step not in skip
                and (attempt is None or k.attempt is None or k.attempt <= attempt)
                and info.key not in live
                and info.key not in p.shards
            ):
                p.shards.append(info.key)
    return p


def apply(storage: Storage, p: Plan) -> None:
    """Delete the plan's manifests, then its shards; sweep stale local temp files."""
    if p.manifests:
        storage.delete(p.manifests)
    if p.shards:
        storage.delete(p.shards)
    sweep = getattr(storage, "sweep_temp", None)
    if callable(sweep):
        sweep(layout.CHECKPOINTS)
    if p.manifests or p.shards:
        log.info(
            "retention removed %d checkpoints and %d shard files", len(p.manifests), len(p.shards)
        )


def retain_after(
    storage: Storage,
    m: Manifest,
    *,
    keep_last: int,
    milestone_every: int | None,
    protect: Iterable[int],
    attempt: int | None = None,
) -> Plan:
    """One retention pass after committing ``m``: :func:`plan` over what
    :func:`ckrun.checkpoint.discovery.scan` finds (steps with an invalid manifest left
    alone), never deleting ``m`` nor a step in ``protect``, then :func:`apply`.

    Returns:
        The plan applied.

    Raises:
        StorageError: listing or deleting failed (callers log it: the commit stands and
            the next pass retries).
    """
    sc = scan(storage)
    broken = [p.step for k, _ in sc.problems if (p := layout.parse(k)) is not None]
    chosen = plan(
        storage,
        sc.manifests,
        keep_last=keep_last,
        milestone_every=milestone_every,
        protect={m.step, *protect},
        broken_steps=broken,
        attempt=attempt,
    )
    apply(storage, chosen)
    return chosen
