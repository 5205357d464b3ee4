"""The compat block and the compatibility gate (DESIGN.md §3, "Compat block").

A compat block is a JSON object describing the experiment a checkpoint belongs to: the
user's fields (``config``, ``model_version``, ``dataset_version``, ``precision``, ...) and
fields ckrun fills in (``optimizer``, ``scheduler``, ``world_size``, ``code_commit``,
``code_dirty``, ``torch_version``, ``ckrun_version``, ``python_version``,
``launch_hash``).  Nested values are compared leaf by leaf under dotted paths
(``config.optim.lr``).  Each path's policy comes from its top-level field:

* ``strict``: a difference refuses the resume (``IncompatibleCheckpoint``);
* ``warn``: a difference is logged and recorded in the next manifest's drift;
* ``ignore``: never compared.

``allow_change`` names paths (or prefixes: ``config`` allows every ``config.*``) that may
differ; the drift is recorded.  Fields not in the policy are strict.  No torch import:
the supervisor's preflight uses this module.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckrun.errors import ConfigError

STRICT, WARN, IGNORE = "strict", "warn", "ignore"
DEFAULT_POLICY: dict[str, str] = {
    "config": STRICT,
    "model_version": STRICT,
    "dataset_version": STRICT,
    "optimizer": STRICT,
    "scheduler": STRICT,
    "precision": STRICT,
    "world_size": STRICT,
    "sharding": STRICT,
    "launch_hash": STRICT,
    "signature": STRICT,
    "code_commit": WARN,
    "code_dirty": WARN,
    "torch_version": WARN,
    "ckrun_version": WARN,
    "python_version": WARN,
}
ABSENT: Any = object()  # a path missing on one side; shown as <absent>


def normalize(value: Any, path: str = "compat", *, lenient: bool = False) -> Any:
    """Turn ``value`` into plain JSON data: dataclasses and mappings to dicts, tuples and
    sets to lists, one-element tensors / numpy scalars to numbers (``.item()``), other
    objects to ``str``.

    Args:
        lenient: write non-finite floats as strings (``"nan"``) instead of raising
            (for metrics: a NaN loss must not fail a save).

    Raises:
        ConfigError: a non-finite float when not ``lenient`` (not valid strict JSON).
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return {str(k): normalize(v, f"{path}.{k}", lenient=lenient) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [normalize(v, f"{path}[{i}]", lenient=lenient) for i, v in enumerate(value)]
    if isinstance(value, (set, frozenset)):
        return sorted(str(v) for v in value)
    if not isinstance(value, (str, bytes)) and callable(getattr(value, "item", None)):
        try:
            value = value.item()  # torch / numpy scalars
        except (ValueError, RuntimeError, TypeError):
            return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        if lenient:
            return repr(value)
        raise ConfigError(f"{path}: {value} is not valid in a compat block; use a string")
    for typ in (bool, int, float):
        if isinstance(value, typ):
            return typ(value)
    if value is None or type(value) is str:
        return value
    return str(value)  # str subclasses (torch's TorchVersion) and other objects


def flatten(block: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Leaves of a nested dict keyed by dotted path; lists are leaves."""
    out: dict[str, Any] = {}
    for k, v in block.items():
        path = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, path + "."))
        else:
            out[path] = v
    return out


def fmt(v: Any) -> str:
    """Readable value for a diff line (``0.0003``, ``'adamw'``, ``<absent>``)."""
    if v is ABSENT:
        return "<absent>"
    if isinstance(v, str):
        return v
    return str(repr(v))


@dataclass
class CompatResult:
    """Outcome of :func:`compare`; each entry is a line like ``config.lr: 0.0003 → 0.001``.

    Attributes:
        refuse: strict differences not allowed to change.
        warn: differences in warn fields.
        allowed: differences in ``allow_change`` paths.
    """

    refuse: list[str] = field(default_factory=list)
    warn: list[str] = field(default_factory=list)
    allowed: list[str] = field(default_factory=list)

    @property
    def drift(self) -> list[str]:
        """Allowed and warned differences (recorded in the next manifest)."""
        return self.allowed + self.warn


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON (``1`` differs from ``1.0`` and ``True``)."""
    if a is ABSENT or b is ABSENT:
        return a is b
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def is_allowed(path: str, allow: Sequence[str]) -> bool:
    """Whether ``path`` is one of ``allow`` or under one of them (``config`` allows
    ``config.lr``)."""
    return any(path == a or path.startswith(a + ".") for a in allow)


_allowed = is_allowed


def policy_of(path: str, policy: Mapping[str, str]) -> str:
    """The policy of ``path``: the most specific entry (``config.lr`` before ``config``)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        p = policy.get(".".join(parts[:i]))
        if p is not None:
            return p
    return STRICT


def compare(
    current: Mapping[str, Any],
    stored: Mapping[str, Any],
    *,
    allow_change: Sequence[str] = (),
    policy: Mapping[str, str] | None = None,
    only_current: bool = False,
) -> CompatResult:
    """Compare two compat blocks leaf by leaf.

    Args:
        current: the running experiment's block (normalised JSON).
        stored: the checkpoint's block.
        allow_change: paths (or prefixes) allowed to differ.
        policy: field → ``strict``/``warn``/``ignore``; default :data:`DEFAULT_POLICY`.
        only_current: compare only paths present in ``current`` (the supervisor knows
            only part of the block).

    Returns:
        The differences sorted by path, classified by policy.
    """
    pol = DEFAULT_POLICY if policy is None else policy
    cur, old = flatten(current), flatten(stored)
    paths: Iterable[str] = cur if only_current else cur.keys() | old.keys()
    res = CompatResult()
    for path in sorted(paths):
        a, b = old.get(path, ABSENT), cur.get(path, ABSENT)
        if _same(a, b):
            continue
        kind = policy_of(path, pol)
        if kind == IGNORE:
            continue
        line = f"{path}: {fmt(a)} → {fmt(b)}"
        if _allowed(path, allow_change):
            res.allowed.append(line)
        elif kind == WARN:
            res.warn.append(line)
        else:
            res.refuse.append(line)
    return res


def parse_allow_change(text: str | None) -> tuple[str, ...]:
    """``CKRUN_ALLOW_CHANGE`` (comma-separated field paths) as a tuple."""
    return tuple(p.strip() for p in (text or "").split(",") if p.strip())


_git_cache: dict[str, dict[str, Any]] = {}


def git_state(cwd: str | None = None) -> dict[str, Any]:
    """``{"code_commit": sha, "code_dirty": bool}`` of the git repo at ``cwd`` (default
    the working directory), or ``{}`` outside a repo or without git.  Cached per
    directory; tracked-file changes count as dirty, untracked files do not."""
    d = os.path.abspath(cwd or os.getcwd())
    if d in _git_cache:
        return dict(_git_cache[d])
    out: dict[str, Any] = {}
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=d, capture_output=True, text=True, timeout=10
        )
        if sha.returncode == 0:
            st = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=d,
                capture_output=True,
                text=True,
                timeout=10,
            )
            out = {
                "code_commit": sha.stdout.strip(),
                "code_dirty": bool(st.stdout.strip()) if st.returncode == 0 else True,
            }
    except (OSError, subprocess.SubprocessError):
        out = {}
    _git_cache[d] = out
    return dict(out)
