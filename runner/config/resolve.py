"""Resolve a :class:`~ckrun.config.run.RunConfig` from its sources.

Precedence, highest first (DESIGN.md §4 "Config"): command-line options, environment
variables (``CKRUN_<KEY>``), the profile (:mod:`ckrun.config.profiles`), and the
defaults of the dataclasses.  :attr:`RunConfig.sources` records where each value came
from.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from ckrun.config.profiles import load_profile
from ckrun.config.run import (
    RunConfig,
    backend_options_class,
    build_options,
    check_run_name,
    cloud_keys,
    cloud_values,
    common_keys,
    env_name,
    parse_signal,
    storage_keys,
    unknown_keys_message,
)
from ckrun.errors import ConfigError
from ckrun.options import coerce, field_type

__all__ = ["build_notice_sources", "resolve"]


def resolve(
    profile: str = "local",
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    run: str = "",
    command: tuple[str, ...] | list[str] = (),
) -> RunConfig:
    """Resolve a :class:`RunConfig` from CLI > env > profile > defaults.

    Args:
        profile: profile name (``local``, ``slurm``, ...).
        cli: values given on the command line (``None`` values are ignored).
        env: environment (default ``os.environ``); ``CKRUN_<KEY>`` per key.
        run: run name.
        command: the training command.

    Raises:
        ConfigError: unknown profile or keys (with the valid list and the closest
            one), bad values, an invalid run name (:func:`check_run_name`), a
            ``notice_sources`` name not known.
    """
    env = os.environ if env is None else env
    if run:
        check_run_name(run)
    layers: list[tuple[str, dict[str, Any]]] = [("profile:" + profile, load_profile(profile))]
    scheduler = str(layers[0][1].get("scheduler", RunConfig.scheduler))
    backend_keys = [f.name for f in dataclasses.fields(backend_options_class(scheduler))]
    known = common_keys() + backend_keys + cloud_keys() + storage_keys()
    unknown = sorted(set(layers[0][1]) - set(known))
    if unknown:
        raise ConfigError(
            f"profile {profile!r}: " + unknown_keys_message(unknown, scheduler, backend_keys)
        )
    env_layer = {k: env[env_name(k)] for k in known if env.get(env_name(k), "") != ""}
    layers.append(("env", env_layer))
    cli_layer = {k: v for k, v in (cli or {}).items() if v is not None and v != ()}
    unknown = sorted(set(cli_layer) - set(known))
    if unknown:
        raise ConfigError(unknown_keys_message(unknown, scheduler, backend_keys))
    layers.append(("cli", cli_layer))
    values: dict[str, Any] = {}
    sources: dict[str, str] = {k: "default" for k in known}
    for origin, layer in layers:
        for k, v in layer.items():
            values[k] = v
            sources[k] = f"env:{env_name(k)}" if origin == "env" else origin
    if values.get("scheduler", scheduler) != scheduler:
        raise ConfigError(
            f"scheduler {values['scheduler']!r} differs from profile {profile!r}'s "
            f"{scheduler!r}: choose the profile of that backend instead"
        )
    common = {
        k: coerce(k, v, field_type(RunConfig, k)) for k, v in values.items() if k in common_keys()
    }
    opts = build_options(scheduler, {k: v for k, v in values.items() if k in backend_keys})
    extra = set(cloud_keys()) | set(storage_keys())
    cloud = cloud_values({k: v for k, v in values.items() if k in extra})
    cfg = RunConfig(
        run=run,
        command=tuple(command),
        profile=profile,
        options=opts,
        cloud=cloud,
        sources=sources,
        **common,
    )
    cfg = _launched_world(cfg)
    _validate(cfg)
    return cfg


def _launched_world(cfg: RunConfig) -> RunConfig:
    """``world_size`` = ``nproc_per_node * nnodes`` for a torchrun launch.

    Raises:
        ConfigError: a count below 1, or a ``world_size`` set explicitly to another value.
    """
    if cfg.nproc_per_node < 1 or cfg.nnodes < 1:
        raise ConfigError(
            f"nproc_per_node ({cfg.nproc_per_node}) and nnodes ({cfg.nnodes}) must be >= 1"
        )
    launched = cfg.nproc_per_node * cfg.nnodes
    if launched == 1 or cfg.world_size == launched:
        return cfg
    if cfg.sources.get("world_size", "default") != "default":
        raise ConfigError(
            f"world_size {cfg.world_size} contradicts nproc_per_node "
            f"{cfg.nproc_per_node} x nnodes {cfg.nnodes} = {launched}; drop "
            "world_size (it is derived)"
        )
    return dataclasses.replace(
        cfg, world_size=launched, sources={**cfg.sources, "world_size": "nproc_per_node x nnodes"}
    )


def _validate(cfg: RunConfig) -> None:
    parse_signal(cfg.notice_signal)
    if cfg.child_signal:
        parse_signal(cfg.child_signal)
    if (cfg.resume_args or cfg.child_signal) and not cfg.checkpoint_paths:
        raise ConfigError(
            "resume_args and child_signal belong to own-checkpoint mode: name the "
            "script's checkpoint file with --checkpoint-path FILE"
        )
    for k in (
        "max_requeues",
        "max_failures",
        "crash_loop_failures",
        "no_progress_preemptions",
        "world_size",
    ):
        if getattr(cfg, k) < (1 if k == "world_size" else 0):
            raise ConfigError(f"{k} must be >= {1 if k == 'world_size' else 0}")
    bad = sorted(set(cfg.notice_sources) - {"aws", "gcp", "azure"})
    if bad:
        raise ConfigError(f"unknown notice_sources {bad}: valid are aws, gcp, azure")
    if cfg.grace_s <= cfg.margin_s:
        raise ConfigError(f"grace_s ({cfg.grace_s}) must exceed margin_s ({cfg.margin_s})")
    if cfg.lease_ttl_s <= 0 or cfg.heartbeat_s * 2 > cfg.lease_ttl_s:
        raise ConfigError(
            f"lease_ttl_s ({cfg.lease_ttl_s:g}) must be > 0 and lease_heartbeat_s "
            f"({cfg.heartbeat_s:g}) at most half of it (a live holder renews several "
            "times per TTL)"
        )


def build_notice_sources(cfg: RunConfig) -> list[Any]:
    """Cloud notice pollers named by ``cfg.notice_sources``, started
    (:func:`ckrun.cloud.build_sources`).

    Raises:
        ConfigError: an invalid cloud option.
    """
    if not cfg.notice_sources:
        return []
    from ckrun import cloud

    return list(cloud.build_sources(list(cfg.notice_sources), dict(cfg.cloud)))
