"""Child-side process plumbing for :meth:`ckrun.Checkpointer.from_env` (no torch import).

:func:`install_excepthook` makes an uncaught :class:`ckrun.errors.CkrunError` end the
process with that error's ``exit_code`` (``IncompatibleCheckpoint`` → 4, storage errors
→ 5, ...), so the supervisor and Kubernetes' ``podFailurePolicy`` can tell a refused
resume from a bug in the user's code.

The hook never cuts the process short (no ``os._exit``): it raises ``SystemExit(code)``,
which CPython turns into a normal interpreter exit with that status when it comes out of
``sys.excepthook`` (``Python/pythonrun.c``: ``handle_system_exit`` after the hook).
The normal shutdown then drains ckrun's work before the process ends: the in-flight
``async_save`` is committed (:func:`ckrun.checkpoint.async_save._drain_at_exit`) and the
queued uploads of a tiered storage are finished (``TieredStorage._drain_at_exit``), each
bounded by the deadline of a pending notice (past it the supervisor's KILL ends the
process; the commit protocol leaves the previous checkpoint intact).
"""

from __future__ import annotations

import os
import sys
import traceback
from types import TracebackType

from ckrun.errors import CkrunError, ConfigError

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


def _hook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    if not isinstance(value, CkrunError):
        _previous(tp, value, tb)
        return
    code = int(value.exit_code)
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


def install_excepthook() -> None:
    """Install the hook (idempotent); other exceptions go to the previous hook."""
    global _previous
    if sys.excepthook is not _hook:
        _previous = sys.excepthook
        sys.excepthook = _hook
