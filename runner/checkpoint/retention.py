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

The deletes flush nothing of their own (:func:`ckrun.storage.base.lazy_delete`; issue
19, bench/README.md "Twentieth session"): on ext4 and xfs they become durable with the
next save's flush.  A crash before it brings a deleted checkpoint back whole, or as
shards without their manifest (orphans, collected by the next full pass): those
journals keep the deletes' order.  Where a filesystem does not keep it, an old manifest
may come back without its shards: a load reaches it only when every newer checkpoint
fails, finds it unusable, and the next pass deletes it while the settings still
exclude it (a run restarted with a larger ``keep_last`` keeps it, listed as damaged by
``ckrun ls``, until it ages out).  Nothing the pass keeps is touched, and a pass runs
only after its commit is durable.

A writer that retains after every save keeps a :class:`Ledger` (issue 19, small frequent
saves): after one full pass (list, parse every manifest, collect orphans, sweep temp
files) it knows the area's committed checkpoints, adds each manifest it commits, and the
next passes decide from that knowledge alone: no listing and no manifest parsing, only
the deletes.  A pass is full again when the ledger is stale (a save of this writer
failed and may have left a shard no manifest names, or a pass failed part-way) and every
:data:`FULL_PASS_EVERY` passes (temp files of killed writers age into the sweep;
checkpoints changed by hand are seen again).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ckrun.checkpoint import layout
from ckrun.checkpoint.discovery import scan
from ckrun.checkpoint.manifest import Manifest, ManifestKind
from ckrun.storage.base import Storage, lazy_delete

log = logging.getLogger(__name__)

FULL_PASS_EVERY = 32  # passes: at least every 32nd retention pass lists the area


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
        deferred: orphaned shards left only because their step is newer than every
            commit (they may belong to a live save); a :class:`Ledger` keeps them.
    """

    manifests: list[str] = field(default_factory=list)
    shards: list[str] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)


def plan(
    storage: Storage,
    committed: Sequence[Manifest],
    *,
    keep_last: int,
    milestone_every: int | None,
    protect: Iterable[int],
    broken_steps: Iterable[int] = (),
    attempt: int | None = None,
    orphans: Iterable[str] | None = None,
) -> Plan:
    """The deletions for the ``checkpoints/`` area given its committed manifests.

    Args:
        committed: valid manifests (any area; only ``checkpoints`` ones are candidates).
        broken_steps: steps whose manifest exists but is invalid: left alone entirely.
        attempt: the retaining writer's attempt: orphaned shards of newer attempts are
            left alone (None: no such limit).
        orphans: the candidate keys for orphaned shards (None: list the area; a
            :class:`Ledger` pass gives the orphans it deferred).
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
        if orphans is None:
            orphans = [info.key for info in storage.list(layout.CHECKPOINTS)]
        for key in orphans:
            k = layout.parse(key)
            if (
                k is not None
                and not k.is_manifest
                and k.area == "checkpoints"
                and k.step not in skip
                and (attempt is None or k.attempt is None or k.attempt <= attempt)
                and key not in live
                and key not in p.shards
            ):
                (p.shards if k.step <= newest else p.deferred).append(key)
    return p


@dataclass
class Ledger:
    """One writer's knowledge of the ``checkpoints/`` area between retention passes
    (module docstring).

    Attributes:
        manifests: manifest key → the committed manifest, as of the last full pass plus
            this writer's commits since, minus what retention deleted.
        broken: steps whose manifest was invalid at the last full pass (left alone).
        deferred: orphaned shards the last pass left because they were newer than
            every commit (:attr:`Plan.deferred`), collected once a commit reaches them.
        stale: the next pass must be a full one (nothing known yet, or a failure since).
        passes: incremental passes since the last full one.
    """

    manifests: dict[str, Manifest] = field(default_factory=dict)
    broken: set[int] = field(default_factory=set)
    deferred: list[str] = field(default_factory=list)
    stale: bool = True
    passes: int = 0

    def full_pass_due(self) -> bool:
        """True when the next pass must list and parse the area."""
        return self.stale or self.passes >= FULL_PASS_EVERY - 1


def apply(
    storage: Storage, p: Plan, *, sweep: bool = True, stop: Callable[[], bool] | None = None
) -> bool:
    """Delete the plan's manifests, then its shards (through the storage's ``retire``
    where it has one: a two-tier storage keeps what its running upload reads); with
    ``sweep``, sweep stale local temp files.

    Args:
        stop: asked after the manifests are deleted; True leaves the shards (and the
            sweep) to a later full pass (a notice came: the emergency save goes first).

    Returns:
        False when ``stop`` cut the pass short.
    """
    retire = getattr(storage, "retire", None)
    delete = retire if callable(retire) else lazy_delete(storage)
    if p.manifests:
        delete(p.manifests)
    if stop is not None and stop():
        log.info("retention stopped after %d manifests: a notice is pending", len(p.manifests))
        return False
    if p.shards:
        delete(p.shards)
    sweeper = getattr(storage, "sweep_temp", None) if sweep else None
    if callable(sweeper):
        sweeper(layout.CHECKPOINTS)
    if p.manifests or p.shards:
        log.info(
            "retention removed %d checkpoints and %d shard files", len(p.manifests), len(p.shards)
        )
    return True


def retain_after(
    storage: Storage,
    m: Manifest,
    *,
    keep_last: int,
    milestone_every: int | None,
    protect: Iterable[int],
    attempt: int | None = None,
    ledger: Ledger | None = None,
    stop: Callable[[], bool] | None = None,
) -> Plan:
    """One retention pass after committing ``m``: :func:`plan` over what
    :func:`ckrun.checkpoint.discovery.scan` finds (steps with an invalid manifest left
    alone), never deleting ``m`` nor a step in ``protect``, then :func:`apply`.

    With a ``ledger`` (the writer's own, module docstring) the pass decides from the
    ledger plus ``m`` when no full pass is due, and a full pass refreshes the ledger; a
    failed pass, or one ``stop`` cut short (:func:`apply`), leaves it stale.

    Returns:
        The plan applied.

    Raises:
        StorageError: listing or deleting failed (callers log it: the commit stands and
            the next pass retries).
    """
    if ledger is None or ledger.full_pass_due():
        return _full_pass(storage, m, keep_last, milestone_every, protect, attempt, ledger, stop)
    ledger.stale = True  # until this pass has applied its plan
    if m.area == "checkpoints" and m.key:
        ledger.manifests[m.key] = m
    chosen = plan(
        storage,
        list(ledger.manifests.values()),
        keep_last=keep_last,
        milestone_every=milestone_every,
        protect={m.step, *protect},
        broken_steps=ledger.broken,
        attempt=attempt,
        orphans=ledger.deferred,
    )
    done = apply(storage, chosen, sweep=False, stop=stop)
    for k in chosen.manifests:
        ledger.manifests.pop(k, None)
    if not done:
        return chosen  # the ledger stays stale: the next pass lists and collects
    ledger.deferred = chosen.deferred
    ledger.stale, ledger.passes = False, ledger.passes + 1
    return chosen


def _full_pass(
    storage: Storage,
    m: Manifest,
    keep_last: int,
    milestone_every: int | None,
    protect: Iterable[int],
    attempt: int | None,
    ledger: Ledger | None,
    stop: Callable[[], bool] | None = None,
) -> Plan:
    """The pass over the listed area (:func:`retain_after`); refreshes ``ledger``."""
    if ledger is not None:
        ledger.stale = True  # until this pass has applied its plan
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
    if not apply(storage, chosen, stop=stop):
        return chosen  # the ledger stays stale
    if ledger is not None:
        dropped = set(chosen.manifests)
        ledger.manifests = {
            x.key: x
            for x in sc.manifests
            if x.area == "checkpoints" and x.key and x.key not in dropped
        }
        ledger.broken, ledger.deferred = set(broken), chosen.deferred
        ledger.stale, ledger.passes = False, 0
    return chosen
