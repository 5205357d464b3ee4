"""``ckrun ls``, ``ckrun verify`` and ``ckrun export``: a run root's checkpoints.

``ls`` lists committed checkpoints (and unusable manifests); its status says what was
checked: ``committed`` (the manifest exists and every shard has its recorded size: a
head check, nothing re-read), ``verified`` (``--verify``: every shard re-hashed against
its CRC32C), or ``damaged``/``CORRUPT``/``invalid`` with the problem.  ``verify``
re-hashes every shard and exits non-zero naming each bad file.  ``export`` writes the
consolidated model (and optimizer) state of one checkpoint (:mod:`ckrun.checkpoint.export`;
it imports torch, ``ls`` and ``verify`` do not).  ``runner/cli/main.py`` adds them to
the ``ckrun`` group.

Exit codes: 0 good; 5 (``ExitCode.STORAGE_ERROR``) a checkpoint is corrupt or storage
failed; 2 bad usage (no such run directory, a directory that holds no run, no such step).
"""

from __future__ import annotations

import json
import os
from typing import Any

import click
from ckrun.checkpoint.discovery import completion, scan
from ckrun.checkpoint.manifest import Manifest
from ckrun.checkpoint.verify import head_problems, verify_manifest, verify_shards
from ckrun.errors import CkrunError, ExitCode, UsageError
from ckrun.storage.base import Storage


def run_root(run: str, storage: str | None) -> str:
    """The run root ``ls``/``verify`` inspect: ``run`` itself when it is a URL or an
    existing directory (and no ``--storage`` is given), else the root of the run named
    ``run`` under ``--storage`` (its ``run.json`` says where its checkpoints are).

    Raises:
        UsageError: neither a directory nor a run of that name exists.
    """
    local = run.removeprefix("file://")
    if "://" in local or (storage is None and os.path.isdir(local)):
        return run
    from ckrun.cli.locate import locate
    from ckrun.errors import ConfigError

    try:
        rd = locate(run, storage)
    except (UsageError, ConfigError) as e:
        raise UsageError(
            f"{run}: no such run directory, and {e}; pass the run root (the directory "
            "holding checkpoints/ and run.json) or a run name with --storage DIR"
        ) from None
    cfg = rd.load_config()
    return cfg.run_root if cfg is not None else rd.root


def _open(run_dir: str) -> Storage:
    from ckrun.checkpoint.env import open_storage_from_env

    local = run_dir.removeprefix("file://")
    if "://" not in local and not os.path.isdir(local):
        raise UsageError(
            f"{run_dir}: no such run directory; pass the run root "
            "(the directory holding checkpoints/ and run.json)"
        )
    return open_storage_from_env(run_dir)


#: keys whose presence makes a directory a run root
_RUN_MARKS = ("checkpoints/", "final/", "COMPLETE.json", "run.json", "events.jsonl")


def _require_run(storage: Storage, run_dir: str) -> None:
    """Raise UsageError when ``storage`` holds nothing of a ckrun run."""
    if not any(i.key.startswith(_RUN_MARKS) for i in storage.list("")):
        raise UsageError(
            f"{run_dir}: holds no ckrun run (no checkpoints/, final/, run.json or "
            "COMPLETE.json); pass the run root, e.g. ckrun-runs/NAME"
        )


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _fail(ctx: click.Context, e: CkrunError) -> None:
    click.echo(f"ckrun: error: {e}", err=True)
    ctx.exit(int(e.exit_code))


def _rows(storage: Storage, rehash: bool = False) -> list[dict[str, Any]]:
    sc = scan(storage)
    rows: list[dict[str, Any]] = []
    for m in sc.manifests:
        bad = head_problems(storage, m)
        if bad:
            status = "damaged: " + "; ".join(bad)
        elif rehash:
            problems = [p.message for p in verify_shards(storage, m)]
            status = "verified" if not problems else "CORRUPT: " + "; ".join(problems)
        else:
            status = "committed"
        rows.append(
            {
                "step": m.step,
                "kind": m.kind,
                "size_bytes": m.total_size_bytes,
                "committed_utc": m.committed_utc,
                "attempt": m.attempt,
                "save_duration_s": m.save_duration_s,
                "status": status,
            }
        )
    for key, problem in sc.problems:
        rows.append(
            {
                "step": None,
                "kind": None,
                "size_bytes": None,
                "committed_utc": None,
                "attempt": None,
                "save_duration_s": None,
                "key": key,
                "status": f"invalid: {problem}",
            }
        )
    return rows


_storage_opt = click.option(
    "--storage", default=None, metavar="DIR", help="Storage base when RUN is a run name."
)


@click.command("ls")
@click.argument("run_dir", metavar="RUN")
@_storage_opt
@click.option("--json", "as_json", is_flag=True, help="One JSON object (rows, complete).")
@click.option(
    "--verify", "rehash", is_flag=True, help="Re-hash every shard: status 'verified' or CORRUPT."
)
@click.pass_context
def ls(ctx: click.Context, run_dir: str, storage: str | None, as_json: bool, rehash: bool) -> None:
    """List the checkpoints of RUN (a run name, a run root directory or URL): step,
    kind, size, committed UTC, status.

    STATUS is 'committed' (manifest present, shard sizes right; not re-read) unless
    --verify re-hashed the shards ('verified').
    """
    try:
        run_dir = run_root(run_dir, storage)
        storage_ = _open(run_dir)
        rows = _rows(storage_, rehash)
        marker, problem = completion(storage_)
    except CkrunError as e:
        _fail(ctx, e)
        return
    if as_json:
        body = {
            "run_dir": run_dir,
            "checkpoints": rows,
            "complete": marker is not None,
            "complete_problem": problem,
        }
        click.echo(json.dumps(body, indent=1))
        return
    if not rows:
        click.echo(f"{run_dir}: no checkpoints")
    else:
        click.echo(f"{'STEP':>10}  {'KIND':<9} {'SIZE':>10}  {'COMMITTED (UTC)':<27} STATUS")
        for r in rows:
            step = "-" if r["step"] is None else str(r["step"])
            size = "-" if r["size_bytes"] is None else _size(r["size_bytes"])
            click.echo(
                f"{step:>10}  {r['kind'] or '-':<9} {size:>10}  "
                f"{r['committed_utc'] or '-':<27} {r['status']}"
            )
    if marker is not None:
        click.echo(f"complete: final step {marker.final_step} ({marker.manifest_key})")
    elif problem:
        click.echo(f"completion marker invalid: {problem}")


@click.command("verify")
@click.argument("run_dir", metavar="RUN")
@_storage_opt
@click.option("--step", type=int, default=None, help="Verify only this step.")
@click.pass_context
def verify(ctx: click.Context, run_dir: str, storage: str | None, step: int | None) -> None:
    """Re-hash every shard of RUN's checkpoints (a run name, a run root directory or
    URL); exit 5 naming each bad file."""
    try:
        run_dir = run_root(run_dir, storage)
        storage_ = _open(run_dir)
        _require_run(storage_, run_dir)
        sc = scan(storage_)
    except CkrunError as e:
        _fail(ctx, e)
        return
    todo: list[Manifest] = [m for m in sc.manifests if step is None or m.step == step]
    if step is not None and not todo:
        _fail(
            ctx,
            UsageError(
                f"{run_dir}: no committed checkpoint at step {step}; see `ckrun ls {run_dir}`"
            ),
        )
        return
    bad = 0
    for m in todo:
        problems = verify_manifest(storage_, m)
        bad += bool(problems)
        status = "verified" if not problems else "CORRUPT"
        click.echo(f"step {m.step} ({m.kind}, {_size(m.total_size_bytes)}): {status}")
        for p in problems:
            click.echo(f"  {p}")
    for key, problem in sc.problems:
        if step is None:
            bad += 1
            click.echo(f"{key}: INVALID {problem}")
    if bad:
        click.echo(f"{bad} bad checkpoint(s) in {run_dir}", err=True)
        ctx.exit(int(ExitCode.STORAGE_ERROR))
    click.echo(f"{len(todo)} checkpoint(s) verified")


@click.command("export")
@click.argument("run_dir")
@click.option("--step", type=int, default=None, help="Checkpoint step [newest committed].")
@click.option(
    "--format",
    "fmt",
    required=True,
    metavar="FORMAT",
    help="safetensors | torch (or another registered format).",
)
@click.option("-o", "--output", "out", required=True, metavar="OUT", help="Output file.")
@click.option("--key", default=None, help="Run-state entry of the model [the only one / model].")
@click.option("--optimizer", is_flag=True, help="Also export the optimizer state.")
@click.pass_context
def export(
    ctx: click.Context,
    run_dir: str,
    step: int | None,
    fmt: str,
    out: str,
    key: str | None,
    optimizer: bool,
) -> None:
    """Write the consolidated model (and optimizer) state of RUN_DIR's checkpoint to OUT.

    The checkpoint is verified (CRC32C) before it is read; without --step the newest
    committed one (the final artifact of a finished run) is exported.
    """
    from ckrun.checkpoint import export as exporter

    try:
        storage = _open(run_dir)
        _require_run(storage, run_dir)
        m = exporter.export(storage, out, format=fmt, step=step, key=key, optimizer=optimizer)
    except CkrunError as e:
        _fail(ctx, e)
        return
    click.echo(f"exported step {m.step} ({m.kind}) of {run_dir} as {fmt} to {out}")
