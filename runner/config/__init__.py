"""Run configuration: the frozen :class:`RunConfig`, profiles, and value precedence.

Precedence, highest first (DESIGN.md §4 "Config"): command-line options, environment
variables (``CKRUN_<KEY>``, e.g. ``CKRUN_GRACE_S=30``; the storage base is
``CKRUN_STORAGE_BASE`` because ``CKRUN_STORAGE`` is the child's run-root URL), the
profile (flat YAML shipped in the package ``ckrun.profiles``, e.g. ``local.yaml``), and
the dataclasses' defaults.  :attr:`RunConfig.sources` records where each value came
from, which ``ckrun config`` prints.

A profile is flat: keys that are fields of :class:`RunConfig` are *common*; every other
key must be a field of the selected backend's ``Options`` dataclass
(``ckrun.scheduler.<backend>.Options``), of :class:`ckrun.cloud.CloudOptions` or of
:class:`ckrun.storage.s3_options.S3Options`.  Unknown keys raise :class:`ConfigError`
(exit 3) naming the valid keys.  Every value is coerced to its field's type by
:func:`ckrun.options.coerce`; durations (``grace_s``, ``chaos_preempt_every``, ...)
accept seconds (``90``) or a suffix (``90s``, ``2m``, ``1h``).

Modules: :mod:`~ckrun.config.run` (RunConfig, run.json, option classes and keys),
:mod:`~ckrun.config.profiles` (the shipped YAML), :mod:`~ckrun.config.resolve` (the
precedence).
"""

from __future__ import annotations

from ckrun.config.profiles import load_profile
from ckrun.config.resolve import build_notice_sources, resolve
from ckrun.config.run import (
    RunConfig,
    backend_options_class,
    check_run_name,
    cloud_keys,
    common_keys,
    env_name,
    is_local_storage,
    parse_signal,
    storage_env,
    storage_keys,
)
from ckrun.options import parse_duration

__all__ = [
    "RunConfig",
    "backend_options_class",
    "build_notice_sources",
    "check_run_name",
    "cloud_keys",
    "common_keys",
    "env_name",
    "is_local_storage",
    "load_profile",
    "parse_duration",
    "parse_signal",
    "resolve",
    "storage_env",
    "storage_keys",
]
