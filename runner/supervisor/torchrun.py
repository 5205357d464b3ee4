"""Running the training command under ``torchrun`` inside the supervisor.

``ckrun submit train.py --nproc-per-node N [--nnodes M]`` keeps the user's command as the
launch identity (``run.json``) and the supervisor spawns :func:`wrap`'s form of it::

    python -m torch.distributed.run --nproc-per-node N --nnodes M
        (--standalone | --node-rank R --master-addr A --master-port P)
        [--shutdown-timeout G] train.py ARGS...

Three properties of torchrun shape how a notice reaches every rank (DESIGN.md §3):

* it does not forward SIGUSR1/SIGUSR2 (its default ``--signals-to-handle`` is TERM, INT,
  HUP, QUIT), and it starts each worker in a session of its own (``start_new_session``),
  so a signal to the child's session or process group never reaches the ranks.  The
  supervisor therefore writes ``notice.json`` first (every rank polls it in
  ``preemption_requested()``) and then signals the worker processes directly:
  :func:`family` finds them by walking ``/proc`` from the child (ppid links) and keeps
  their session ids, so workers orphaned by a dying torchrun are still found (the
  supervisor is their subreaper) and no rank outlives the supervisor;
* on SIGTERM it forwards TERM to the workers and KILLs them 30 s later: the wrapper
  passes ``--shutdown-timeout`` = ``ceil(grace_s)`` (torch ≥ 2.6 has the option, read
  from torch's own source without importing torch), so a SIGTERM that reaches torchrun
  directly (a Slurm step-wide TERM) never cuts the save short before the supervisor's
  deadline; the supervisor's own TERM/KILL at the deadline still ends everything;
* it exits 1 when a worker exits 75; in ``DRAINING`` the supervisor judges the attempt by
  the commit in storage, not by the status.

Multi-node (one supervisor per node, e.g. ``srun``): static rendezvous with
``--node-rank`` (the scheduler's rank of this supervisor), ``MASTER_ADDR`` (else, under
Slurm, the first host of ``SLURM_JOB_NODELIST``) and ``MASTER_PORT`` (else 29500, or
``20000 + SLURM_JOB_ID % 20000`` under Slurm so that jobs sharing a node do not
collide).  Only the supervisor of rank 0 requeues the job (``Scheduler.requeue``
returns at once on other ranks).

Kubernetes (one pod per node; :mod:`ckrun.scheduler.k8s_group` renders the env): the c10d
rendezvous (torch ``--rdzv-backend c10d``) at ``CKRUN_RDZV_ENDPOINT``, index 0's stable
name ``<prefix>-0.<service>:PORT``; index 0's torchrun hosts the store (``is_host`` set
explicitly, not guessed from host names), the others join, all wait up to
``CKRUN_RDZV_TIMEOUT_S`` for the slowest pod: ``join_timeout``, and ``read_timeout``,
which is also how long a node keeps trying to reach the store of an index 0 that starts
(or resolves in DNS) later than it -- torch's default is 60 s.  c10d ignores
``--node-rank``: it numbers nodes by their sorted address (torch
``dynamic_rendezvous``: ``sorted(participants)``), so each pod passes its own stable name
``<prefix>-<index>.<service>`` as ``--local-addr``.  Node rank then equals
``JOB_COMPLETION_INDEX`` for up to 10 nodes; beyond that the order of the names is
lexicographic (``-10.`` before ``-2.``), the same in every generation of the group, and
index 0 (``-0.``) always sorts first, so global rank 0 -- the rank that commits and
finalizes -- always runs on index 0.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Mapping, Sequence

from ckrun.errors import ConfigError

MODULE = "torch.distributed.run"
DEFAULT_PORT = 29500
#: Pod env naming the c10d rendezvous ``HOST:PORT`` (rendered by the k8s backend).
RDZV_ENDPOINT_ENV = "CKRUN_RDZV_ENDPOINT"
#: torchrun's own default shutdown timeout (seconds between TERM and KILL of workers).
TORCHRUN_KILL_S = 30
#: Seconds between process-tree scans of a torchrun child (:func:`track`).
TRACK_EMPTY_S, TRACK_KNOWN_S = 0.5, 5.0


def is_python(argv0: str) -> bool:
    """True when ``argv0`` names a Python interpreter (``python``, ``python3.11``, ...)."""
    return os.path.basename(argv0).startswith("python")


def supports_shutdown_timeout() -> bool:
    """True when the installed torchrun has ``--shutdown-timeout`` (no torch import)."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    path = os.path.join(list(spec.submodule_search_locations)[0], "distributed", "run.py")
    try:
        with open(path, encoding="utf-8") as f:
            return "--shutdown-timeout" in f.read()
    except OSError:
        return False


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: ``gpu[03-05,9],cpu1`` → ``gpu03``."""
    text, depth, end = nodelist.strip(), 0, None
    for i, c in enumerate(text):
        depth += {"[": 1, "]": -1}.get(c, 0)
        if c == "," and depth == 0:
            end = i
            break
    head = text[:end]
    if "[" not in head:
        return head
    prefix, rest = head.split("[", 1)
    inner, suffix = rest.split("]", 1)
    return prefix + inner.split(",")[0].split("-")[0] + suffix


def rendezvous_args(nnodes: int, node_rank: int, env: Mapping[str, str]) -> list[str]:
    """``--standalone`` on one node; static rendezvous arguments on several.

    Raises:
        ConfigError: several nodes but no ``MASTER_ADDR``, or a bad port / node rank.
    """
    if nnodes <= 1:
        return ["--standalone"]
    if env.get(RDZV_ENDPOINT_ENV):
        return c10d_args(nnodes, node_rank, env)
    slurm_nodes = env.get("SLURM_JOB_NODELIST", "")
    addr = env.get("MASTER_ADDR") or (first_host(slurm_nodes) if slurm_nodes else "")
    default_port = DEFAULT_PORT
    if env.get("SLURM_JOB_ID", "").isdigit():
        default_port = 20000 + int(env["SLURM_JOB_ID"]) % 20000
    if not addr:
        raise ConfigError(
            f"--nnodes {nnodes}: set MASTER_ADDR (and MASTER_PORT) to the first "
            "node's address in the job script, e.g. MASTER_ADDR=$(scontrol show "
            "hostnames $SLURM_JOB_NODELIST | head -n1)"
        )
    try:
        port = int(env.get("MASTER_PORT") or default_port)
    except ValueError as e:
        raise ConfigError(f"MASTER_PORT={env.get('MASTER_PORT')!r} is not a port") from e
    if not 0 <= node_rank < nnodes:
        raise ConfigError(
            f"node rank {node_rank} is outside --nnodes {nnodes}; one "
            "supervisor per node (srun --ntasks-per-node 1)"
        )
    return ["--node-rank", str(node_rank), "--master-addr", addr, "--master-port", str(port)]


def c10d_args(nnodes: int, node_rank: int, env: Mapping[str, str]) -> list[str]:
    """torchrun's c10d rendezvous arguments for node ``node_rank`` (module docstring).

    Raises:
        ConfigError: ``CKRUN_RDZV_ENDPOINT`` is not ``<prefix>-0.<domain>:PORT``, or the
            node rank is outside ``nnodes``.
    """
    endpoint = env[RDZV_ENDPOINT_ENV]
    host, _, port = endpoint.rpartition(":")
    label, dot, domain = host.partition(".")
    if not (port.isdigit() and label.endswith("-0") and dot and domain):
        raise ConfigError(
            f"{RDZV_ENDPOINT_ENV}={endpoint!r}: expected index 0's stable name and port, "
            "<prefix>-0.<service>:PORT (rendered by the k8s backend)"
        )
    if not 0 <= node_rank < nnodes:
        raise ConfigError(
            f"JOB_COMPLETION_INDEX {node_rank} is outside --nnodes {nnodes}: the Job's "
            "completions and parallelism must equal --nnodes"
        )
    conf = [f"is_host={'true' if node_rank == 0 else 'false'}"]
    timeout = env.get("CKRUN_RDZV_TIMEOUT_S", "")
    if timeout:
        if not timeout.isdigit():
            raise ConfigError(f"CKRUN_RDZV_TIMEOUT_S={timeout!r} is not a number of seconds")
        # join_timeout: waiting for the last node; read_timeout: the store client's
        # connect timeout too (torch's default 60 s), for an index 0 that starts later
        conf += [f"join_timeout={timeout}", f"read_timeout={timeout}"]
    return [
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        env.get("CKRUN_RDZV_ID") or label[:-2],
        "--rdzv-conf",
        ",".join(conf),
        "--local-addr",
        f"{label[:-1]}{node_rank}.{domain}",
    ]


def wrap(
    command: Sequence[str],
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    grace_s: float = 60.0,
    env: Mapping[str, str] | None = None,
) -> tuple[str, ...]:
    """The command the supervisor spawns: ``command`` itself for one process, else the
    torchrun form of the module docstring.

    ``python train.py ARGS`` becomes ``... train.py ARGS``, ``python -m pkg ARGS`` becomes
    ``... -m pkg ARGS``, any other program ``... --no-python PROG ARGS``; torchrun runs
    with the same interpreter as the command (else ``python3``).

    Raises:
        ConfigError: a count below 1, or a multi-node rendezvous that cannot be formed.
    """
    if nproc_per_node < 1 or nnodes < 1:
        raise ConfigError(
            f"--nproc-per-node ({nproc_per_node}) and --nnodes ({nnodes}) must be >= 1"
        )
    argv = list(command)
    if nproc_per_node * nnodes == 1 or not argv:
        return tuple(argv)
    python = argv[0] if is_python(argv[0]) else "python3"
    if is_python(argv[0]) and len(argv) > 2 and argv[1] == "-m":
        target = ["-m", *argv[2:]]
    elif is_python(argv[0]) and len(argv) > 1:
        target = argv[1:]
    else:
        target = ["--no-python", *argv]
    head = [
        python,
        "-m",
        MODULE,
        "--nproc-per-node",
        str(nproc_per_node),
        "--nnodes",
        str(nnodes),
        *rendezvous_args(nnodes, node_rank, os.environ if env is None else env),
    ]
    if supports_shutdown_timeout():
        head += ["--shutdown-timeout", str(max(1, math.ceil(grace_s)))]
    return (*head, *target)


_scanned: dict[int, float] = {}  # root pid -> monotonic time of its last scan


def track(root: int, sids: set[int], now: float) -> None:
    """Learn the sessions of ``root``'s descendants (:func:`family`), throttled.

    A ``/proc`` scan costs ~1.6 ms per 100 processes, so while no worker is known it
    runs at most every :data:`TRACK_EMPTY_S`, afterwards every :data:`TRACK_KNOWN_S`
    (torchrun starts its workers once; with ``--max-restarts`` it may start new ones).
    """
    last = _scanned.get(root)
    period = TRACK_KNOWN_S if sids else TRACK_EMPTY_S
    if last is None or now - last >= period:
        _scanned[root] = now
        family(root, sids)


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, session id) of every live, non-zombie process (one ``/proc`` scan)."""
    out: dict[int, tuple[int, int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        rest = raw[raw.rfind(b")") + 2 :].split()
        if len(rest) >= 4 and rest[0] != b"Z":
            out[int(name)] = (int(rest[1]), int(rest[3]))
    return out


def family(root: int, sids: set[int]) -> list[int]:
    """Live processes of a launch rooted at ``root`` (the supervisor's child).

    Those in ``root``'s session, its descendants (ppid links: torchrun's workers sit in
    sessions of their own), and any process of a session in ``sids``.  ``sids`` is
    updated in place with the sessions of the descendants seen, so a worker orphaned by a
    dead torchrun (re-parented to the subreaper supervisor) is still found next time.

    Returns:
        Sorted pids (empty when ``/proc`` is unavailable).
    """
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _sid) in table.items():
        children.setdefault(ppid, []).append(pid)
    stack, seen = [root], set()
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        stack.extend(children.get(p, ()))
    sids.update(table[p][1] for p in seen if p in table and p != root)
    sids.discard(os.getsid(0))  # never the supervisor's own session
    members = {p for p, (_pp, sid) in table.items() if sid == root or sid in sids}
    members.update(p for p in seen if p in table)
    members.discard(os.getpid())
    return sorted(members)
