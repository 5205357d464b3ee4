"""Child-side process plumbing for :meth:`ckrun.Checkpointer.from_env` (no torch import).

:func:`install_excepthook` makes an uncaught :class:`ckrun.errors.CkrunError` end the
process with that error's ``exit_code`` (``IncompatibleCheckpoint`` → 4, storage errors
→ 5, ...), so the supervisor and Kubernetes' ``podFailurePolicy`` can tell a refused
resume from a bug in the user's code.
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
    _record(value, code)
    try:
        if os.environ.get("CKRUN_TRACEBACK"):
            traceback.print_exception(tp, value, tb, file=sys.stderr)
        print(f"ckrun: {tp.__name__}: {value}", file=sys.stderr)
        print(f"ckrun: exiting with status {code}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _record(value: CkrunError, code: int) -> None:
    """The exit-reason record that makes ``code`` ckrun's (:mod:`ckrun.control`)."""
    from ckrun.control import write_exit_reason
    from ckrun.errors import ExitCode, IncompatibleCheckpoint, StorageFull

    if isinstance(value, IncompatibleCheckpoint):
        reason = "incompatible"
    elif isinstance(value, StorageFull):
        reason = "storage_full"
    elif code == ExitCode.STORAGE_ERROR:
        reason = "storage_error"
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
