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
