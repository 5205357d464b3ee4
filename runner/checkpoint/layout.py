"""Object keys of a run root: the only module that names checkpoint keys.

Run root (DESIGN.md §2-3)::

    run.json, events.jsonl, control/, locks/supervisor.lock     the supervisor's
    checkpoints/step-0000001200/shard-r00000-a0003-1f2e3d4c.ckpt   shard: rank, attempt, nonce
    checkpoints/step-0000001200/manifest.json                      the commit (written last)
    final/step-0000005000/{shard-...,manifest.json}                final artifact
    COMPLETE.json                                                  completion marker
    locks/writer.lock, locks/writer.holder.json                    the checkpoint writer lock
    locks/lease.json                                               the run's lease (epoch)
    supervisor/state.json                                          budgets + history

``step-%010d`` keys make listing order step order.  Shard keys are attempt-unique (and
carry a random nonce), so a save never overwrites a file another attempt may have named.
Retention deletes only keys that :func:`parse` recognises.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Literal

CHECKPOINTS = "checkpoints/"
FINAL = "final/"
COMPLETE = "COMPLETE.json"
MANIFEST = "manifest.json"
WRITER_LOCK = "locks/writer.lock"
WRITER_HOLDER = "locks/writer.holder.json"
LEASE = "locks/lease.json"
RUN_STATE = "supervisor/state.json"
SHARD_SUFFIX = ".ckpt"

Area = Literal["checkpoints", "final"]

_KEY_RE = re.compile(
    r"^(?P<area>checkpoints|final)/step-(?P<step>\d{10})/"
    r"(?:(?P<manifest>manifest\.json)|"
    r"shard-r(?P<rank>\d{5})-a(?P<attempt>\d{4,})-(?P<nonce>[0-9a-f]{8})\.ckpt)$"
)


@dataclass(frozen=True)
class ParsedKey:
    """What a ckrun-named key under ``checkpoints/`` or ``final/`` denotes.

    Attributes:
        area: ``"checkpoints"`` or ``"final"``.
        step: the training step.
        is_manifest: True for ``manifest.json``, False for a shard.
        rank: shard rank (None for a manifest).
        attempt: attempt that wrote the shard (None for a manifest).
    """

    area: Area
    step: int
    is_manifest: bool
    rank: int | None = None
    attempt: int | None = None


def step_prefix(step: int, area: Area = "checkpoints") -> str:
    """``checkpoints/step-%010d/`` (or under ``final/``)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{area}/step-{step:010d}/"


def manifest_key(step: int, area: Area = "checkpoints") -> str:
    """Key of the manifest that commits ``step``."""
    return step_prefix(step, area) + MANIFEST


def shard_key(step: int, rank: int, attempt: int, area: Area = "checkpoints") -> str:
    """A fresh attempt-unique shard key for ``rank`` at ``step``."""
    nonce = secrets.token_hex(4)
    return step_prefix(step, area) + f"shard-r{rank:05d}-a{max(attempt, 0):04d}-{nonce}.ckpt"


def parse(key: str) -> ParsedKey | None:
    """Recognise a ckrun-named checkpoint key; None for anything else (foreign files)."""
    m = _KEY_RE.match(key)
    if m is None:
        return None
    area: Area = "final" if m["area"] == "final" else "checkpoints"
    if m["manifest"]:
        return ParsedKey(area, int(m["step"]), True)
    return ParsedKey(area, int(m["step"]), False, int(m["rank"]), int(m["attempt"]))


def is_under_step(key: str, step: int, area: Area) -> bool:
    """True when ``key`` is a shard key inside ``step``'s directory of ``area``."""
    p = parse(key)
    return p is not None and not p.is_manifest and p.step == step and p.area == area
