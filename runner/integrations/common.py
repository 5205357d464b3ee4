"""What the framework integrations share: the run's storage, commits of a directory, the
exit on a notice (issue 15).  No framework import here."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from ckrun.checkpoint import fileset
from ckrun.checkpoint.commit import StepAlreadyCommitted
from ckrun.checkpoint.env import env_int
from ckrun.checkpoint.manifest import Manifest
from ckrun.errors import ExitCode
from ckrun.storage.base import Storage

log = logging.getLogger(__name__)

RESTORED = ".ckrun-restored"  # in a restored directory: which launch restored it


def run_storage(storage: str | Storage | None = None) -> Storage | None:
    """``storage``, else the supervisor's ``CKRUN_STORAGE``, else None (not supervised)."""
    from ckrun.storage import open_storage

    if storage is not None and not isinstance(storage, str):
        return storage
    url = storage or os.environ.get("CKRUN_STORAGE")
    return open_storage(url) if url else None


def launch_compat() -> dict[str, Any]:
    """The compat block the supervisor's preflight checks (``launch_hash``)."""
    h = os.environ.get("CKRUN_CONFIG_HASH")
    return {"launch_hash": h} if h else {}


def dir_files(root: str, top: str) -> dict[str, str]:
    """``{"top/rel/path": absolute path}`` for every regular file under ``root/top``."""
    out: dict[str, str] = {}
    base = os.path.join(root, top)
    for d, _, names in os.walk(base):
        for n in names:
            p = os.path.join(d, n)
            if os.path.isfile(p) and not n.startswith(".ckrun-"):
                out[os.path.relpath(p, root).replace(os.sep, "/")] = p
    return out


def commit(
    storage: Storage,
    step: int,
    files: Mapping[str, str],
    *,
    kind: str = "recovery",
    keep_last: int = 3,
    resumed_from: int | None = None,
) -> Manifest | None:
    """Commit ``files`` as ``step`` (see :func:`ckrun.checkpoint.fileset.commit_files`).

    Returns None when this step is already committed with other contents (a re-run of
    the same step after a resume: the committed one stands).
    """
    try:
        return fileset.commit_files(
            storage,
            step,
            files,
            run=os.environ.get("CKRUN_RUN") or "run",
            attempt=env_int("CKRUN_ATTEMPT", 0),
            kind=kind,
            compat=launch_compat(),
            keep_last=keep_last,
            resumed_from=resumed_from,
        )
    except StepAlreadyCommitted as e:
        log.warning("step %d is already committed: %s", step, e)
        return None


def barrier() -> None:
    """Wait for every rank (``torch.distributed.barrier`` on the default group); nothing
    when ``torch.distributed`` is not initialised (one process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def launch_stamp() -> str | None:
    """What identifies this launch of a multi-process job (``WORLD_SIZE`` > 1): the
    attempt and the launcher's pid (torchrun's agent, shared by its ranks); None for
    one process.  Ranks restoring the same commit into a shared directory use it to
    restore once per launch."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return None
    return f"{os.environ.get('CKRUN_ATTEMPT', '')}:{os.getppid()}"


def restore_shared(fs: fileset.FileSet, root: str, top: str) -> str:
    """:func:`ckrun.checkpoint.fileset.restore_dir` for ranks that share ``root``.

    One process: restore.  Several ranks of one launch (:func:`launch_stamp`): under a
    file lock in ``root`` the first restores and leaves a marker (``.ckrun-restored``:
    the launch and the commit's checksum) in ``root/top``; the others find the marker
    and use that directory, so no rank renames a directory another is reading.  A new
    launch restores again (a directory half-rewritten since is replaced).

    Returns:
        The restored directory's path.
    """
    stamp = launch_stamp()
    if stamp is None:
        return fileset.restore_dir(fs, root, top)
    from ckrun.storage.fsutil import write_pieces_atomic
    from filelock import FileLock

    stamp += f":{fs.manifest.shards[0].checksum}"
    marker = os.path.join(root, top, RESTORED)
    with FileLock(os.path.join(root, ".ckrun-restore.lock")):
        if _read(marker) == stamp:
            return os.path.join(root, top)
        path = fileset.restore_dir(fs, root, top)
        write_pieces_atomic(marker, [stamp.encode()])
    return path


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def exit_preempted(step: int) -> None:
    """Leave the process with 75 (:attr:`ExitCode.PREEMPTED`) after a committed save."""
    print(
        f"[ckrun] committed step {step} after the notice; exiting 75", file=sys.stderr, flush=True
    )
    sys.stdout.flush()
    raise SystemExit(int(ExitCode.PREEMPTED))


def step_digest(tensors: Any) -> str:
    """CRC32C over the bytes of ``tensors`` (parameters after a step), as ``%08x``.

    Recorded per step when ``CKRUN_STEP_DIGEST=1`` (``ckrun check-resume`` sets it), so
    the comparison names the first step whose state differs.
    """
    import crc32c
    import torch

    crc = 0
    for t in tensors:
        b = t.detach().cpu().contiguous().view(-1).view(dtype=torch.uint8)
        crc = crc32c.crc32c(b.numpy().data, crc)
    return f"{crc:08x}"
