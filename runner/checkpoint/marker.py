"""The completion marker ``COMPLETE.json`` (DESIGN.md §3, "Completion marker").

Written by :meth:`ckrun.Checkpointer.finalize` after the final artifact's manifest; a
present, valid marker means no attempt ever runs the child again and ``save`` refuses.
No torch import: the supervisor's preflight reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ckrun.checkpoint import layout
from ckrun.checkpoint.manifest import (
    Manifest,
    ShardInfo,
    check_format,
    exact_fields,
    parse_shard,
    reject_constant,
    typed_field,
    utc_now,
)
from ckrun.errors import CorruptCheckpoint

FORMAT = "ckrun.complete"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class CompletionMarker:
    """A parsed ``COMPLETE.json``.

    Attributes:
        run: run id.
        final_step: step of the final artifact.
        shard_count: number of artifact shards (the world size).
        config_hash: the launch config hash (``launch_hash``) or "" when unknown.
        artifact_kind: ``"ckrun-shards"`` (the ckrun shard format).
        manifest_key: key of the final artifact's manifest.
        artifacts: the artifact shards with sizes and checksums.
        committed_utc: when the marker was written.
        lease_epoch: the lease epoch of the writer (fencing), None when unfenced (then
            omitted from the JSON).
    """

    run: str
    final_step: int
    shard_count: int
    config_hash: str
    artifact_kind: str
    manifest_key: str
    artifacts: tuple[ShardInfo, ...]
    committed_utc: str
    lease_epoch: int | None = None

    @classmethod
    def for_manifest(cls, m: Manifest) -> CompletionMarker:
        """The marker describing the final manifest ``m``."""
        return cls(
            m.run,
            m.step,
            len(m.shards),
            str(m.compat.get("launch_hash") or ""),
            "ckrun-shards",
            m.key,
            m.shards,
            utc_now(),
            m.lease_epoch,
        )

    def dumps(self) -> bytes:
        """Strict JSON bytes."""
        body: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "run": self.run,
            "final_step": self.final_step,
            "shard_count": self.shard_count,
            "config_hash": self.config_hash,
            "artifact_kind": self.artifact_kind,
            "manifest_key": self.manifest_key,
            "artifacts": [a.to_json() for a in self.artifacts],
            "committed_utc": self.committed_utc,
        }
        if self.lease_epoch is not None:
            body["lease_epoch"] = self.lease_epoch
        return json.dumps(body, sort_keys=True, indent=1, allow_nan=False).encode()

    @classmethod
    def loads(cls, data: bytes) -> CompletionMarker:
        """Parse and validate.

        Raises:
            CorruptCheckpoint: unparsable, missing/unknown fields, keys outside the
                final artifact, shard count not matching the artifacts.
            UnsupportedFormat: unknown format version.
        """
        where = layout.COMPLETE
        try:
            obj = json.loads(data, parse_constant=reject_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptCheckpoint(f"{where}: not valid JSON ({e})", key=where) from e
        if not isinstance(obj, dict):
            raise CorruptCheckpoint(f"{where}: expected a JSON object", key=where)
        check_format(obj, FORMAT, FORMAT_VERSION, where)
        fields = {
            "format",
            "format_version",
            "run",
            "final_step",
            "shard_count",
            "config_hash",
            "artifact_kind",
            "manifest_key",
            "artifacts",
            "committed_utc",
        } | ({"lease_epoch"} & obj.keys())
        exact_fields(obj, fields, where)
        epoch = obj.get("lease_epoch")
        if epoch is not None and (not isinstance(epoch, int) or isinstance(epoch, bool)):
            raise CorruptCheckpoint(f"{where}: lease_epoch must be an int", key=where)
        step = typed_field(obj, "final_step", int, where)
        entries = typed_field(obj, "artifacts", list, where)
        arts = tuple(parse_shard(a, step, "final", where) for a in entries)
        count = typed_field(obj, "shard_count", int, where)
        mkey = typed_field(obj, "manifest_key", str, where)
        if count != len(arts) or count < 1 or mkey != layout.manifest_key(step, "final"):
            raise CorruptCheckpoint(
                f"{where}: shard_count {count} / manifest_key {mkey!r} do not match the "
                f"final artifact of step {step}",
                key=where,
            )
        return cls(
            typed_field(obj, "run", str, where),
            step,
            count,
            typed_field(obj, "config_hash", str, where),
            typed_field(obj, "artifact_kind", str, where),
            mkey,
            arts,
            typed_field(obj, "committed_utc", str, where),
            epoch,
        )

    def to_json(self) -> dict[str, Any]:
        """As a JSON object."""
        return dict(json.loads(self.dumps()))
