"""Preflight: what the supervisor checks before every start (DESIGN.md §1, §4.5).

1. ``cancelled.json`` in the state directory (``ckrun cancel``) → ``cancelled``: no start.
2. A valid ``COMPLETE.json`` (``ckrun.checkpoint.discovery.completion``) → ``complete``:
   exit 0 without starting the child.
3. The newest committed checkpoint whose shards exist is compared with the launch
   identity frozen in ``run.json`` (``{"launch_hash": RunConfig.launch_hash()}``, the
   ``--allow-change`` fields allowed): a refusing difference → ``incompatible`` (exit 4,
   with the diff).  A checkpoint written without a launch hash (a command that built its
   ``Checkpointer`` without ``from_env``) is accepted with a warning.
4. Otherwise ``ready``, resuming from that checkpoint's step (or from scratch).

The storage side (manifests, marker, compat rules) belongs to ``ckrun.checkpoint``; this
module only turns its answers into the state machine's :class:`Preflighted` event.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ckrun.config import RunConfig
from ckrun.storage.base import Storage
from ckrun.supervisor.messages import Preflighted, PreflightOutcome
from ckrun.supervisor.rundir import RunDir

_ABSENT_HASH = "launch_hash: <absent>"


@dataclass(frozen=True)
class PreflightReport:
    """Preflight outcome.

    Attributes:
        outcome: what preflight found.
        step: resume step (ready), final step (complete) or the refusing step.
        diff: refusing differences, one ``path: old → new`` line each.
        warnings: notes to print (ignored marker, skipped checkpoints, warn fields).
        detail: one line for the log.
    """

    outcome: PreflightOutcome
    step: int | None = None
    diff: tuple[str, ...] = ()
    warnings: tuple[str, ...] = field(default=())
    detail: str = ""

    def event(self, now: float) -> Preflighted:
        """The state machine event for this report."""
        return Preflighted(self.outcome, self.step, self.diff, self.detail, now)


def open_run_storage(cfg: RunConfig) -> Storage:
    """The run root's storage (created for a local directory).

    For ``s3://`` the profile's S3 keys apply and the bucket is probed (head, then a
    small put/get/delete) so a missing bucket, denied access or read-only credentials
    fail here, before training starts.

    Raises:
        StorageError: the storage is unusable (the message names the fix).
    """
    from ckrun.storage import open_storage

    if cfg.run_root.startswith("s3://"):
        from ckrun.config import storage_keys
        from ckrun.storage.s3 import S3Storage

        keys = set(storage_keys())
        s3 = S3Storage.from_url(cfg.run_root, {k: v for k, v in cfg.cloud.items() if k in keys})
        s3.check(write=True)
        return s3
    return open_storage(cfg.run_root)


def expected_compat(cfg: RunConfig) -> dict[str, Any]:
    """The compat fields the supervisor knows: ``{"launch_hash": ...}``."""
    return {"launch_hash": cfg.launch_hash()}


def preflight(cfg: RunConfig, rundir: RunDir, storage: Storage | None = None) -> PreflightReport:
    """Run the checks of the module docstring.

    Raises:
        StorageError: the storage cannot be listed or read.
    """
    from ckrun.checkpoint import discovery

    if os.path.exists(rundir.cancelled_path):
        return PreflightReport(PreflightOutcome.CANCELLED, detail="cancelled by `ckrun cancel`")
    storage = storage or open_run_storage(cfg)
    allow = tuple(cfg.allow_change)
    pf = discovery.preflight(storage, expected=expected_compat(cfg), allow_change=allow)
    warnings = list(pf.warnings) + list(pf.skipped)
    if pf.complete is not None:
        final: int = pf.complete.final_step
        return PreflightReport(
            PreflightOutcome.COMPLETE,
            final,
            (),
            tuple(warnings),
            f"COMPLETE.json, final step {final}",
        )
    step = pf.resume.step if pf.resume is not None else None
    diff = [d for d in pf.diff if not d.startswith(_ABSENT_HASH)]
    if len(diff) < len(pf.diff):
        warnings.append(
            f"checkpoint step {step} has no launch_hash (its Checkpointer was "
            "not built with from_env); cannot check the launch identity"
        )
    if diff:
        return PreflightReport(
            PreflightOutcome.INCOMPATIBLE,
            step,
            tuple(diff),
            tuple(warnings),
            f"checkpoint step {step} is incompatible",
        )
    return PreflightReport(
        PreflightOutcome.READY,
        step,
        (),
        tuple(warnings),
        f"resume from step {step}" if step is not None else "fresh start",
    )


def newest_step(storage: Storage) -> int | None:
    """Newest committed checkpoint step in ``storage`` (None when there is none)."""
    return newest(storage)[0]


def newest(storage: Storage) -> tuple[int | None, float | None]:
    """(step, save_duration_s) of the newest committed checkpoint, or (None, None)."""
    from ckrun.checkpoint import discovery

    ms = discovery.committed(storage)
    if not ms:
        return None, None
    m = max(ms, key=lambda m: m.step)
    return m.step, float(m.save_duration_s)


def newest_attempt(storage: Storage) -> int | None:
    """Highest attempt number recorded in any committed manifest (None when none)."""
    from ckrun.checkpoint import discovery

    ms = discovery.committed(storage)
    return max(m.attempt for m in ms) if ms else None


def attempt_commits(storage: Storage, attempt: int) -> list[dict[str, Any]]:
    """Checkpoints committed by ``attempt`` still listed: step, committed_utc, save_s, kind.

    Recorded in ``events.jsonl`` when the attempt ends, so ``ckrun status`` can account
    for them after retention deleted them.
    """
    from ckrun.checkpoint import discovery

    return [
        {
            "step": m.step,
            "committed_utc": m.committed_utc,
            "save_s": m.save_duration_s,
            "kind": m.kind,
        }
        for m in sorted(discovery.committed(storage), key=lambda m: m.step)
        if m.attempt == attempt
    ]


def is_complete(storage: Storage) -> bool:
    """True when a valid ``COMPLETE.json`` exists."""
    from ckrun.checkpoint import discovery

    marker, _problem = discovery.completion(storage)
    return marker is not None
