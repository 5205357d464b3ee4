"""The Slurm profile keys: :class:`Options` (re-exported as ``ckrun.scheduler.slurm.Options``).

``config.py`` gives every profile key that is not common to all backends to this
dataclass; :meth:`Options.__post_init__` validates and normalises the values (YAML lists
become tuples, ``"8"`` from the environment becomes 8, ``SIGUSR1`` becomes ``USR1``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from ckrun.errors import ConfigError
from ckrun.options import coerce_fields
from ckrun.scheduler.slurm_jobs import check_lead_time, parse_time_limit_s

#: signals Slurm's ``--signal`` accepts that make sense as a notice.
SIGNALS = ("HUP", "INT", "QUIT", "TERM", "URG", "USR1", "USR2", "XCPU")
_SBATCH_KEY_RE = re.compile(r"^--([a-z][a-z0-9-]*)(?:=(.+))?$")
#: flags ckrun renders itself; an ``extra_sbatch`` line may not override them.
OWN_FLAGS = frozenset(
    {"requeue", "no-requeue", "open-mode", "signal", "job-name", "output", "error", "array"}
)
_OPTIONAL_INTS = ("gpus_per_node", "cpus_per_task")


@dataclass(frozen=True)
class Options:
    """The Slurm profile keys (``profiles/slurm.yaml``); validated on construction.

    Attributes:
        partition: ``--partition``; None uses the cluster default.
        time: ``--time`` in Slurm's format (``"4:00:00"``, ``"1-00:00:00"``, minutes).
        nodes: ``--nodes``; one supervisor task per node (``--ntasks-per-node=1``).
        gpus_per_node: ``--gpus-per-node``.
        cpus_per_task: ``--cpus-per-task`` (the supervisor and the training it starts).
        mem: ``--mem`` per node, e.g. ``"64G"``.
        account: ``--account``.
        qos: ``--qos``.
        signal: the signal Slurm sends ``lead_s`` before the time limit, without
            ``SIG``; the script exports ``CKRUN_NOTICE_SIGNAL=SIG<signal>`` so the
            supervisor and the child treat exactly that signal as the notice.
        lead_s: seconds of warning before the time limit (``--signal=...@lead_s`` and
            the time-limit watcher); Slurm may deliver the signal up to 30 s earlier.
        requeue: render ``--requeue`` (else ``--no-requeue``: a notice then ends in
            exit 6, the checkpoint committed).
        use_srun: run the supervisor as an ``srun`` step, one per node, signalled
            without ``B:``; False ``exec``s it as the batch shell (one node, ``B:``).
        log_dir: submitit's folder: submission scripts and ``%j_%t_log.{out,err}``,
            appended to across requeues (``--open-mode=append``); made absolute.
        launcher: how the job starts ckrun, e.g. ``"ckrun"`` or ``"/venv/bin/ckrun"``.
        setup: shell lines run before the supervisor (``module load``, ``source venv``).
        extra_sbatch: more ``--flag[=value]`` options (``--constraint=a100``,
            ``--exclusive``); flags ckrun owns (requeue, signal, output...) are refused.
        wckey: ``--wckey``; None omits it (submitit's default ``submitit`` is dropped).
    """

    partition: str | None = None
    time: str = "1:00:00"
    nodes: int = 1
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    account: str | None = None
    qos: str | None = None
    signal: str = "USR1"
    lead_s: int = 120
    requeue: bool = True
    use_srun: bool = True
    log_dir: str = "ckrun-logs"
    launcher: str = "ckrun"
    setup: tuple[str, ...] = ()
    extra_sbatch: tuple[str, ...] = ()
    wckey: str | None = None

    def __post_init__(self) -> None:
        """Normalise and validate. Raises ``ConfigError`` naming the key and the fix."""
        put = object.__setattr__
        coerce_fields(self)  # "4" -> 4, "" -> None for optional keys, YAML lists -> tuples
        for name in ("nodes", "lead_s", *_OPTIONAL_INTS):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{name} must not be negative, got {value}")
        sig = str(self.signal).upper().removeprefix("SIG")
        if sig not in SIGNALS:
            raise ConfigError(f"signal {self.signal!r}: use one of {', '.join(SIGNALS)}")
        put(self, "signal", sig)
        limit_s = parse_time_limit_s(self.time)
        if self.nodes < 1:
            raise ConfigError(f"nodes must be at least 1, got {self.nodes}")
        check_lead_time(
            self.lead_s, limit_s, f"time={self.time!r}",
            "give the slurm profile a longer time or a shorter lead_s",
        )  # fmt: skip
        if not self.use_srun and self.nodes > 1:
            raise ConfigError("use_srun: false runs one supervisor, so nodes must be 1")
        if not self.launcher.strip():
            raise ConfigError("launcher is empty: set it to the ckrun executable, e.g. 'ckrun'")
        self.sbatch_extra_params()

    def sbatch_extra_params(self) -> dict[str, Any]:
        """``extra_sbatch`` as submitit ``additional_parameters`` (flag -> value or True).

        Raises:
            ConfigError: a line that is not ``--flag[=value]``, or a flag ckrun owns.
        """
        out: dict[str, Any] = {}
        for line in self.extra_sbatch:
            text = line.strip().removeprefix("#SBATCH").strip()
            m = _SBATCH_KEY_RE.match(text)
            if not m:
                raise ConfigError(f"extra_sbatch line {line!r}: write it as --flag or --flag=value")
            if m.group(1) == "array":
                raise ConfigError(
                    "extra_sbatch sets --array: one ckrun submit is one run; for an array "
                    "use slurm/ckrun.sbatch with --run NAME-$SLURM_ARRAY_TASK_ID"
                )
            if m.group(1) in OWN_FLAGS:
                raise ConfigError(
                    f"extra_sbatch sets --{m.group(1)}, which ckrun renders itself; use the "
                    "profile keys requeue, signal, lead_s and log_dir instead"
                )
            out[m.group(1).replace("-", "_")] = m.group(2) if m.group(2) is not None else True
        return out


def options_from_mapping(values: dict[str, Any]) -> Options:
    """Options from a flat mapping; unknown keys raise ``ConfigError`` with the valid list."""
    valid = {f.name for f in dataclasses.fields(Options)}
    unknown = sorted(set(values) - valid)
    if unknown:
        raise ConfigError(f"unknown slurm option(s) {unknown}; valid: {', '.join(sorted(valid))}")
    return Options(**values)
