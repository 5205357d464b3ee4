"""The ``ckrun`` command line (click).  Thin: parsing, then calls into the library.

Forms (a contract: scripts and docs rely on them)::

    ckrun submit train.py [ARGS]...          # .py runs with this Python
    ckrun submit [OPTIONS] -- CMD [ARGS]...
    ckrun run --run NAME [--storage DIR] [--allow-change F] -- CMD...
    ckrun status NAME [--storage DIR] [--json] [--html FILE] [--watch]
    ckrun runs [--storage DIR] | ckrun logs NAME [-f]
    ckrun cancel NAME | ckrun preempt NAME | ckrun config [--profile P]
    ckrun ls ... | ckrun verify ...          # from ckrun.cli.checkpoints when installed

Every :class:`~ckrun.errors.CkrunError` is printed as ``ckrun: error: ...`` and mapped
to its exit code (DESIGN.md §3).  Heavy imports stay lazy: ``ckrun --help`` and
``ckrun run`` do not import torch.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

import click
from ckrun.cli.params import (
    CMD_CONTEXT,
    SUBMIT_CONTEXT,
    SubmitCommand,
    allow_opt,
    backend_options,
    cli_values,
    command_argv,
    own_checkpoint_options,
    own_checkpoint_values,
    parse_settings,
    storage_opt,
)
from ckrun.errors import STORAGE_ERRNOS, CkrunError, ExitCode, IncompatibleCheckpoint, map_os_error

#: Commands written elsewhere: name -> (module, attribute).  Imported only when the
#: command is invoked or help is listed, so ``ckrun run`` does not pay for them.
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "ls": ("ckrun.cli.checkpoints", "ls"),
    "verify": ("ckrun.cli.checkpoints", "verify"),
    "export": ("ckrun.cli.checkpoints", "export"),
    "check-resume": ("ckrun.cli.check_resume", "check_resume"),
    "runs": ("ckrun.cli.runs", "runs"),
    "logs": ("ckrun.cli.runs", "logs"),
}


def _lazy(name: str) -> click.Command | None:
    module, attr = LAZY_COMMANDS[name]
    cmd = getattr(importlib.import_module(module), attr, None)
    return cmd if isinstance(cmd, click.Command) else None


class _Group(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        names = set(super().list_commands(ctx))
        names.update(n for n in LAZY_COMMANDS if self.get_command(ctx, n) is not None)
        return sorted(names)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        cmd = super().get_command(ctx, cmd_name)
        if cmd is None and cmd_name in LAZY_COMMANDS:
            cmd = _lazy(cmd_name)
        return cmd


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ckrun", prog_name="ckrun")
def main_group() -> None:
    """ckrun: keep long ML training runs alive on preemptible capacity."""


@main_group.command(cls=SubmitCommand, context_settings=SUBMIT_CONTEXT)
@click.option("--profile", default="local", show_default=True, help="Profile name.")
@click.option("--run", "run_name", default=None, help="Run name [script name + UTC time].")
@storage_opt
@click.option("--detach", is_flag=True, help="Return at once; supervisor output to a log.")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print only the job (sbatch script, Job YAML, command line) on stdout; start nothing.",
)
@click.option(
    "--show-config",
    is_flag=True,
    help="With --dry-run: print the resolved configuration (JSON) before the job.",
)
@click.option("--max-requeues", type=int, default=None, help="Preemptions allowed.")
@click.option("--max-failures", type=int, default=None, help="Failures allowed.")
@click.option("--grace", default=None, metavar="S", help="Notice → exit limit (seconds).")
@allow_opt
@click.option(
    "--chaos-preempt-every",
    default=None,
    metavar="DURATION",
    help="Local profile: a drill notice every DURATION of child runtime (20s).",
)
@click.option(
    "--nproc-per-node",
    "nproc_per_node",
    type=int,
    default=None,
    metavar="N",
    help="Processes per node: run the command under torchrun [1].",
)
@click.option(
    "--nnodes",
    type=int,
    default=None,
    metavar="M",
    help="Nodes (one supervisor each; MASTER_ADDR required) [1].",
)
@click.option(
    "--set",
    "settings",
    multiple=True,
    metavar="KEY=VALUE",
    help="Any profile key, e.g. --set image=IMG --set partition=gpu (repeatable).",
)
@backend_options
@own_checkpoint_options
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def submit(
    profile: str,
    run_name: str | None,
    storage: str | None,
    detach: bool,
    dry_run: bool,
    show_config: bool,
    max_requeues: int | None,
    max_failures: int | None,
    grace: str | None,
    allow_change: tuple[str, ...],
    chaos_preempt_every: str | None,
    settings: tuple[str, ...],
    args: tuple[str, ...],
    checkpoint_paths: tuple[str, ...],
    resume_args: str | None,
    child_signal: str | None,
    **backend: Any,
) -> int:
    """Submit a training command: `ckrun submit train.py [ARGS]...` or `-- CMD [ARGS]...`.

    ckrun's options may come before or after the script; the script's own arguments go
    after `--` (e.g. `ckrun submit train.py --run r1 -- --steps 600`)."""
    from ckrun.cli import commands as launch

    cli = parse_settings(settings)
    cli.update(
        cli_values(
            storage=storage,
            max_requeues=max_requeues,
            max_failures=max_failures,
            grace_s=grace,
            allow_change=allow_change,
            chaos_preempt_every=chaos_preempt_every,
        )
    )
    cli.update(cli_values(**backend))
    cli.update(own_checkpoint_values(checkpoint_paths, resume_args, child_signal))
    return int(
        launch.submit(
            profile,
            cli,
            command_argv(args),
            run_name,
            detach=detach,
            dry_run=dry_run,
            show_config=show_config,
        )
    )


@main_group.command(context_settings=CMD_CONTEXT)
@click.option("--run", "run_name", required=True, help="Run name.")
@storage_opt
@allow_opt
@click.option("--profile", default=None, help="Profile when the run has no run.json yet.")
@click.option(
    "--scheduler",
    default=None,
    help="Backend for requeue [autodetect: SLURM_JOB_ID, KUBERNETES_SERVICE_HOST].",
)
@own_checkpoint_options
@click.option(
    "--wait-for-lease",
    "wait_for_lease",
    default=None,
    metavar="S",
    help="Wait up to S seconds for another owner's lease to end, else exit 2 "
    "[2 x lease_ttl_s for a cloud profile or a requeued job, else 0].",
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(
    run_name: str,
    storage: str | None,
    allow_change: tuple[str, ...],
    profile: str | None,
    scheduler: str | None,
    wait_for_lease: str | None,
    args: tuple[str, ...],
    checkpoint_paths: tuple[str, ...],
    resume_args: str | None,
    child_signal: str | None,
) -> int:
    """Supervise a run in this process (what Slurm, Kubernetes and boot scripts call)."""
    from ckrun.cli import commands as launch

    cmd = command_argv(args) if args else ()
    cli = cli_values(storage=storage, allow_change=allow_change, wait_for_lease_s=wait_for_lease)
    cli.update(own_checkpoint_values(checkpoint_paths, resume_args, child_signal))
    return int(launch.run(run_name, cli, cmd, profile=profile, scheduler=scheduler))


@main_group.command()
@click.argument("name")
@storage_opt
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (numbers).")
@click.option(
    "--html",
    "html_file",
    default=None,
    metavar="FILE",
    help="Also write the timeline page (self-contained HTML) to FILE.",
)
@click.option("--watch", is_flag=True, help="Refresh until the run stops (Ctrl-C to leave).")
@click.option(
    "--every", default="2s", show_default=True, metavar="S", help="Refresh period of --watch."
)
def status(
    name: str, storage: str | None, as_json: bool, html_file: str | None, watch: bool, every: str
) -> int:
    """State, attempts, preemptions, lost work, save time and goodput of run NAME."""
    from ckrun.cli import status as runstatus
    from ckrun.config import parse_duration

    period = parse_duration(every)
    if period <= 0:
        raise click.BadParameter("must be > 0 seconds", param_hint="--every")
    rd = runstatus.locate(name, storage)
    if watch:
        runstatus.watch(rd, period, as_json=as_json, html_file=html_file)
    else:
        runstatus.show(rd, as_json=as_json, html_file=html_file)
    return 0


@main_group.command()
@click.argument("name")
@storage_opt
def cancel(name: str, storage: str | None) -> int:
    """Stop run NAME for good (the child checkpoints first); later starts refuse to run."""
    from ckrun.cli import commands as launch

    click.echo(launch.cancel(name, storage))
    return 0


@main_group.command()
@click.argument("name")
@storage_opt
@click.option("--lead", default=None, metavar="S", help="Notice lead time [grace].")
def preempt(name: str, storage: str | None, lead: str | None) -> int:
    """Deliver a drill notice to run NAME's live supervisor (test the resume path)."""
    from ckrun.cli import commands as launch
    from ckrun.config import parse_duration

    click.echo(launch.preempt(name, storage, parse_duration(lead) if lead else None))
    return 0


@main_group.command(name="config")
@click.option("--profile", default="local", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def config_cmd(profile: str, as_json: bool) -> int:
    """Resolved configuration values and where each came from."""
    import json

    from ckrun.config import resolve

    cfg = resolve(profile)
    body = {
        k: v
        for k, v in cfg.to_json().items()
        if k not in ("run", "command", "sources", "launch_hash", "options", "cloud")
    }
    body.update(cfg.to_json()["options"])
    body.update(cfg.cloud)
    if as_json:
        click.echo(
            json.dumps(
                {k: {"value": v, "source": cfg.sources.get(k, "default")} for k, v in body.items()},
                indent=1,
            )
        )
        return 0
    width = max(len(k) for k in body)
    for k, v in body.items():
        click.echo(f"{k:<{width}}  {v!s:<24} {cfg.sources.get(k, 'default')}")
    from ckrun.supervisor.loop import policy_of

    click.echo("")
    for line in policy_of(cfg).describe():
        click.echo(f"# {line}")
    return 0


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the group, map errors to exit codes (never returns)."""
    logging.basicConfig(level=logging.WARNING, format="[ckrun] %(levelname)s %(message)s")
    try:
        rv = main_group.main(argv, prog_name="ckrun", standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(ExitCode.CHILD_FAILED)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except IncompatibleCheckpoint as e:
        click.echo(f"ckrun: error: {e}", err=True)
        for line in e.diff:
            click.echo(f"  {line}", err=True)
        sys.exit(int(e.exit_code))
    except CkrunError as e:
        click.echo(f"ckrun: error: {e}", err=True)
        sys.exit(int(e.exit_code))
    except OSError as e:
        if e.errno not in STORAGE_ERRNOS:
            raise
        err = map_os_error(e, path=e.filename or "the run's storage or state directory")
        click.echo(f"ckrun: error: {err}", err=True)
        sys.exit(int(err.exit_code))
    sys.exit(int(rv) if isinstance(rv, int) else 0)


if __name__ == "__main__":  # python -m ckrun.cli (the detached local supervisor)
    main()
