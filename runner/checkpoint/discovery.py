"""Finding committed checkpoints and the completion marker (no torch import).

Discovery lists manifests: a checkpoint exists exactly when its manifest does, so no
"latest" pointer can run ahead of the data (DESIGN.md §3).  The supervisor's preflight
calls :func:`preflight` before it spawns the child (which also completes a run whose
final artifact was committed without its marker, :func:`complete_from_final`);
:class:`ckrun.Checkpointer` and the CLI use :func:`scan` / :func:`committed`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckrun.checkpoint import layout
from ckrun.checkpoint.compat import compare, normalize
from ckrun.checkpoint.manifest import Manifest, ManifestKind
from ckrun.checkpoint.marker import CompletionMarker
from ckrun.checkpoint.verify import head_problems
from ckrun.errors import CorruptCheckpoint, ObjectNotFound, StorageError
from ckrun.storage.base import Storage

log = logging.getLogger(__name__)


@dataclass
class Scan:
    """Result of :func:`scan`.

    Attributes:
        manifests: valid manifests, newest first (a final artifact before a recovery
            checkpoint of the same step).
        problems: ``(key, problem)`` for manifests that exist but could not be used.
    """

    manifests: list[Manifest] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)


def scan(storage: Storage) -> Scan:
    """List and parse every manifest under ``checkpoints/`` and ``final/``.

    Raises:
        StorageError: the listing itself failed.
    """
    out = Scan()
    for area in (layout.CHECKPOINTS, layout.FINAL):
        for info in storage.list(area):
            p = layout.parse(info.key)
            if p is None or not p.is_manifest:
                continue
            try:
                raw = storage.get(info.key)
            except ObjectNotFound:  # listed, then deleted (retention beside this scan)
                log.debug("checkpoint manifest %s was deleted while listing", info.key)
                continue
            try:
                m = Manifest.loads(raw, key=info.key)
                if m.step != p.step or m.area != p.area:
                    raise CorruptCheckpoint(
                        f"{info.key}: holds step {m.step} kind {m.kind}, not its own directory's",
                        key=info.key,
                    )
            except CorruptCheckpoint as e:
                log.warning("skipping checkpoint manifest %s: %s", info.key, e)
                out.problems.append((info.key, str(e)))
                continue
            out.manifests.append(m)
    out.manifests.sort(key=lambda m: (m.step, m.kind == ManifestKind.FINAL), reverse=True)
    return out


def committed(storage: Storage) -> list[Manifest]:
    """Valid committed manifests, newest first; invalid ones are skipped and logged."""
    return scan(storage).manifests


def completion(storage: Storage) -> tuple[CompletionMarker | None, str | None]:
    """The completion marker when present and valid.

    Returns:
        ``(marker, None)`` for a valid marker whose artifacts exist with the recorded
        sizes; ``(None, None)`` when there is no marker; ``(None, problem)`` for a marker
        that is present but unparsable or whose artifacts are missing or truncated.
    """
    try:
        data = storage.get(layout.COMPLETE)
    except ObjectNotFound:
        return None, None
    except StorageError as e:
        return None, f"{layout.COMPLETE}: cannot read ({e})"
    try:
        marker = CompletionMarker.loads(data)
    except CorruptCheckpoint as e:
        return None, str(e)
    for a in marker.artifacts:
        info = storage.head(a.key)
        if info is None or info.size_bytes != a.size_bytes:
            got = "missing" if info is None else f"{info.size_bytes} bytes"
            return None, (
                f"{layout.COMPLETE}: final artifact {a.key} is {got}, marker says "
                f"{a.size_bytes} bytes"
            )
    return marker, None


def committed_final(storage: Storage, step: int | None = None) -> Manifest | None:
    """The newest committed final artifact (of ``step`` when given) whose shards all
    exist with their recorded sizes, else None."""
    for m in scan(storage).manifests:
        if m.kind == "final" and (step is None or m.step == step) and not head_problems(storage, m):
            return m
    return None


def complete_from_final(storage: Storage) -> CompletionMarker | None:
    """Write the missing ``COMPLETE.json`` of a run whose final artifact is committed.

    ``finalize`` commits the final manifest and then writes the marker; a process killed
    between the two leaves a finished run without its marker.  This writes the marker
    from the committed final artifact (the newest one whose shards pass the head check),
    with a conditional create: a marker another process wrote first is kept.  Used by
    the supervisor's preflight (:func:`preflight`) and ``Checkpointer.finalize``.

    Returns:
        The valid marker now in place, or None (no marker and no usable final artifact).

    Raises:
        StorageError: the storage failed.
    """
    from ckrun.errors import ObjectExists

    marker, problem = completion(storage)
    if marker is not None or problem is not None:
        return marker  # a present marker is never overwritten, even an invalid one
    final = committed_final(storage)
    if final is None:
        return None
    try:
        storage.put(layout.COMPLETE, CompletionMarker.for_manifest(final).dumps(), if_absent=True)
        log.warning(
            "final artifact of step %d was committed without %s (the process ended "
            "in between): marker written from it",
            final.step,
            layout.COMPLETE,
        )
    except ObjectExists:
        pass
    return completion(storage)[0]


@dataclass
class Preflight:
    """What the supervisor needs before spawning the child.

    Attributes:
        complete: the valid completion marker, or None.
        resume: newest committed manifest whose shards all exist with the right size.
        diff: refusing differences between ``expected`` and ``resume.compat``.
        warnings: warn-policy differences, an invalid marker, and similar notes.
        skipped: problems of newer checkpoints passed over (one line each).
    """

    complete: CompletionMarker | None = None
    resume: Manifest | None = None
    diff: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def preflight(
    storage: Storage,
    expected: Mapping[str, Any],
    allow_change: Sequence[str] = (),
    *,
    policy: Mapping[str, str] | None = None,
) -> Preflight:
    """Completion marker, resume source and compatibility diff, from heads only.

    Args:
        storage: the run root.
        expected: compat fields the launch knows (e.g. ``{"launch_hash": "ab12"}``);
            only these paths are compared.
        allow_change: paths allowed to differ (``--allow-change``).
        policy: compat policy; default :data:`ckrun.checkpoint.compat.DEFAULT_POLICY`.

    Raises:
        StorageError: the storage cannot be listed.
    """
    res = Preflight()
    res.complete, problem = completion(storage)
    if problem:
        res.warnings.append(f"completion marker ignored: {problem}")
    elif res.complete is None:
        res.complete = complete_from_final(storage)
    sc = scan(storage)
    for m in sc.manifests:
        bad = head_problems(storage, m)
        if bad:
            res.skipped.extend(f"step {m.step}: {b}" for b in bad)
            continue
        res.resume = m
        break
    floor = res.resume.step if res.resume is not None else -1
    for key, p in sc.problems:
        parsed = layout.parse(key)
        if parsed is None or parsed.step > floor:
            res.skipped.append(f"{key}: {p}")
    if res.resume is not None:
        cmp = compare(
            normalize(dict(expected)),
            res.resume.compat,
            allow_change=allow_change,
            policy=policy,
            only_current=True,
        )
        res.diff = cmp.refuse
        res.warnings.extend(cmp.warn)
    return res
