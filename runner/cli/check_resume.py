"""``ckrun check-resume``: the command-line face of :mod:`ckrun.cli.resume_check`."""

from __future__ import annotations

import sys

import click
from ckrun.errors import UsageError


@click.command(
    name="check-resume",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option(
    "--interruptions",
    "-k",
    type=int,
    default=3,
    show_default=True,
    help="Preemptions at random steps in the interrupted run.",
)
@click.option("--seed", type=int, default=None, help="Seed for the steps (replay a failure).")
@click.option(
    "--workdir", default=None, metavar="DIR", help="Storage for both runs [a new temp dir, kept]."
)
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=3600.0,
    show_default=True,
    help="Limit for each run, in seconds.",
)
@click.option(
    "--edges",
    is_flag=True,
    help="Also drill at the first step, right after the first save, and at the last step.",
)
@click.option(
    "--checkpoint-path",
    "checkpoint_paths",
    multiple=True,
    metavar="FILE",
    help="Own-checkpoint mode (a script that saves FILE itself): drill after its saves.",
)
@click.option("--resume-args", default=None, metavar="ARGS", help="Own-checkpoint mode.")
@click.option("--child-signal", default=None, metavar="SIG", help="Own-checkpoint mode.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def check_resume(
    interruptions: int,
    seed: int | None,
    workdir: str | None,
    timeout_s: float,
    edges: bool,
    checkpoint_paths: tuple[str, ...],
    resume_args: str | None,
    child_signal: str | None,
    command: tuple[str, ...],
) -> int:
    """Run CMD uninterrupted and again with K preemptions at random steps, then compare
    the final checkpoints tensor by tensor: `ckrun check-resume -k 3 -- python train.py`.

    Prints PASS, or the first diverging entry (e.g. `user.optimizer.state.3.exp_avg
    differs: max abs diff 2e-07`) with the usual cause; exits 0 on PASS, 1 otherwise.
    """
    from ckrun.cli.resume_check import check_resume as run_check

    cmd = list(command[1:] if command[:1] == ("--",) else command)
    if not cmd:
        raise UsageError("check-resume needs a command: ckrun check-resume -- python train.py")
    if cmd[0].endswith(".py"):
        cmd.insert(0, sys.executable)
    if interruptions < 1:
        raise UsageError("--interruptions must be at least 1")
    own: list[str] = []
    for p in checkpoint_paths:
        own += ["--checkpoint-path", p]
    if resume_args:
        own += ["--resume-args", resume_args]
    if child_signal:
        own += ["--child-signal", child_signal]
    if (resume_args or child_signal) and not checkpoint_paths:
        raise UsageError("--resume-args and --child-signal need --checkpoint-path FILE")
    res = run_check(
        cmd,
        edges=edges,
        own_checkpoint=own,
        interruptions=interruptions,
        seed=seed,
        workdir=workdir,
        timeout_s=timeout_s,
        echo=click.echo,
    )
    for note in res.notes:
        click.echo(f"[ckrun] check-resume: note: {note}")
    if res.passed:
        click.echo(
            f"PASS: {res.compared} entries identical after {res.preemptions} "
            f"preemptions (steps {', '.join(map(str, res.interrupt_steps))})"
        )
        return 0
    d = res.divergence
    assert d is not None
    click.echo(f"FAIL: {d.path} differs: {d.detail}")
    click.echo(f"  likely cause: {d.hint}")
    click.echo(
        f"  replay: ckrun check-resume -k {interruptions} --seed {res.seed}"
        f"{' --edges' if edges else ''}{''.join(' ' + o for o in own)} -- {' '.join(command)}"
    )
    click.echo(f"  both runs are kept in {res.workdir}")
    return 1
