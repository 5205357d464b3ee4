"""Collective checkpoints of a ``torch.distributed`` job (DESIGN.md §3).

Save (every rank calls :meth:`Checkpointer.save` at the same step, e.g. after
``preemption_requested(sync=True)`` agreed on it):

1. the ranks plan who writes what (:mod:`ckrun.checkpoint.sharding`, one
   ``all_gather_object``): DTensor (FSDP2) shards by the rank that holds them, a tensor
   replicated on every rank (DDP) by one owner, rank-local state (RNG, data position,
   tensors that differ) by each rank; each rank writes one format-2 shard (a
   safetensors file, :mod:`ckrun.checkpoint.st_format`) under its attempt-unique key
   (``shard-r<rank>-a<attempt>-<nonce>.ckpt``), CRC32C while streaming;
2. the ranks report ``(key, size_bytes, checksum, layout part, error)`` to rank 0
   (``gather_object`` on a dedicated gloo group, so a CUDA/NCCL job's training
   collectives are untouched);
3. rank 0 checks that every shard exists with the reported size (``head``) and that the
   saved pieces cover every global tensor exactly, then creates the single
   ``manifest.json`` (world size, one shard per rank, the tensor layout, the sharding
   policy in the compat block) only if absent
   (:func:`ckrun.checkpoint.commit.commit_manifest`): the checkpoint exists only now;
4. rank 0 broadcasts the outcome (the manifest, or the error) to every rank: this is the
   barrier after the commit, and a failure on any rank fails the save on every rank.

A rank that dies or hangs before step 3 leaves shards that no manifest names (collected
later by retention); the previous checkpoint stays the newest.

Load: every rank walks the same committed manifests newest first; the ranks agree
(``all_gather_object``) on each candidate, so one rank's corrupt shard makes all of them
fall back together.  A format-2 checkpoint is read with ranged reads
(:mod:`ckrun.checkpoint.reshard`): global tensors as the current layout wants them (the
local box of a DTensor, else whole), on any world size.  The rank-local state comes from
the rank's own shard on the same world size (exact resume, bitwise); on another world
size every rank takes rank 0's and the rank-local state follows
:data:`RANK_LOCAL_POLICY`, recorded in every manifest:

* data position: a :class:`~ckrun.checkpoint.sampler.ResumableSampler` state is re-derived
  from the global sample count (``position × old world size``: the global step times the
  global batch within the epoch) as ``global // new world size`` for this rank;
* RNG: python, numpy and torch (CPU, CUDA) are reseeded with
  ``sha256("seed:step:rank")`` (first 8 bytes), deterministic for a given resume.

A format-1 checkpoint (one whole-state shard per rank) loads as before: its own shard on
the same world size, rank 0's otherwise.
"""

from __future__ import annotations

import hashlib
import logging
import random
import sys
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from ckrun.checkpoint import layout, sharding
from ckrun.checkpoint.commit import commit_manifest
from ckrun.checkpoint.lease import Fence
from ckrun.checkpoint.manifest import Manifest, ManifestKind, ShardInfo
from ckrun.checkpoint.process_group import TIMEOUT_ENV, Group, dist_info
from ckrun.checkpoint.state import restore
from ckrun.checkpoint.verify import head_problems
from ckrun.errors import CheckpointError, LeaseLost
from ckrun.storage.base import Storage

__all__ = [
    "POLICY",
    "RANK_LOCAL_POLICY",
    "RESHARDING_POLICIES",
    "TIMEOUT_ENV",
    "Group",
    "MakeManifest",
    "RankWriter",
    "allowed_changes",
    "compat_fields",
    "dist_info",
    "persist",
    "rederive_sampler",
    "reseed",
    "reshards",
    "restore_resharded",
    "source_rank",
]

log = logging.getLogger(__name__)

#: Sharding policy of ckrun's collective checkpoints: every rank's shard holds the full
#: (replicated) model and optimizer state plus its rank-local state.
POLICY = "replicated"
#: Policies whose checkpoints load on another world size.
RESHARDING_POLICIES = frozenset({POLICY})
#: What happens to rank-local state when the world size changes (see module docstring).
RANK_LOCAL_POLICY = {
    "data": "rederive:global_samples=position*world_size",
    "rng": "reseed:sha256(seed:step:rank)",
}
_SAMPLER_KEYS = frozenset({"epoch", "position", "seed", "n", "shuffle", "num_replicas", "rank"})


def compat_fields(world_size: int) -> dict[str, Any]:
    """Compat entries of a run of ``world_size`` ranks (``sharding`` only when > 1)."""
    if world_size <= 1:
        return {}
    return {"sharding": {"policy": POLICY, "rank_local": dict(RANK_LOCAL_POLICY)}}


def reshards(m: Manifest) -> bool:
    """True when ``m`` can be loaded on another world size (one shard, or a resharding
    policy in its compat block)."""
    sharding = m.compat.get("sharding")
    policy = sharding.get("policy") if isinstance(sharding, Mapping) else None
    return m.world_size == 1 or policy in RESHARDING_POLICIES


def allowed_changes(m: Manifest, world_size: int) -> tuple[str, ...]:
    """Compat paths allowed to differ when resuming ``m`` on ``world_size`` ranks."""
    if m.world_size != world_size and reshards(m):
        return ("world_size", "sharding")
    return ()


@dataclass(frozen=True)
class _Report:
    key: str
    size_bytes: int
    checksum: str
    error: str | None
    part: dict[str, Any] | None = None  # sharding.layout_part


#: ``(shards, manifest key, tensor layout) -> Manifest``, called on rank 0 only
MakeManifest = Callable[[tuple[ShardInfo, ...], str, "dict[str, Any] | None"], Manifest]


class RankWriter(Protocol):
    """What a collective save reads of the saving rank (the Checkpointer's
    :class:`~ckrun.checkpoint.pipeline.CommitContext`)."""

    @property
    def storage(self) -> Storage: ...

    @property
    def run(self) -> str: ...

    @property
    def attempt(self) -> int: ...

    @property
    def rank(self) -> int: ...

    @property
    def group(self) -> Group: ...

    @property
    def fence(self) -> Fence | None: ...


def _write_own(ck: RankWriter, step: int, snap: sharding.Planned, area: layout.Area) -> _Report:
    key = layout.shard_key(step, ck.rank, ck.attempt, area)
    # a hash that fails leaves the committed shard to retention, as another rank's failure
    out = sharding.write_object(ck.storage.open_write(key), snap).hash()
    return _Report(key, out.size_bytes, out.checksum, None, sharding.layout_part(snap, out))


def persist(
    ck: RankWriter,
    step: int,
    snap: sharding.Planned,
    *,
    kind: ManifestKind,
    make_manifest: MakeManifest,
) -> Manifest:
    """Steps 2-4 of a collective save (module docstring); every rank calls it.

    Args:
        ck: the rank's commit context (``storage``, ``run``, ``attempt``, ``rank``, ``group``).
        step: the step being saved (the same on every rank).
        snap: this rank's planned snapshot (:func:`ckrun.checkpoint.sharding.plan`).
        kind: ``recovery``, ``milestone`` or ``final``.
        make_manifest: ``(shards, manifest_key, tensor_layout) -> Manifest`` (rank 0).

    Returns:
        The committed manifest, on every rank.

    Raises:
        StorageError: this rank's own write failed (re-raised after the others heard).
        CheckpointError: another rank failed, or rank 0's check of the shards did.
    """
    area: layout.Area = "final" if kind == ManifestKind.FINAL else "checkpoints"
    own_error: BaseException | None = None
    try:
        rep = _write_own(ck, step, snap, area)
    except Exception as e:  # reported to rank 0 so no rank waits forever
        own_error, rep = e, _Report("", 0, "", f"{type(e).__name__}: {e}")
    reports = ck.group.gather(rep)
    outcome: tuple[str, bytes | str, str] = ("error", "", "")
    if reports is not None:
        outcome = _commit(ck, step, area, reports, make_manifest)
    outcome = ck.group.broadcast(outcome)  # the barrier after the commit
    if own_error is not None:
        raise own_error
    status, body, mkey = outcome
    if status == "lease_lost":
        raise LeaseLost(str(body))
    if status != "ok":
        raise CheckpointError(
            f"collective save of step {step} failed, nothing committed "
            f"(the previous checkpoint is intact): {body!s}"
        )
    if not isinstance(body, bytes):
        raise CheckpointError(f"collective save of step {step}: rank 0 sent no manifest")
    return Manifest.loads(body, key=mkey)


def _commit(
    ck: RankWriter,
    step: int,
    area: layout.Area,
    reports: list[_Report],
    make_manifest: MakeManifest,
) -> tuple[str, bytes | str, str]:
    """Rank 0: verify every shard, write the manifest; ``("ok", bytes, key)`` or error."""
    problems = [f"rank {r}: {rep.error}" for r, rep in enumerate(reports) if rep.error]
    shards = tuple(
        ShardInfo(rep.key, r, rep.size_bytes, rep.checksum) for r, rep in enumerate(reports)
    )
    mkey = layout.manifest_key(step, area)
    try:
        if not problems:
            probe = Manifest(
                run=ck.run,
                step=step,
                kind=ManifestKind.RECOVERY,
                attempt=ck.attempt,
                world_size=len(shards),
                shards=shards,
                compat={},
                metrics={},
                resumed_from=None,
                created_utc="",
                committed_utc="",
                save_duration_s=0.0,
            )
            problems = head_problems(ck.storage, probe)
        if problems:
            return "error", "; ".join(problems), mkey
        lay = sharding.merge_layout([rep.part or {} for rep in reports])
        m = commit_manifest(ck.storage, make_manifest(shards, mkey, lay), ck.fence)  # fenced
        return "ok", m.dumps(), mkey
    except LeaseLost as e:  # every rank raises LeaseLost (exit 2), not a storage error
        return "lease_lost", str(e), mkey
    except Exception as e:  # broadcast, then every rank raises
        return "error", f"rank 0 could not commit: {type(e).__name__}: {e}", mkey


def source_rank(m: Manifest, rank: int, world_size: int) -> int:
    """The shard this rank reads: its own on the same world size, else rank 0's."""
    return rank if m.world_size == world_size else 0


def restore_resharded(
    state: MutableMapping[str, Any],
    tree: Mapping[str, Any],
    m: Manifest,
    *,
    rank: int,
    world_size: int,
    seed: int,
) -> None:
    """Restore rank 0's shard of ``m`` (world size W) into this rank of ``world_size``.

    The sampler positions are re-derived and the RNG reseeded (module docstring).

    Raises:
        CheckpointError: as :func:`ckrun.checkpoint.state.restore`.
    """
    user = _rederive(tree.get("user"), world_size, rank)
    restore(state, {**tree, "user": user, "rng": None}, where=f"checkpoint step {m.step}")
    reseed(seed, m.step, rank)
    log.warning(
        "checkpoint step %d was written by %d ranks, this job has %d: rank %d took "
        "rank 0's replicated state, re-derived data positions and reseeded RNG "
        "(policy %s)",
        m.step,
        m.world_size,
        world_size,
        rank,
        RANK_LOCAL_POLICY,
    )


def _rederive(v: Any, world: int, rank: int) -> Any:
    if isinstance(v, Mapping):
        if _SAMPLER_KEYS <= v.keys():
            return rederive_sampler(v, world, rank)
        return {k: _rederive(x, world, rank) for k, x in v.items()}
    return v


def rederive_sampler(sd: Mapping[str, Any], world: int, rank: int) -> dict[str, Any]:
    """A ResumableSampler state moved to ``rank`` of ``world`` ranks.

    The old ranks consumed ``position × num_replicas`` entries of the epoch's padded
    permutation (rank r took entries ``r, r + W, ...``); the new rank resumes at
    ``global // world`` (at most ``world - 1`` samples are seen twice), clamped to the
    epoch length ``ceil(n / world)``.
    """
    consumed = int(sd["position"]) * int(sd["num_replicas"])
    per_rank = -(-int(sd["n"]) // world)
    return {**sd, "num_replicas": world, "rank": rank, "position": min(consumed // world, per_rank)}


def reseed(seed: int, step: int, rank: int) -> int:
    """Seed python, numpy (if imported) and torch (CPU, CUDA) from ``(seed, step, rank)``.

    Returns:
        The 63-bit seed used: ``sha256(f"{seed}:{step}:{rank}")``'s first 8 bytes.
    """
    digest = hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()
    s = int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
    random.seed(s)
    torch.manual_seed(s)  # CPU and every CUDA device
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(s % (1 << 32))
    return s
