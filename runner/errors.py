"""One exception tree under :class:`CkrunError` and the process exit codes.

Every error ckrun raises on purpose is a :class:`CkrunError`; each class carries the
:class:`ExitCode` the CLI (and a child under the supervisor) exits with, so the
Kubernetes ``podFailurePolicy`` and the local launcher can tell a preemption from a bad
config from a bug in the user's code.  Messages name the problem *and* the fix.

Third-party errors (OSError, botocore, subprocess, kubernetes) are mapped at the
boundary of the module that calls them and chained with ``raise ... from``.
"""

from __future__ import annotations

import errno
from enum import IntEnum
from typing import Any


class ExitCode(IntEnum):
    """Process exit statuses; mirrored in ``k8s/job.yaml`` and the local launcher.

    75 follows ``EX_TEMPFAIL`` from sysexits.h: "try again later".
    """

    OK = 0  # done, or already complete
    CHILD_FAILED = 1  # the user's command failed
    USAGE = 2  # bad command line
    CONFIG_INVALID = 3  # invalid profile / config value
    INCOMPATIBLE = 4  # newest checkpoint belongs to a different experiment
    STORAGE_ERROR = 5  # checkpoint storage unusable (full, read-only, denied)
    REQUEUE_FAILED = 6  # checkpoint committed but the scheduler refused the requeue
    SCHEDULER_ERROR = 7  # the scheduler refused or failed a call (submit, cancel, status)
    PREEMPTED = 75  # preempted, a new checkpoint was committed
    PREEMPTED_NO_CHECKPOINT = 76  # preempted, no new checkpoint (the last one stands)
    INTERRUPTED = 130  # Ctrl-C (SIGINT): saved and stopped; `ckrun submit` resumes


class CkrunError(Exception):
    """Base of every error ckrun raises on purpose."""

    exit_code: ExitCode = ExitCode.CHILD_FAILED


class UsageError(CkrunError):
    """The command line is wrong."""

    exit_code = ExitCode.USAGE


class ConfigError(CkrunError):
    """A profile, environment variable or option has an invalid value."""

    exit_code = ExitCode.CONFIG_INVALID


class StorageError(CkrunError):
    """Checkpoint storage failed; nothing under a final name was left half-written."""

    exit_code = ExitCode.STORAGE_ERROR


class StorageFull(StorageError):
    """No space left on the storage device (ENOSPC / EDQUOT)."""

    def __init__(self, message: str, *, path: str = "", needed_bytes: int | None = None):
        super().__init__(message)
        self.path = path
        self.needed_bytes = needed_bytes


class StoragePermissionError(StorageError):
    """The storage is read-only or access is denied."""


class ObjectNotFound(StorageError):
    """A key that should exist does not."""


class ObjectExists(StorageError):
    """A conditional create (``if_absent=True``) found the key already present."""


class PreconditionFailed(StorageError):
    """A conditional update (``put(if_match=...)``) found another version, or no object."""


class CorruptObject(StorageError):
    """The bytes read do not match the object's stored checksum or length (S3 CRC32C,
    a body shorter than the object after every resumed read): the stored object is bad,
    not the connection.  The checkpoint layer maps it to ``CorruptCheckpoint``."""

    def __init__(self, message: str, *, key: str = ""):
        super().__init__(message)
        self.key = key


class InvalidKey(StorageError):
    """A key is absolute, contains ``..`` or other components that escape the root."""


class CheckpointError(CkrunError):
    """A checkpoint cannot be written or read."""

    exit_code = ExitCode.STORAGE_ERROR


class CorruptCheckpoint(CheckpointError):
    """A checkpoint failed verification (size, checksum, parse, format version)."""

    def __init__(self, message: str, *, key: str = "", step: int | None = None):
        super().__init__(message)
        self.key = key
        self.step = step


class StateUnusable(CheckpointError):
    """A load wrote a checkpoint's bytes into the live tensors in place, the checkpoint
    then failed verification and no older one was restored over them: the state in
    memory must not be trained on or saved (:mod:`ckrun.checkpoint.inplace_load`).  An
    ordinary failure (exit 5): the supervisor restarts the process."""


class NoUsableCheckpoint(CheckpointError):
    """The run has committed checkpoints (or manifests) but none can be restored: all
    failed verification or are missing.  Starting from step 0 instead would silently
    throw the run's work away, so the load refuses (exit 5); the message names each
    checkpoint, why, and the fix (inspect with ``ckrun verify``; move the damaged step
    directories aside to start from scratch on purpose)."""


class IncompatibleCheckpoint(CheckpointError):
    """The checkpoint was made by a different experiment.

    Attributes:
        diff: the refusing differences, one readable line each, e.g.
            ``"config.lr: 0.0003 → 0.001"``.
    """

    exit_code = ExitCode.INCOMPATIBLE

    def __init__(self, message: str, *, diff: list[str] | None = None, step: int | None = None):
        super().__init__(message)
        self.diff = list(diff or [])
        self.step = step


class RunLocked(CkrunError):
    """Another live process holds the run (a second supervisor or checkpoint writer)."""

    exit_code = ExitCode.USAGE

    def __init__(self, message: str, *, holder: dict[str, Any] | None = None):
        super().__init__(message)
        self.holder = dict(holder or {})


class LeaseHeld(RunLocked):
    """Another supervisor holds the run's lease (it renews it); exit 2 naming the holder."""


class LeaseLost(RunLocked):
    """This process's lease epoch is no longer the run's current one (a newer owner took
    over): its commit, marker and retention are refused (fencing); exit 2."""


class RunComplete(CkrunError):
    """The run has a valid completion marker; nothing more may be saved or run."""

    exit_code = ExitCode.OK


class SchedulerError(CkrunError):
    """A scheduler (Slurm, Kubernetes, local) call failed or refused (exit 7, distinct
    from a failed child)."""

    exit_code = ExitCode.SCHEDULER_ERROR


class RequeueError(SchedulerError):
    """The checkpoint is committed but the job could not be requeued."""

    exit_code = ExitCode.REQUEUE_FAILED


_ENOSPC = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_EPERM = {errno.EROFS, errno.EACCES, errno.EPERM}
#: errnos that mean "the storage is unusable" (full, read-only, denied): exit 5.
STORAGE_ERRNOS = frozenset(_ENOSPC | _EPERM)


def map_os_error(exc: OSError, *, path: str, nbytes: int | None = None) -> StorageError:
    """Turn an ``OSError`` from a storage call into the most specific :class:`StorageError`.

    Args:
        exc: the original error (chain it with ``raise mapped from exc``).
        path: the file or key being written or read.
        nbytes: bytes the operation was writing, if known.
    """
    if exc.errno in _ENOSPC:
        size = f" ({nbytes} bytes)" if nbytes is not None else ""
        return StorageFull(
            f"no space left on the device writing {path}{size}: free space or point "
            "--storage at a larger volume; the previous checkpoint is intact",
            path=path,
            needed_bytes=nbytes,
        )
    if exc.errno in _EPERM:
        return StoragePermissionError(
            f"cannot write {path}: {exc.strerror} (read-only or permission denied); "
            "make the storage writable or choose another --storage"
        )
    if exc.errno == errno.ENOENT:
        return ObjectNotFound(f"{path} does not exist")
    return StorageError(f"storage I/O error on {path}: {exc}")
