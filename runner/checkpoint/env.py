"""The environment of the checkpoint library (no torch import).

:func:`env_int` reads ``CKRUN_*`` integers.  :func:`open_storage_from_env`
(``ckrun.open_storage``) opens a run root with the local tier ``CKRUN_LOCAL_TIER``
configures.  :func:`install_excepthook` makes an uncaught
:class:`ckrun.errors.CkrunError` end the process with that error's ``exit_code``
(``IncompatibleCheckpoint`` → 4, storage errors → 5, ...), so the supervisor and
Kubernetes' ``podFailurePolicy`` can tell a refused resume from a bug in the user's code.

The hook never cuts the process short (no ``os._exit``): it raises ``SystemExit(code)``,
which CPython turns into a normal interpreter exit with that status when it comes out of
``sys.excepthook`` (``Python/pythonrun.c``: ``handle_system_exit`` after the hook).
The normal shutdown then drains ckrun's work before the process ends: the in-flight
``async_save`` is committed (:func:`ckrun.checkpoint.async_exit.finish_at_exit`) and the
queued uploads of a tiered storage are finished (``TieredStorage._drain_at_exit``), each
bounded by the deadline of a pending notice (past it the supervisor's KILL ends the
process; the commit protocol leaves the previous checkpoint intact).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from ckrun.errors import CkrunError, ConfigError
from ckrun.storage import open_storage
from ckrun.storage.base import Storage

_previous = sys.excepthook


def env_int(name: str, default: int) -> int:
    """The integer environment variable ``name``, or ``default`` when unset/empty.

    Raises:
        ConfigError: the value is not an integer.
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError as e:
        raise ConfigError(f"{name}={text!r} is not an integer; unset it or fix its value") from e


def open_storage_from_env(
    url: str, *, local_tier: str | None = None, environ: Mapping[str, str] | None = None
) -> Storage:
    """The storage of the run root ``url``: ``ckrun.open_storage``.

    An ``s3://`` URL with a local tier (``local_tier``, default ``CKRUN_LOCAL_TIER``)
    opens the two-tier storage of :mod:`ckrun.checkpoint.tiering`: commits go to
    ``<local_tier>/<run name>`` and are uploaded in the background
    (``CKRUN_UPLOAD_POLICY``, ``CKRUN_REMOTE_KEEP_LAST`` tune it).  Anything else is
    :func:`ckrun.storage.open_storage` (a local directory, or S3 alone).

    Raises:
        ConfigError: an unsupported URL scheme, or an invalid upload policy or
            remote keep-last value.
    """
    if url.startswith("s3://"):
        from ckrun.checkpoint.tiering import open_from_env

        env = dict(os.environ if environ is None else environ)
        if local_tier is not None:
            env["CKRUN_LOCAL_TIER"] = local_tier
        tiered = open_from_env(url, env)
        if tiered is not None:
            return tiered
    return open_storage(url)


def checkpointer_arguments(
    compat: Mapping[str, Any] | None,
    kw: dict[str, Any],
    default_storage: str | Storage | None = None,
) -> tuple[str | Storage, dict[str, Any], dict[str, Any]]:
    """``(storage, compat block, keyword arguments)`` of :meth:`ckrun.Checkpointer.from_env`.

    Explicit beats ambient, and a conflict is refused: ``storage=`` and ``resume_step=``
    that differ from a set ``CKRUN_STORAGE``/``CKRUN_RESUME_STEP`` raise
    :class:`ConfigError` naming both values (``run=``/``attempt=`` are checked the same
    way by the Checkpointer); an argument equal to its variable, or given where the
    variable is unset, is used.  The storage is ``storage=``, else ``CKRUN_STORAGE``,
    else ``default_storage`` (a fallback for runs outside the supervisor).  The compat
    block gets ``launch_hash`` from ``CKRUN_CONFIG_HASH``; ``allow_change`` is extended by
    ``CKRUN_ALLOW_CHANGE`` (both are allowances); ``resume_step`` and ``run`` come from
    ``CKRUN_RESUME_STEP``/``CKRUN_RUN`` unless given.

    Raises:
        ConfigError: no storage named, an argument conflicting with its variable, or a
            malformed ``CKRUN_*`` integer.
    """
    from ckrun.checkpoint.compat import parse_allow_change

    kw = dict(kw)
    explicit = kw.pop("storage", None)
    env_url = os.environ.get("CKRUN_STORAGE") or None
    if explicit is not None and env_url and not same_storage(explicit, env_url):
        raise ConfigError(
            f"storage={url_of(explicit)!r} conflicts with CKRUN_STORAGE={env_url!r} set by "
            "the supervisor: drop the argument, or pass it as default_storage= (used only "
            "when CKRUN_STORAGE is unset)"
        )
    url = explicit or env_url or default_storage
    if not url:
        raise ConfigError(
            "CKRUN_STORAGE is not set: run the script under `ckrun run`, "
            "or pass storage='path/or/s3-url' to Checkpointer.from_env"
        )
    block = dict(compat or {})
    if os.environ.get("CKRUN_CONFIG_HASH"):
        block.setdefault("launch_hash", os.environ["CKRUN_CONFIG_HASH"])
    kw["allow_change"] = tuple(kw.pop("allow_change", ())) + parse_allow_change(
        os.environ.get("CKRUN_ALLOW_CHANGE")
    )
    if os.environ.get("CKRUN_RESUME_STEP"):
        refuse_conflict("resume_step", kw.get("resume_step"), "CKRUN_RESUME_STEP")
        kw.setdefault("resume_step", env_int("CKRUN_RESUME_STEP", -1))
    kw.setdefault("run", os.environ.get("CKRUN_RUN") or None)
    return url, block, kw


def refuse_conflict(name: str, value: Any, var: str) -> None:
    """Raise ConfigError when ``value`` is given and differs from the set ``var``."""
    text = os.environ.get(var, "").strip()
    if value is None or not text or str(value) == text:
        return
    raise ConfigError(
        f"{name}={value!r} conflicts with {var}={text!r} from the environment: "
        f"drop the argument to use the supervisor's value, or unset {var}"
    )


def url_of(storage: str | Storage) -> str:
    """The URL of a storage given as a URL/path or a Storage."""
    return storage if isinstance(storage, str) else storage.url


def same_storage(a: str | Storage, b: str) -> bool:
    """Whether two storage names denote one root (local paths compared resolved)."""

    def norm(u: str) -> str:
        u = u.removeprefix("file://")
        return u.rstrip("/") if "://" in u else os.path.realpath(u)

    return norm(url_of(a)) == norm(b)


def _hook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    if not isinstance(value, CkrunError):
        _previous(tp, value, tb)
        return
    code = int(value.exit_code)
    _record(value, code)
    try:
        if os.environ.get("CKRUN_TRACEBACK"):
            traceback.print_exception(tp, value, tb, file=sys.stderr)
        print(f"ckrun: {tp.__name__}: {value}", file=sys.stderr)
        print(
            f"ckrun: exiting with status {code} (in-flight saves and uploads finish first)",
            file=sys.stderr,
        )
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        raise SystemExit(code)  # a normal exit with this status (module docstring)


def _record(value: CkrunError, code: int) -> None:
    """The exit-reason record that makes ``code`` ckrun's (:mod:`ckrun.control`)."""
    from ckrun.control import write_exit_reason
    from ckrun.errors import (
        ExitCode,
        IncompatibleCheckpoint,
        NoUsableCheckpoint,
        StorageFull,
        StoragePermissionError,
    )

    # Only what a restart cannot fix: a full or read-only/denied storage, or a run whose
    # every checkpoint is damaged (the restart would refuse again), stops the run;
    # other storage and checkpoint errors (a collective save that lost a rank, an I/O
    # hiccup) stay ordinary failures, retried within the budgets.
    if isinstance(value, IncompatibleCheckpoint):
        reason = "incompatible"
    elif isinstance(value, StorageFull):
        reason = "storage_full"
    elif isinstance(value, StoragePermissionError):
        reason = "storage_denied"
    elif isinstance(value, NoUsableCheckpoint):
        reason = "checkpoints_unusable"
    elif code == ExitCode.CONFIG_INVALID:
        reason = "config_invalid"
    else:
        return
    write_exit_reason(reason, code, str(value))


def install_excepthook() -> None:
    """Install the hook (idempotent); other exceptions go to the previous hook."""
    global _previous
    if sys.excepthook is not _hook:
        _previous = sys.excepthook
        sys.excepthook = _hook
