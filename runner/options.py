"""Typed option values: one coercer for every options dataclass.

Option values arrive as YAML scalars and lists (profiles), strings (``CKRUN_<KEY>``
environment variables, the command line) or Python values (direct construction).
:func:`coerce` turns one into the type its dataclass field declares; the options
classes (:class:`ckrun.config.RunConfig`, the backends' ``Options``,
:class:`ckrun.cloud.CloudOptions`, :class:`ckrun.storage.s3_options.S3Options`) use it
for every field (:func:`coerce_fields` in their ``__post_init__``, or
:func:`coerce` on each value while resolving), then check ranges themselves.

Types, by the field's annotation (``from __future__ import annotations`` strings):
``int`` (a whole number; ``"8"`` and ``8.0`` are 8, ``True`` and ``8.5`` are refused),
``float`` (a number; a field named ``*_s`` or ``chaos_*`` is a duration: ``90``,
``"90s"``, ``"500ms"``, ``"2m"``, ``"1h"``), ``bool`` (``true``/``false``, ``yes``/``no``,
``on``/``off``, ``1``/``0``), ``str``, ``tuple[str, ...]`` (a list, or a comma-separated
string), and ``X | None`` (None, or an empty string, is None).  Other annotations are
left as they are.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from ckrun.errors import ConfigError

__all__ = ["coerce", "coerce_fields", "did_you_mean", "field_type", "parse_duration"]


def did_you_mean(word: str, choices: list[str]) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``choices`` (:mod:`difflib`, ratio
    at least 0.6), or ``""`` when none is close: the suffix of an "unknown ..." error."""
    import difflib

    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)?\s*$")
_UNIT_S = {None: 1.0, "s": 1.0, "ms": 0.001, "m": 60.0, "h": 3600.0}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_EXPECTED = {
    "int": "a whole number",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
}


def parse_duration(value: Any) -> float:
    """Seconds from ``90``, ``"90"``, ``"90s"``, ``"500ms"``, ``"2m"`` or ``"1h"``.

    Raises:
        ConfigError: for anything else or a negative value.
    """
    if isinstance(value, bool):
        raise ConfigError(f"invalid duration {value!r}: use seconds, e.g. 90 or 90s")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(
                f"invalid duration {value!r}: durations cannot be negative (use >= 0)"
            )
        return float(value)
    m = _DURATION.match(str(value))
    if not m and _DURATION.match(str(value).strip().removeprefix("-")):
        raise ConfigError(
            f"invalid duration {value!r}: durations cannot be negative; use 0 or more "
            "seconds, e.g. 90, 90s, 2m or 1h"
        )
    if not m:
        raise ConfigError(f"invalid duration {value!r}: use seconds, e.g. 90, 90s, 2m or 1h")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def field_type(cls: type, name: str) -> str:
    """The annotation of field ``name`` of dataclass ``cls``, as a string.

    Raises:
        ConfigError: ``cls`` has no such field.
    """
    for f in dataclasses.fields(cls):
        if f.name == name:
            return str(f.type)
    raise ConfigError(f"unknown key {name!r}")


def coerce(key: str, value: Any, typ: str) -> Any:
    """``value`` as the type ``typ`` of option ``key`` (see the module docstring).

    Raises:
        ConfigError: the value does not convert; the message names the key and the
            expected form.
    """
    base, optional = typ, typ.endswith(" | None")
    if optional:
        base = typ.removesuffix(" | None")
        if value is None or value == "":
            return None
    try:
        if base.startswith("tuple"):
            if isinstance(value, str):
                value = [v for v in (p.strip() for p in value.split(",")) if v]
            return tuple(str(v) for v in value or ())
        if base == "bool":
            if isinstance(value, str):
                if value.lower() not in _TRUE + _FALSE:
                    raise ValueError(value)
                return value.lower() in _TRUE
            return bool(value)
        if base == "float" and (key.endswith("_s") or key.startswith("chaos_")):
            try:
                return parse_duration(value)
            except ConfigError as e:
                raise ConfigError(f"{key}: {e}") from e
        if base == "float":
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if base == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(str(value).strip()) if isinstance(value, str) else int(value)
        if base == "str":
            return str(value)
    except (TypeError, ValueError) as e:
        what = "a list of strings" if base.startswith("tuple") else _EXPECTED.get(base, base)
        raise ConfigError(f"invalid value {value!r} for {key}: expected {what}") from e
    return value


def coerce_fields(obj: Any) -> None:
    """Coerce every field of the (frozen) dataclass instance ``obj`` in place; for the
    ``__post_init__`` of an options class.

    Raises:
        ConfigError: as :func:`coerce`, for the first field that does not convert.
    """
    for f in dataclasses.fields(obj):
        object.__setattr__(obj, f.name, coerce(f.name, getattr(obj, f.name), str(f.type)))
