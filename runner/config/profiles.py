"""Profiles: the flat YAML files shipped in the package ``ckrun.profiles``
(``local.yaml``, ``slurm.yaml``, ...), one per backend and setting."""

from __future__ import annotations

import importlib.resources
from typing import Any

from ckrun.errors import ConfigError
from ckrun.options import did_you_mean

__all__ = ["load_profile"]


def load_profile(name: str) -> dict[str, Any]:
    """The flat mapping of profile ``name`` (``ckrun/profiles/<name>.yaml``).

    Raises:
        ConfigError: unknown profile (listing the shipped ones and the closest), bad
            YAML, not a mapping.
    """
    import yaml

    root = importlib.resources.files("ckrun.profiles")
    try:
        text = (root / f"{name}.yaml").read_text(encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        shipped = sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))
        raise ConfigError(
            f"unknown profile {name!r}{did_you_mean(name, shipped)}; shipped profiles: "
            f"{', '.join(shipped)}"
        ) from None
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        body = yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader
    except yaml.YAMLError as e:
        raise ConfigError(f"profile {name!r} is not valid YAML: {e}") from e
    if body is None:
        return {}
    if not isinstance(body, dict) or any(isinstance(v, dict) for v in body.values()):
        raise ConfigError(f"profile {name!r} must be a flat mapping of key: value")
    return {str(k): v for k, v in body.items()}
