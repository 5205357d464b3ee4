"""``ckrun runs`` (the runs under a storage base) and ``ckrun logs NAME [-f]``.

``runs`` lists the runs this machine keeps state for and those whose record the storage
holds (a bucket or a shared directory others ran on), each from ``run.json`` and its
event log or from its record in the storage (no torch import): state, attempts, newest
committed step, goodput and age (time since its last event).
``logs`` prints the output of a detached or scheduled run: the files recorded in
``job.json`` at submission (local: ``supervisor.log`` in the run directory, which holds
the supervisor's and the training process's output; Slurm: the job's ``.out``/``.err``
files); ``-f`` follows them until the run's supervisor has exited.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import click
from ckrun.errors import CkrunError, StorageError, UsageError


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def list_runs(base: str) -> tuple[list[dict[str, Any]], CkrunError | None]:
    """One row per run under the storage base ``base`` (sorted by name): run, state,
    attempts, newest committed step, goodput, age_s (seconds since its last event, or
    since ``run.json`` was written; None without either).  The runs are those this
    machine keeps state for and those whose record the storage holds
    (:func:`ckrun.report.stored.stored_run_names`), so a fresh machine lists the runs
    others ran on a bucket or a shared directory.

    Returns:
        The rows, and why the storage could not be listed (then the rows are this
        machine's only), else None.
    """
    from ckrun.cli.locate import located_config
    from ckrun.cli.status import locate
    from ckrun.notices import utcnow
    from ckrun.report.history import stamp
    from ckrun.report.stored import merge_events, run_storage, stored_events, stored_run_names
    from ckrun.report.summary import summarize
    from ckrun.runlog import read_events
    from ckrun.supervisor.rundir import RunDir

    cfg = located_config("x", base)  # the base's configuration (any valid run name)
    state_base = os.path.dirname(cfg.state_root)  # a state_dir may hold other bases' runs
    names = {
        n
        for n in (os.listdir(state_base) if os.path.isdir(state_base) else [])
        if _stored_on(RunDir(os.path.join(state_base, n)), cfg.storage)
    }
    unlisted: CkrunError | None = None
    try:
        names.update(stored_run_names(cfg))
    except CkrunError as e:
        unlisted = e
    rows = []
    now = utcnow().timestamp()
    for name in sorted(names):
        try:
            rd = locate(name, base)
        except CkrunError:
            continue
        s = summarize(rd)
        evs = merge_events(read_events(rd.events_path), stored_events(run_storage(rd)))
        last = stamp(evs[-1]) if evs else None
        if last is None and os.path.exists(rd.run_json):
            last = os.path.getmtime(rd.run_json)
        rows.append(
            {
                "run": s["run"] or name,
                "state": s["state"],
                "attempts": s["attempts"],
                "step": s["last_committed_step"],
                "goodput": s["goodput"],
                "age_s": None if last is None else round(max(0.0, now - last), 3),
            }
        )
    return rows, unlisted


def _stored_on(rd: Any, storage: str) -> bool:
    """Whether the run whose state is in ``rd`` was frozen with the storage base
    ``storage`` (local paths compared absolute, URLs without a trailing slash)."""
    if not rd.exists():
        return False
    from ckrun.config import is_local_storage

    def norm(u: str) -> str:
        return os.path.abspath(u.removeprefix("file://")) if is_local_storage(u) else u.rstrip("/")

    cfg = rd.load_config()
    return cfg is not None and norm(cfg.storage) == norm(storage)


@click.command("runs")
@click.option(
    "--storage",
    default=None,
    metavar="URL",
    help="Storage base to list: a directory or s3:// [./ckrun-runs].",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON list.")
def runs(storage: str | None, as_json: bool) -> None:
    """List the runs under a storage base: state, attempts, newest step, goodput, age."""
    from ckrun.config import is_local_storage, resolve

    base = resolve("local", {"storage": storage} if storage else {}).storage
    if "://" in base and not base.startswith(("s3://", "file://")):
        raise UsageError(
            f"--storage {base}: ckrun stores runs in a directory (or file://) or on S3 "
            "(s3://BUCKET/PREFIX); other object stores (GCS, MinIO) through their "
            "S3-compatible API: s3:// with the profile key endpoint_url"
        )
    if is_local_storage(base):
        base = os.path.abspath(base.removeprefix("file://"))
    rows, unlisted = list_runs(base)
    if unlisted is not None:
        if not rows:  # nothing to show: the failure is the answer
            raise StorageError(f"cannot list the runs in {base} ({unlisted})")
        click.echo(f"warning: cannot list the runs in {base} ({unlisted}); this machine's only")
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    if not rows:
        click.echo(f"no runs under {base}")
        return
    width = max(3, *(len(r["run"]) for r in rows))
    click.echo(f"{'RUN':<{width}}  {'STATE':<15} {'ATTEMPTS':>8} {'STEP':>8} {'GOODPUT':>8} AGE")
    for r in rows:
        gp = "-" if r["goodput"] is None else f"{100 * r['goodput']:.1f}%"
        step = "-" if r["step"] is None else str(r["step"])
        click.echo(
            f"{r['run']:<{width}}  {r['state']:<15} {r['attempts']:>8} {step:>8} {gp:>8} "
            f"{'-' if r['age_s'] is None else _age(r['age_s'])}"
        )
    click.echo(f"(under {base}; `ckrun status RUN --storage {base}` for one run)")


def log_files(rd: Any) -> list[str]:
    """The output files of the run in ``rd``: those ``job.json`` names, else the run
    directory's ``supervisor.log`` when it exists."""
    from ckrun.supervisor.rundir import read_json

    job = read_json(rd.job_json) or {}
    files = [str(f) for f in job.get("log_files") or []]
    if not files and os.path.exists(rd.log_path):
        files = [rd.log_path]
    return files


def _finished(rd: Any) -> bool:
    """True when no supervisor holds the run and its last supervisor exited (or none
    ever started and nothing was submitted)."""
    from ckrun.runlog import read_events

    if rd.live_holder() is not None:
        return False
    kinds = [e.get("kind") for e in read_events(rd.events_path)]
    starts = [i for i, k in enumerate(kinds) if k in ("supervisor_start", "submitted")]
    exits = [i for i, k in enumerate(kinds) if k == "supervisor_exit"]
    return bool(exits) and (not starts or exits[-1] > starts[-1])


@click.command("logs")
@click.argument("name")
@click.option("--storage", default=None, metavar="DIR", help="Storage base [./ckrun-runs].")
@click.option("-f", "--follow", is_flag=True, help="Follow the output until the run stops.")
def logs(name: str, storage: str | None, follow: bool) -> None:
    """The supervisor's and the training process's output of run NAME (detached or
    scheduled runs; a foreground run printed to its terminal)."""
    from ckrun.cli.locate import hint, run_storage
    from ckrun.cli.status import locate
    from ckrun.report.stored import StoredRunDir, event_line, stored_events
    from ckrun.report.stored import run_storage as open_stored
    from ckrun.supervisor.rundir import read_json

    rd = locate(name, storage)
    files = log_files(rd)
    if not files and isinstance(rd, StoredRunDir):  # a machine that never ran it
        st = open_stored(rd)
        click.echo(
            f"(run {name!r} has no output on this machine: its output stayed where it ran; "
            f"its supervisor events from {st.url if st else 'its storage'}:)",
            err=True,
        )
        for e in stored_events(st):
            click.echo(event_line(e))
        return
    job = read_json(rd.job_json)
    if not files and job and job.get("backend") == "k8s":
        ns, _, jname = str(job.get("job_id")).rpartition("/")
        raise UsageError(
            f"run {name!r} runs as Kubernetes Job {job.get('job_id')}: its output is the "
            f"pods' log, `kubectl logs -n {ns or 'default'} job/{jname}{' -f' if follow else ''}`"
        )
    if not files:
        raise UsageError(
            f"run {name!r} has no output file: it ran in the foreground (its output went "
            f"to that terminal) or was never submitted; `{hint('status', name, run_storage(rd))}`"
        )
    offsets: dict[str, int] = {}
    while True:
        files = log_files(rd) or files
        done = _finished(rd)  # read before the files: their last bytes come after it
        for path in files:
            try:
                with open(path, "rb") as f:
                    f.seek(offsets.get(path, 0))
                    chunk = f.read()
            except FileNotFoundError:
                continue
            if chunk:
                offsets[path] = offsets.get(path, 0) + len(chunk)
                click.echo(chunk.decode("utf-8", "replace"), nl=False)
        if not follow or done:
            return
        try:
            time.sleep(0.2)
        except KeyboardInterrupt:
            return
