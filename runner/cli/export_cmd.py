"""``ckrun export RUN_DIR --format dcp -o OUT``: a run's checkpoint as a
torch.distributed.checkpoint directory (issue 14; :mod:`ckrun.checkpoint.dcp_interop`).

Exit codes: 0 written; 2 bad usage (no such run or step, unknown format, ``OUT`` not an
empty directory); 5 the checkpoint is corrupt or storage failed.
"""

from __future__ import annotations

import click
from ckrun.errors import CkrunError

#: formats this command writes (``safetensors``/``torch`` come with issue 13's exporter)
FORMATS = ("dcp",)


@click.command("export")
@click.argument("run_dir")
@click.option("--format", "fmt", required=True, type=click.Choice(FORMATS), help="Output format.")
@click.option("-o", "--output", "out", required=True, help="Output directory (new or empty).")
@click.option("--step", type=int, default=None, help="Checkpoint step [newest].")
@click.pass_context
def export(ctx: click.Context, run_dir: str, fmt: str, out: str, step: int | None) -> None:
    """Write RUN_DIR's checkpoint (newest, or --step) to OUT in --format."""
    import os

    from ckrun.checkpoint.dcp_interop import export_dcp
    from ckrun.errors import UsageError

    try:
        if "://" not in run_dir.removeprefix("file://") and not os.path.isdir(run_dir):
            raise UsageError(f"{run_dir}: no such run directory; pass the run root")
        m = export_dcp(run_dir, out, step=step)
    except CkrunError as e:
        click.echo(f"ckrun: error: {e}", err=True)
        ctx.exit(int(e.exit_code))
        return
    click.echo(f"exported step {m.step} ({m.kind}, {m.world_size} shard(s)) to {out} ({fmt})")
