"""Where ``ckrun check-resume`` drills, and what it says about a divergence (issue 15).

Drills: ``K`` random steps (as before), plus with ``--edges`` the places where resumes
break most often: the first step, the step right after a save (the first one the
uninterrupted run committed), and the last step (a notice after the final step must not
make the resumed run train a step more).  In own-checkpoint mode the script does not
call ckrun, so the supervisor drills right after the Nth new version of the script's
checkpoint file it committed (``CKRUN_DRILL_AFTER_COMMITS``).

Diagnosis: with ``CKRUN_STEP_DIGEST=1`` (set by check-resume in both runs) the framework
integrations record a digest of the parameters after every step; the first step whose
digest differs localises the divergence.  RNG notes name only the generators the run
actually drew from (``rng.used``), and say plainly when the run saves no RNG state.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping, Sequence
from typing import Any

from ckrun.cli.resume_artifacts import STEPS


def drill_steps(
    final_step: int,
    k: int,
    seed: int,
    *,
    edges: bool = False,
    file_set: bool = False,
    first_save: int | None = None,
) -> list[int]:
    """Sorted distinct global step indices to drill at (see the module docstring).

    The K random steps are drawn exactly as before (``random.Random(seed).sample``), so
    ``--seed`` replays a run without ``--edges`` unchanged.  For a ckrun checkpoint
    ``final_step`` is the last step's index; for a file set it is the global step count
    (the drill at index ``s`` lands on global step ``s + 1``).
    """
    k = max(0, min(k, final_step))
    steps = set(random.Random(seed).sample(range(final_step), k)) if k else set()
    if edges:
        last = final_step - 1 if file_set else final_step
        steps.add(0)
        steps.add(max(0, last))
        if first_save is not None:
            after = first_save if file_set else first_save + 1
            if 0 <= after < last:
                steps.add(after)
    return sorted(steps)


def commit_drills(versions: int, k: int, seed: int) -> list[int]:
    """Own-checkpoint mode: the global version counts after which to drill."""
    pool = range(1, max(1, versions))
    k = max(0, min(k, len(pool)))
    return sorted(random.Random(seed).sample(pool, k)) if k else []


def per_attempt(marks: Sequence[int]) -> list[int]:
    """Per-attempt counts for sorted global ``marks`` (commits after the last mark)."""
    out, prev = [], 0
    for m in marks:
        out.append(m - prev)
        prev = m
    return out


def pop_steps(tree: dict[str, Any]) -> dict[str, Any]:
    """Remove and return the per-step digests of a final artifact tree."""
    steps = tree.pop(STEPS, None)
    return dict(steps) if isinstance(steps, Mapping) else {}


def first_diverging_step(ref: Mapping[str, Any], got: Mapping[str, Any]) -> int | None:
    """The first step whose digest differs (or is missing in one run), else None."""
    common = sorted({int(s) for s in ref} | {int(s) for s in got})
    for s in common:
        if ref.get(str(s)) != got.get(str(s)):
            return s
    return None


def step_note(
    ref_steps: Mapping[str, Any],
    got_steps: Mapping[str, Any],
    drilled: Sequence[int],
    file_set: bool,
) -> str | None:
    """A sentence locating the divergence by step, or None without digests."""
    if not ref_steps or not got_steps:
        return None
    first = first_diverging_step(ref_steps, got_steps)
    if first is None:
        return "every per-step digest is identical: the divergence is in state saved after training"
    resumes = {s + 1 if file_set else s for s in drilled}  # global step of each drill save
    msg = f"the first step whose parameters differ is step {first}"
    if first - 1 in resumes:
        msg += (
            f", the first step after the resume at step {first - 1}: something the step "
            "uses is not restored — a batch fetched (prefetched) before the save and not "
            "in `state`, the data position, or an RNG draw between load and the first step"
        )
    return msg


def rng_note(ref: Mapping[str, Any], got: Mapping[str, Any], rng_paths: Sequence[str]) -> str:
    """The RNG part of a FAIL hint: only generators the run used, or "saves no RNG"."""
    if not _has_rng(ref) and not _has_rng(got):
        return (
            " (the run saves no RNG state: a resumed process draws other random numbers "
            "— dropout, augmentation, sampling — unless the RNG is in the checkpoint)"
        )
    used = _used(ref) | _used(got)
    names = sorted({".".join(p.split(".")[:2]) for p in rng_paths if not p.startswith("rng.used")})
    if used:
        names = [n for n in names if n.split(".", 1)[-1] in used or n.count(".") == 0]
    return f" (RNG states that also differ: {', '.join(names)})" if names else ""


def _has_rng(tree: Mapping[str, Any]) -> bool:
    r = tree.get("rng")
    return isinstance(r, Mapping) and bool(r)


def _used(tree: Mapping[str, Any]) -> set[str]:
    r = tree.get("rng")
    if isinstance(r, Mapping) and isinstance(r.get("used"), (list, tuple)):
        return {str(u) for u in r["used"]}
    return set()


def is_file_set_run(run_root: str) -> bool:
    """True when the run committed file sets (a framework's or a script's own files)."""
    from ckrun.checkpoint import discovery, fileset
    from ckrun.storage import open_storage

    ms = discovery.committed(open_storage(run_root))
    return any(fileset.is_file_set(m) for m in ms)


def first_save(run_root: str) -> int | None:
    """The step of the first (oldest listed) recovery checkpoint of a run, or None."""
    from ckrun.checkpoint import discovery
    from ckrun.storage import open_storage

    steps = [m.step for m in discovery.committed(open_storage(run_root)) if m.kind != "final"]
    return min(steps) if steps else None


def own_versions(run_root: str) -> int:
    """Versions of own-checkpoint files the supervisor committed (``own_checkpoint`` events)."""
    from ckrun.runlog import read_events

    evs = read_events(os.path.join(run_root, "events.jsonl"))
    return sum(1 for ev in evs if ev.get("kind") == "own_checkpoint")
