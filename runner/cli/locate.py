"""Finding a run from the command line: its configuration before ``run.json`` is read,
its state directory (following the pointer a ``state_dir`` elsewhere leaves), where it
lives now after a move, the commands to suggest for it, and the backend that runs it
(used by :mod:`ckrun.cli.commands`, ``requests``, ``status``, ``runs``, ``checkpoints``).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Mapping

from ckrun.cli.suggest import close_run_names
from ckrun.config import RunConfig, check_run_name, is_local_storage, resolve
from ckrun.errors import UsageError
from ckrun.scheduler.base import Scheduler, get_scheduler
from ckrun.supervisor.rundir import RunDir, read_json


def absolute_paths(cfg: RunConfig) -> RunConfig:
    """Local storage and state paths made absolute (run.json must not depend on cwd)."""
    st = cfg.storage
    if is_local_storage(st):
        st = os.path.abspath(st.removeprefix("file://"))
    sd = os.path.abspath(cfg.state_dir) if cfg.state_dir else ""
    return dataclasses.replace(cfg, storage=st, state_dir=sd)


def hint(verb: str, name: str, storage: str, *extra: str) -> str:
    """A command to suggest in a message, with the ``--storage`` that found the run, so
    it works as pasted from any directory: ``ckrun status r1 --storage /abs/runs``."""
    return shlex.join(["ckrun", verb, name, *extra, "--storage", storage])


def locate(name: str, storage: str | None) -> RunDir:
    """The state directory of run ``name``.

    Raises:
        ConfigError: ``name`` is not a valid run name.
        UsageError: no run of that name exists there.
    """
    cfg = located_config(name, storage)
    rd = RunDir(cfg.state_root)
    if not rd.exists():  # a profile's state_dir put it elsewhere: the submit left a pointer
        moved = read_json(os.path.join(cfg.state_root, STATE_POINTER)) or {}
        if moved.get("state_root") and RunDir(str(moved["state_root"])).exists():
            rd = RunDir(str(moved["state_root"]))
    if not rd.exists():
        close = close_run_names(name, cfg.storage)
        raise UsageError(
            f"no run {name!r} under {cfg.storage}"
            + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else "")
            + f" (no {rd.run_json}); pass --storage DIR "
            f"where it was submitted; `{shlex.join(['ckrun', 'runs', '--storage', cfg.storage])}`"
            " lists the runs there"
        )
    return rd


#: In the state directory :func:`locate` looks in: where the run's state really is.
STATE_POINTER = "state-root.json"


def located_config(name: str, storage: str | None) -> RunConfig:
    """The configuration a command that takes a run resolves for ``name`` under
    ``storage`` (the local profile, paths made absolute), before reading ``run.json``.

    Raises:
        ConfigError: ``name`` is not a valid run name.
    """
    check_run_name(name)
    return absolute_paths(resolve("local", {"storage": storage} if storage else {}, run=name))


def run_storage(rd: RunDir) -> str:
    """The storage base a run was frozen with (for :func:`hint`); the state directory's
    parent when ``run.json`` does not say."""
    body = read_json(rd.run_json) or {}
    return str(body.get("storage") or os.path.dirname(rd.root))


def relocated(frozen: RunConfig, found: RunConfig, *, given: bool) -> tuple[str, str]:
    """Where the run lives now: the location it was *found* at, not the frozen one.

    ``run.json`` freezes absolute paths; after the file system moved or is mounted
    elsewhere (a new node) they are stale.  The run was found under ``found``'s state
    root, so that state dir (and, for local storage or an explicit ``--storage``, that
    storage) is the truth; the frozen config never redirects the run elsewhere.
    """
    storage = found.storage if given or is_local_storage(frozen.storage) else frozen.storage
    return storage, found.state_dir


def detect_backend(env: Mapping[str, str] | None = None) -> str:
    """``slurm`` when ``SLURM_JOB_ID`` is set, ``k8s`` with ``KUBERNETES_SERVICE_HOST``."""
    env = os.environ if env is None else env
    if env.get("SLURM_JOB_ID"):
        return "slurm"
    if env.get("KUBERNETES_SERVICE_HOST"):
        return "k8s"
    return "local"


def scheduler_for(backend: str, cfg: RunConfig | None) -> Scheduler:
    """Instantiate ``backend``, giving it the run's options when they are its own.

    The options always reach the backend (no silent fallback to defaults): a backend
    that cannot take them fails loudly.
    """
    opts = cfg.options if cfg is not None and cfg.scheduler == backend else None
    if opts is None:
        return get_scheduler(backend)
    return get_scheduler(backend, options=opts)
