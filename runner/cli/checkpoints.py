"""``ckrun ls`` and ``ckrun verify``: inspect a run root's checkpoints (no torch import).

``ls`` lists committed checkpoints (and unusable manifests) with a head-only status;
``verify`` re-hashes every shard (CRC32C) and exits non-zero naming each bad file.
``runner/cli.py`` adds both to the ``ckrun`` group.

Exit codes: 0 good; 5 (``ExitCode.STORAGE_ERROR``) a checkpoint is corrupt or storage
failed; 2 bad usage (no such run directory or step).
"""

from __future__ import annotations

import json
import os
from typing import Any

import click
from ckrun.checkpoint.discovery import completion, scan
from ckrun.checkpoint.manifest import Manifest
from ckrun.checkpoint.verify import head_problems, verify_manifest
from ckrun.errors import CkrunError, ExitCode, UsageError
from ckrun.storage.base import Storage


def _open(run_dir: str) -> Storage:
    from ckrun.checkpoint.env import open_storage_from_env

    local = run_dir.removeprefix("file://")
    if "://" not in local and not os.path.isdir(local):
        raise UsageError(
            f"{run_dir}: no such run directory; pass the run root "
            "(the directory holding checkpoints/ and run.json)"
        )
    return open_storage_from_env(run_dir)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _fail(ctx: click.Context, e: CkrunError) -> None:
    click.echo(f"ckrun: error: {e}", err=True)
    ctx.exit(int(e.exit_code))


def _rows(storage: Storage) -> list[dict[str, Any]]:
    sc = scan(storage)
    rows: list[dict[str, Any]] = []
    for m in sc.manifests:
        bad = head_problems(storage, m)
        rows.append(
            {
                "step": m.step,
                "kind": m.kind,
                "size_bytes": m.total_size_bytes,
                "committed_utc": m.committed_utc,
                "attempt": m.attempt,
                "save_duration_s": m.save_duration_s,
                "status": "ok" if not bad else "damaged: " + "; ".join(bad),
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


@click.command("ls")
@click.argument("run_dir")
@click.option("--json", "as_json", is_flag=True, help="One JSON object (rows, complete).")
@click.pass_context
def ls(ctx: click.Context, run_dir: str, as_json: bool) -> None:
    """List the checkpoints of RUN_DIR: step, kind, size, committed UTC, status."""
    try:
        storage = _open(run_dir)
        rows = _rows(storage)
        marker, problem = completion(storage)
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
@click.argument("run_dir")
@click.option("--step", type=int, default=None, help="Verify only this step.")
@click.pass_context
def verify(ctx: click.Context, run_dir: str, step: int | None) -> None:
    """Re-hash every shard of RUN_DIR's checkpoints; exit 5 naming each bad file."""
    try:
        storage = _open(run_dir)
        sc = scan(storage)
    except CkrunError as e:
        _fail(ctx, e)
        return
    todo: list[Manifest] = [m for m in sc.manifests if step is None or m.step == step]
    if step is not None and not todo:
        _fail(ctx, UsageError(f"{run_dir}: no committed checkpoint at step {step}; see `ckrun ls`"))
        return
    bad = 0
    for m in todo:
        problems = verify_manifest(storage, m)
        bad += bool(problems)
        status = "ok" if not problems else "CORRUPT"
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
