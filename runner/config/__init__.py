"""Run configuration: the frozen :class:`RunConfig`, profiles, and value precedence.

Precedence, highest first (DESIGN.md §4 "Config"): command-line options, environment
variables (``CKRUN_<KEY>``, e.g. ``CKRUN_GRACE_S=30``; the storage base is
``CKRUN_STORAGE_BASE`` because ``CKRUN_STORAGE`` is the child's run-root URL), the
profile (flat YAML shipped in the package ``ckrun.profiles``, e.g. ``local.yaml``), and
the defaults below.  :attr:`RunConfig.sources` records where each value came from, which
``ckrun config`` prints.

A profile is flat: keys that are fields of :class:`RunConfig` are *common*; every other
key must be a field of the selected backend's ``Options`` dataclass
(``ckrun.scheduler.<backend>.Options``).  Unknown keys raise :class:`ConfigError` (exit 3)
naming the valid keys.

Durations (``grace_s``, ``chaos_preempt_every``, ...) accept seconds (``90``) or a suffix
(``90s``, ``2m``, ``1h``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import json
import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckrun.errors import ConfigError

#: Keys that are run identity or bookkeeping, not settable from a profile.
_NOT_PROFILE = {"run", "command", "profile", "options", "sources", "cloud"}
#: Environment variable names that differ from ``CKRUN_<KEY>``.
_ENV_NAMES = {"storage": "CKRUN_STORAGE_BASE"}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)?\s*$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:")
_UNIT_S = {None: 1.0, "s": 1.0, "ms": 0.001, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines one run, frozen in ``<run root>/run.json``.

    Attributes:
        run: run name; the run root is ``<storage>/<run>``.
        command: the training command, argv form.
        profile: profile name the values were resolved from.
        scheduler: backend name (``local``, ``slurm``, ``k8s``).
        storage: storage base: a local directory or ``s3://bucket/prefix``.
        state_dir: local directory for run.json, events.jsonl, control/ and locks/
            (a machine-local cache: budgets and history travel with the run in its
            storage); empty means the run root for local storage, and
            :func:`default_state_dir` (``$XDG_STATE_HOME/ckrun`` or
            ``~/.local/state/ckrun``, per storage base) for remote storage.
        notice_signal: the signal that means "notice" to supervisor and child.
        grace_s: longest time from a notice to the child's exit, seconds.
        margin_s: TERM is sent ``margin_s`` before the notice deadline, seconds.
        kill_delay_s: time between TERM and KILL, seconds.
        max_requeues: preemptions allowed before the run stops requeueing.
        max_failures: failures of the user's command allowed (total).
        crash_loop_failures: consecutive failures with no checkpoint progress that stop
            the run (crash-loop guard).
        backoff_s: first restart delay after a failure; doubles per failure, seconds.
        backoff_max_s: cap of the restart delay, seconds.
        world_size: processes in the job (part of the launch identity); set to
            ``nproc_per_node * nnodes`` when that is above 1.
        nproc_per_node: processes per node; above 1 (or ``nnodes`` above 1) the
            supervisor runs the command under torchrun (:mod:`ckrun.supervisor.torchrun`).
        nnodes: nodes of the job (one supervisor per node).
        allow_change: compat fields allowed to differ on resume (``--allow-change``).
        notice_sources: cloud notice pollers to run: any of ``aws``, ``gcp``, ``azure``.
        lease_ttl_s: the run's lease expires after this many seconds without a renewal
            (:mod:`ckrun.checkpoint.lease`); a dead holder on another machine blocks its
            successor this long.
        lease_heartbeat_s: seconds between lease renewals; 0: ``lease_ttl_s / 4``.
        wait_for_lease_s: how long a starting supervisor waits for another owner's
            lease to be released or to expire before exiting 2.  When not set anywhere
            (source ``default``): ``2 * lease_ttl_s`` for a requeued or booting attempt on
            a cloud profile (``notice_sources`` set), a requeued Slurm job
            (``SLURM_RESTART_COUNT`` > 0) or a Kubernetes pod, else 0 (exit 2 at once,
            naming the holder).
        options: the backend's frozen ``Options`` instance.
        cloud: keys of ``ckrun.cloud.CloudOptions`` set in the profile/env/CLI
            (``aws_poll_interval_s``, ...), handed to ``ckrun.cloud.build_sources``, and
            of ``ckrun.storage.s3.S3Options`` (``endpoint_url``, ``s3_*``).
        sources: key -> where its value came from (``cli``, ``env:CKRUN_X``,
            ``profile:local``, ``default``).
    """

    run: str = ""
    command: tuple[str, ...] = ()
    profile: str = "local"
    scheduler: str = "local"
    storage: str = "./ckrun-runs"
    state_dir: str = ""
    notice_signal: str = "SIGUSR1"
    grace_s: float = 60.0
    margin_s: float = 2.0
    kill_delay_s: float = 10.0
    max_requeues: int = 100
    max_failures: int = 3
    crash_loop_failures: int = 2
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    world_size: int = 1
    nproc_per_node: int = 1
    nnodes: int = 1
    allow_change: tuple[str, ...] = ()
    notice_sources: tuple[str, ...] = ()
    lease_ttl_s: float = 60.0
    lease_heartbeat_s: float = 0.0
    wait_for_lease_s: float = 0.0
    options: Any = None
    cloud: Mapping[str, Any] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def run_root(self) -> str:
        """Storage URL of this run: ``<storage>/<run>``."""
        return self.storage.rstrip("/") + "/" + self.run

    @property
    def state_root(self) -> str:
        """Local directory holding run.json, events.jsonl, control/ and locks/.

        Raises:
            ConfigError: when storage is remote and no ``state_dir`` is configured.
        """
        if self.state_dir:
            return os.path.join(self.state_dir, self.run)
        if not is_local_storage(self.storage):
            return os.path.join(default_state_dir(self.storage), self.run)
        return os.path.join(self.storage.removeprefix("file://"), self.run)

    @property
    def heartbeat_s(self) -> float:
        """Seconds between lease renewals (``lease_heartbeat_s`` or ``lease_ttl_s / 4``)."""
        return self.lease_heartbeat_s or self.lease_ttl_s / 4

    def launch_identity(self) -> dict[str, Any]:
        """What defines the experiment's launch: argv (argv[0] by basename).

        The world size is deliberately not part of it: the checkpoint's own compat
        block carries ``world_size`` and the child's gate lets it change exactly when
        the checkpoint's format reshards (issue 8: a run preempted on 8 GPUs continues
        on 4), and refuses it otherwise (exit 4).
        """
        argv = list(self.command)
        if argv:
            argv[0] = os.path.basename(argv[0])
        return {"command": argv}

    def launch_hash(self) -> str:
        """SHA-256 (first 16 hex digits) of :meth:`launch_identity` as canonical JSON.

        Passed to the child as ``CKRUN_CONFIG_HASH`` so manifests carry it, and compared
        with the newest checkpoint's ``launch_hash`` in preflight.
        """
        body = json.dumps(self.launch_identity(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    def signal_number(self) -> signal.Signals:
        """:attr:`notice_signal` as a ``signal.Signals``."""
        return parse_signal(self.notice_signal)

    def to_json(self) -> dict[str, Any]:
        """JSON body of ``run.json`` (options flattened under ``"options"``)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["command"] = list(self.command)
        d["allow_change"] = list(self.allow_change)
        d["notice_sources"] = list(self.notice_sources)
        d["options"] = dataclasses.asdict(self.options) if self.options is not None else {}
        d["sources"] = dict(self.sources)
        d["cloud"] = dict(self.cloud)
        d["launch_hash"] = self.launch_hash()
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RunConfig:
        """Inverse of :meth:`to_json`. Raises ``ConfigError`` on unknown or bad fields."""
        names = {f.name for f in dataclasses.fields(cls)}
        skip = ("options", "sources", "cloud")
        body = {k: v for k, v in d.items() if k in names and k not in skip}
        try:
            cfg = cls(**{k: _coerce(k, v, _field_type(k)) for k, v in body.items()})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"run.json is invalid: {e}; fix or delete it") from e
        opts = _build_options(cfg.scheduler, dict(d.get("options") or {}))
        return dataclasses.replace(
            cfg,
            options=opts,
            sources=dict(d.get("sources") or {}),
            cloud=dict(d.get("cloud") or {}),
        )


def default_state_dir(storage: str, environ: Mapping[str, str] | None = None) -> str:
    """The machine-local cache of runs on remote ``storage`` when no ``state_dir`` is set.

    ``$XDG_STATE_HOME/ckrun/<host-part>-<hash>`` (XDG Base Directory Specification;
    ``~/.local/state`` when unset), one directory per storage base so two buckets'
    runs of one name never share a cache.
    """
    env = os.environ if environ is None else environ
    base = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    tag = re.sub(r"[^A-Za-z0-9_.-]+", "-", storage.split("://", 1)[-1]).strip("-")[:40]
    digest = hashlib.sha256(storage.rstrip("/").encode()).hexdigest()[:8]
    return os.path.join(base, "ckrun", f"{tag}-{digest}")


def is_local_storage(url: str) -> bool:
    """True for a local path or ``file://`` URL; False for ``s3://``, ``pvc:CLAIM``, ..."""
    return url.startswith("file://") or not _SCHEME.match(url)


def parse_signal(name: str | int) -> signal.Signals:
    """``"USR1"``, ``"SIGUSR1"`` or ``10`` -> ``signal.SIGUSR1``. Raises ``ConfigError``."""
    try:
        if isinstance(name, int) or str(name).isdigit():
            return signal.Signals(int(name))
        s = str(name).upper()
        return signal.Signals[s if s.startswith("SIG") else "SIG" + s]
    except (KeyError, ValueError) as e:
        raise ConfigError(f"unknown signal {name!r}: use e.g. SIGUSR1, USR2 or SIGTERM") from e


def parse_duration(value: Any) -> float:
    """Seconds from ``90``, ``"90"``, ``"90s"``, ``"500ms"``, ``"2m"`` or ``"1h"``.

    Raises:
        ConfigError: for anything else or a negative value.
    """
    if isinstance(value, bool):
        raise ConfigError(f"invalid duration {value!r}: use seconds, e.g. 90 or 90s")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"invalid duration {value!r}: must be >= 0")
        return float(value)
    m = _DURATION.match(str(value))
    if not m:
        raise ConfigError(f"invalid duration {value!r}: use seconds, e.g. 90, 90s, 2m or 1h")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def _field_type(name: str, cls: type = RunConfig) -> str:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return str(f.type)
    raise ConfigError(f"unknown key {name!r}")


def _coerce(key: str, value: Any, typ: str) -> Any:
    """Convert a YAML/env/CLI value to the field's declared type (string annotation)."""
    try:
        if typ.startswith("tuple"):
            if isinstance(value, str):
                value = [v for v in (p.strip() for p in value.split(",")) if v]
            return tuple(str(v) for v in value or ())
        if typ == "bool":
            if isinstance(value, str):
                if value.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError(value)
                return value.lower() in ("1", "true", "yes", "on")
            return bool(value)
        if typ == "float" and (key.endswith("_s") or key.startswith("chaos_")):
            return parse_duration(value)
        if typ == "float":
            return float(value)
        if typ == "int":
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if typ == "str":
            return str(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"invalid value {value!r} for {key} (expected {typ})") from e
    return value


def load_profile(name: str) -> dict[str, Any]:
    """The flat mapping of profile ``name`` (``ckrun/profiles/<name>.yaml``).

    Raises:
        ConfigError: unknown profile (listing the shipped ones), bad YAML, not a mapping.
    """
    import yaml

    root = importlib.resources.files("ckrun.profiles")
    try:
        text = (root / f"{name}.yaml").read_text(encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        shipped = sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))
        raise ConfigError(
            f"unknown profile {name!r}; shipped profiles: {', '.join(shipped)}"
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


def common_keys() -> list[str]:
    """Profile keys that go to :class:`RunConfig`."""
    return [f.name for f in dataclasses.fields(RunConfig) if f.name not in _NOT_PROFILE]


def backend_options_class(scheduler: str) -> type:
    """The backend's ``Options`` dataclass. Raises ``ConfigError`` if the backend is missing."""
    from ckrun.scheduler.base import backend_module

    try:
        mod = backend_module(scheduler)
    except ImportError as e:
        raise ConfigError(f"scheduler backend {scheduler!r} is not installed: {e}") from e
    opts = getattr(mod, "Options", None)
    if not isinstance(opts, type) or not dataclasses.is_dataclass(opts):
        raise ConfigError(f"scheduler backend {scheduler!r} defines no Options dataclass")
    return opts


def _build_options(scheduler: str, values: Mapping[str, Any]) -> Any:
    cls = backend_options_class(scheduler)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(_unknown_msg(unknown, scheduler, sorted(names)))
    return cls(**{k: _coerce(k, v, _field_type(k, cls)) for k, v in values.items()})


def cloud_keys() -> list[str]:
    """Profile keys of the cloud notice sources (``ckrun.cloud.CloudOptions``), if present."""
    try:
        from ckrun.cloud import CloudOptions
    except ImportError:
        return []
    return [f.name for f in dataclasses.fields(CloudOptions)]


def storage_keys() -> list[str]:
    """Profile keys of the S3 backend (``ckrun.storage.s3.S3Options``: ``endpoint_url``,
    ``s3_*``); they travel to the child as ``CKRUN_<KEY>`` (see :func:`storage_env`)."""
    from ckrun.storage.s3 import S3Options

    return [f.name for f in dataclasses.fields(S3Options)]


def storage_env(cfg: RunConfig) -> dict[str, str]:
    """``CKRUN_<KEY>`` variables for the S3 keys set in ``cfg`` (for the child process)."""
    keys = set(storage_keys())
    return {env_name(k): str(v) for k, v in cfg.cloud.items() if k in keys and v is not None}


def _cloud_values(values: Mapping[str, Any]) -> dict[str, Any]:
    if not values:
        return {}
    from ckrun.storage.s3 import S3Options

    out: dict[str, Any] = {k: v for k, v in values.items() if k in storage_keys()}
    S3Options.from_mapping(out)  # validates; raises ConfigError naming the key
    rest = {k: v for k, v in values.items() if k not in out}
    if rest:
        from ckrun.cloud import CloudOptions

        out.update({k: _coerce(k, v, _field_type(k, CloudOptions)) for k, v in rest.items()})
    return out


def _unknown_msg(unknown: list[str], scheduler: str, backend_keys: list[str]) -> str:
    cloud = f", cloud notices [{', '.join(cloud_keys())}]" if cloud_keys() else ""
    cloud += f", S3 storage [{', '.join(storage_keys())}]"
    return (
        f"unknown config key(s) {', '.join(unknown)}; valid keys: common "
        f"[{', '.join(common_keys())}], {scheduler} [{', '.join(backend_keys)}]{cloud}"
    )


def env_name(key: str) -> str:
    """Environment variable that sets ``key`` (``CKRUN_<KEY>``)."""
    return _ENV_NAMES.get(key, "CKRUN_" + key.upper())


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
        ConfigError: unknown profile or keys (with the valid list), bad values, a
            ``notice_sources`` name not known.
    """
    env = os.environ if env is None else env
    layers: list[tuple[str, dict[str, Any]]] = [("profile:" + profile, load_profile(profile))]
    scheduler = str(layers[0][1].get("scheduler", RunConfig.scheduler))
    backend_keys = [f.name for f in dataclasses.fields(backend_options_class(scheduler))]
    known = common_keys() + backend_keys + cloud_keys() + storage_keys()
    unknown = sorted(set(layers[0][1]) - set(known))
    if unknown:
        raise ConfigError(f"profile {profile!r}: " + _unknown_msg(unknown, scheduler, backend_keys))
    env_layer = {k: env[env_name(k)] for k in known if env.get(env_name(k), "") != ""}
    layers.append(("env", env_layer))
    cli_layer = {k: v for k, v in (cli or {}).items() if v is not None and v != ()}
    unknown = sorted(set(cli_layer) - set(known))
    if unknown:
        raise ConfigError(_unknown_msg(unknown, scheduler, backend_keys))
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
    common = {k: _coerce(k, v, _field_type(k)) for k, v in values.items() if k in common_keys()}
    opts = _build_options(scheduler, {k: v for k, v in values.items() if k in backend_keys})
    extra = set(cloud_keys()) | set(storage_keys())
    cloud = _cloud_values({k: v for k, v in values.items() if k in extra})
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
    for k in ("max_requeues", "max_failures", "crash_loop_failures", "world_size"):
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
    """Cloud notice pollers named by ``cfg.notice_sources`` (``ckrun.cloud.build_sources``).

    Raises:
        ConfigError: when sources are requested but ``ckrun.cloud`` is not available.
    """
    if not cfg.notice_sources:
        return []
    try:
        from ckrun import cloud
    except ImportError as e:
        raise ConfigError(
            f"notice_sources {list(cfg.notice_sources)} need ckrun.cloud, which is not "
            "installed in this build; remove notice_sources from the profile"
        ) from e
    return list(cloud.build_sources(list(cfg.notice_sources), dict(cfg.cloud)))
