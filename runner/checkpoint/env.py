"""The environment of the checkpoint library (no torch import).

:func:`env_int` reads ``CKRUN_*`` integers.  :func:`open_storage_from_env`
(``ckrun.open_storage``) opens a run root with the local tier ``CKRUN_LOCAL_TIER``
configures.  :func:`install_excepthook` makes an uncaught
:class:`ckrun.errors.CkrunError` end the process with that error's ``exit_code``
(``IncompatibleCheckpoint`` → 4, storage errors → 5, ...), so the supervisor and
Kubernetes' ``podFailurePolicy`` can tell a refused resume from a bug in the user's code.
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
    compat: Mapping[str, Any] | None, kw: dict[str, Any]
) -> tuple[str | Storage, dict[str, Any], dict[str, Any]]:
    """``(storage URL or Storage object, compat block, keyword arguments)`` of
    :meth:`ckrun.Checkpointer.from_env`: ``CKRUN_STORAGE`` (else ``storage=``), the compat
    block with ``launch_hash`` from ``CKRUN_CONFIG_HASH``, ``allow_change`` extended by
    ``CKRUN_ALLOW_CHANGE``, ``resume_step`` from ``CKRUN_RESUME_STEP`` and ``run`` from
    ``CKRUN_RUN`` unless given.

    Raises:
        ConfigError: neither ``CKRUN_STORAGE`` nor ``storage=`` names the storage, or a
            ``CKRUN_*`` integer is malformed.
    """
    from ckrun.checkpoint.compat import parse_allow_change

    kw = dict(kw)
    url = os.environ.get("CKRUN_STORAGE") or kw.pop("storage", None)
    kw.pop("storage", None)
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
        kw.setdefault("resume_step", env_int("CKRUN_RESUME_STEP", -1))
    kw.setdefault("run", os.environ.get("CKRUN_RUN") or None)
    return url, block, kw  # a Storage object passed as storage= stays one


def _hook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    if not isinstance(value, CkrunError):
        _previous(tp, value, tb)
        return
    code = int(value.exit_code)
    try:
        if os.environ.get("CKRUN_TRACEBACK"):
            traceback.print_exception(tp, value, tb, file=sys.stderr)
        print(f"ckrun: {tp.__name__}: {value}", file=sys.stderr)
        print(f"ckrun: exiting with status {code}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def install_excepthook() -> None:
    """Install the hook (idempotent); other exceptions go to the previous hook."""
    global _previous
    if sys.excepthook is not _hook:
        _previous = sys.excepthook
        sys.excepthook = _hook
