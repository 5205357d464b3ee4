"""The frozen :class:`RunConfig` of one run, its JSON form (``run.json``), and the keys
of the options classes it holds: the backend's ``Options``
(``ckrun.scheduler.<backend>.Options``), :class:`ckrun.cloud.CloudOptions` and
:class:`ckrun.storage.s3_options.S3Options`.  Values are coerced to the field types by
:func:`ckrun.options.coerce`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckrun.errors import ConfigError
from ckrun.options import coerce, did_you_mean, field_type

#: Keys that are run identity or bookkeeping, not settable from a profile.
_NOT_PROFILE = {"run", "command", "profile", "options", "sources", "cloud"}
#: Environment variable names that differ from ``CKRUN_<KEY>``.
_ENV_NAMES = {"storage": "CKRUN_STORAGE_BASE"}
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:")


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
        grace_s: longest time from a notice to the supervisor's own exit, seconds: the
            deadline is ``min(notice deadline, notice + grace_s)``; TERM and KILL both
            land inside it.
        margin_s: KILL lands ``margin_s`` before the deadline (the supervisor's own time
            to check storage and requeue), seconds.
        kill_delay_s: TERM lands ``kill_delay_s`` before KILL (half the time left when
            the notice is shorter), seconds.
        stray_s: once the command's process exited, processes left in its session get
            TERM after ``stray_s`` and KILL ``stray_s`` later, seconds.
        no_progress_preemptions: preemptions in a row without a new checkpoint that
            stop the run (requeue-storm guard; 0: no limit).
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
        checkpoint_paths: own-checkpoint mode (issue 15): files the command writes as
            its checkpoint (``--checkpoint-path``), relative to the working directory;
            the supervisor commits each new version and restores the newest before
            every start (:mod:`ckrun.supervisor.watched`).
        resume_args: arguments appended to the command when a version was restored
            (``--resume-args 'init_from=resume'``).
        child_signal: the signal the child gets for a notice in own-checkpoint mode (the
            one the script handles); empty: SIGTERM.
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
    stray_s: float = 2.0
    no_progress_preemptions: int = 5
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
    checkpoint_paths: tuple[str, ...] = ()
    resume_args: tuple[str, ...] = ()
    child_signal: str = ""
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

        ``state_dir``/RUN; for local storage without it the run root; for remote storage
        without it :func:`default_state_dir`/RUN (a fresh machine needs nothing but the
        storage URL).
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
        the checkpoint's format reshards (a run preempted on 8 GPUs continues on 4),
        and refuses it otherwise (exit 4).
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

    def child_signal_number(self) -> signal.Signals:
        """:attr:`child_signal` as a ``signal.Signals`` (SIGTERM when empty)."""
        return parse_signal(self.child_signal or "SIGTERM")

    def to_json(self) -> dict[str, Any]:
        """JSON body of ``run.json`` (options flattened under ``"options"``)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["command"] = list(self.command)
        d["allow_change"] = list(self.allow_change)
        d["notice_sources"] = list(self.notice_sources)
        d["checkpoint_paths"] = list(self.checkpoint_paths)
        d["resume_args"] = list(self.resume_args)
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
            cfg = cls(**{k: coerce(k, v, field_type(cls, k)) for k, v in body.items()})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"run.json is invalid: {e}; fix or delete it") from e
        opts = build_options(cfg.scheduler, dict(d.get("options") or {}))
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


def common_keys() -> list[str]:
    """Profile keys that go to :class:`RunConfig`."""
    return [f.name for f in dataclasses.fields(RunConfig) if f.name not in _NOT_PROFILE]


def backend_options_class(scheduler: str) -> type:
    """The backend's ``Options`` dataclass.

    Raises:
        ConfigError: an unknown backend, or one that defines no ``Options`` dataclass.
    """
    from ckrun.scheduler.base import backend_module

    opts = getattr(backend_module(scheduler), "Options", None)
    if not isinstance(opts, type) or not dataclasses.is_dataclass(opts):
        raise ConfigError(f"scheduler backend {scheduler!r} defines no Options dataclass")
    return opts


def build_options(scheduler: str, values: Mapping[str, Any]) -> Any:
    """The backend's ``Options`` from ``values`` (coerced to the field types).

    Raises:
        ConfigError: an unknown key (naming the valid ones) or a bad value.
    """
    cls = backend_options_class(scheduler)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(unknown_keys_message(unknown, scheduler, sorted(names)))
    return cls(**{k: coerce(k, v, field_type(cls, k)) for k, v in values.items()})


def cloud_keys() -> list[str]:
    """Profile keys of the cloud notice sources (:class:`ckrun.cloud.CloudOptions`)."""
    from ckrun.cloud import CloudOptions

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


def cloud_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """The cloud-notice and S3 keys of ``values``, coerced and validated.

    Raises:
        ConfigError: a bad value, naming its key.
    """
    if not values:
        return {}
    from ckrun.storage.s3 import S3Options

    out: dict[str, Any] = {k: v for k, v in values.items() if k in storage_keys()}
    S3Options.from_mapping(out)  # validates; raises ConfigError naming the key
    rest = {k: v for k, v in values.items() if k not in out}
    if rest:
        from ckrun.cloud import CloudOptions

        out.update({k: coerce(k, v, field_type(CloudOptions, k)) for k, v in rest.items()})
    return out


#: Run names: letters, digits, ``.``, ``_``, ``-``; not starting with ``.`` or ``-``.
_RUN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$")


def check_run_name(name: str) -> str:
    """``name`` if it is a valid run name: letters, digits and ``._-`` only, not starting
    with ``.`` or ``-``, at most 200 characters (it becomes a directory and a storage
    prefix, so no path components: ``../x`` would write outside the storage root).

    Raises:
        ConfigError: otherwise, naming the rule.
    """
    if not _RUN_NAME.match(name):
        raise ConfigError(
            f"invalid run name {name!r}: use letters, digits, '.', '_' and '-' only "
            "(no '/' or spaces, not starting with '.' or '-'), e.g. --run charlm-1"
        )
    return name


def unknown_keys_message(unknown: list[str], scheduler: str, backend_keys: list[str]) -> str:
    """The error text for ``unknown`` keys: the closest valid key of each, then every
    valid key, by the class it sets."""
    cloud = f", cloud notices [{', '.join(cloud_keys())}]"
    cloud += f", S3 storage [{', '.join(storage_keys())}]"
    valid = common_keys() + backend_keys + cloud_keys() + storage_keys()
    hints = "".join(did_you_mean(k, valid) for k in unknown)
    return (
        f"unknown config key(s) {', '.join(unknown)}{hints}; valid keys: common "
        f"[{', '.join(common_keys())}], {scheduler} [{', '.join(backend_keys)}]{cloud}"
    )


def env_name(key: str) -> str:
    """Environment variable that sets ``key`` (``CKRUN_<KEY>``)."""
    return _ENV_NAMES.get(key, "CKRUN_" + key.upper())
