"""The ``ckrun`` command line's shared parameters: option decorators, their values, and
the parsing of ``submit``'s command (used by :mod:`ckrun.cli.main`).

The option names and forms are a contract (the forms in :mod:`ckrun.cli.main`'s
docstring): ``--storage``, ``--allow-change``, the own-checkpoint options
(``--checkpoint-path``, ``--resume-args``, ``--child-signal``), the backend options of
``submit`` (each the same as ``--set KEY=VALUE``) and ``--set`` itself.
"""

from __future__ import annotations

import difflib
import sys
from typing import Any

import click

#: ``ckrun run``: everything after the first positional is the command.
CMD_CONTEXT = {"ignore_unknown_options": True, "allow_interspersed_args": False}
#: ``ckrun submit``: ckrun's options may come before or after the script; unknown options
#: go to the script; after ``--`` everything is the script's (use it when a script option
#: has the name of a ckrun option, e.g. ``--storage``).
SUBMIT_CONTEXT = {"ignore_unknown_options": True, "allow_interspersed_args": True}


def command_argv(args: tuple[str, ...]) -> tuple[str, ...]:
    """``train.py ARGS`` → ``(sys.executable, train.py, ARGS)``; a ``--`` after it is dropped."""
    if not args:
        raise click.UsageError("no command given: `ckrun submit train.py` or `-- CMD ...`")
    rest = list(args[1:])
    if rest and rest[0] == "--":
        rest = rest[1:]
    if args[0].endswith(".py"):
        return (sys.executable, args[0], *rest)
    return (args[0], *rest)


def parse_settings(items: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise click.UsageError(f"--set {item!r}: expected KEY=VALUE")
        out[key.strip().replace("-", "_")] = value
    return out


def cli_values(**kw: Any) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if v is not None and v != ()}


storage_opt = click.option(
    "--storage",
    default=None,
    metavar="DIR",
    help="Storage base; the run root is DIR/RUN [./ckrun-runs].",
)
allow_opt = click.option(
    "--allow-change",
    "allow_change",
    multiple=True,
    metavar="FIELD",
    help="Compat field allowed to differ on resume (repeatable).",
)


def own_checkpoint_options(f: Any) -> Any:
    """``--checkpoint-path``, ``--resume-args``, ``--child-signal`` (issue 15)."""
    f = click.option(
        "--child-signal",
        default=None,
        metavar="SIG",
        help="Own-checkpoint mode: the signal the script handles for a notice [SIGTERM].",
    )(f)
    f = click.option(
        "--resume-args",
        default=None,
        metavar="ARGS",
        help="Own-checkpoint mode: arguments appended when a checkpoint was restored.",
    )(f)
    return click.option(
        "--checkpoint-path",
        "checkpoint_paths",
        multiple=True,
        metavar="FILE",
        help="A checkpoint file the script writes itself (repeatable): ckrun commits each "
        "new version and restores the newest before every restart.",
    )(f)


def own_checkpoint_values(
    checkpoint_paths: tuple[str, ...], resume_args: str | None, child_signal: str | None
) -> dict[str, Any]:
    import shlex

    return cli_values(
        checkpoint_paths=checkpoint_paths,
        resume_args=tuple(shlex.split(resume_args)) if resume_args else None,
        child_signal=child_signal,
    )


#: Backend options of ``submit`` (a contract, as the forms above): flag, profile key,
#: type, help.  Each is the same as ``--set KEY=VALUE``; a key the selected backend does
#: not have is refused by the config with the list of valid keys.
BACKEND_OPTIONS: list[tuple[str, str, Any, str]] = [
    ("--partition", "partition", str, "Slurm partition."),
    ("--time", "time", str, "Slurm time limit, e.g. 4:00:00."),
    ("--nodes", "nodes", int, "Slurm nodes."),
    ("--gpus-per-node", "gpus_per_node", int, "Slurm GPUs per node."),
    ("--account", "account", str, "Slurm account."),
    ("--qos", "qos", str, "Slurm QOS."),
    ("--image", "image", str, "Kubernetes container image."),
    ("--namespace", "namespace", str, "Kubernetes namespace."),
    ("--gpus", "gpus", int, "Kubernetes GPUs per pod."),
]


def backend_options(f: Any) -> Any:
    for flag, key, typ, text in reversed(BACKEND_OPTIONS):
        f = click.option(flag, key, type=typ, default=None, help=text)(f)
    return f


class SubmitCommand(click.Command):
    """``submit``: an unknown option before ``--`` is refused (with click's "did you
    mean" suggestion) instead of going to the script, when a ``--`` marks where the
    script's arguments start; without ``--`` it goes to the script as before, with a
    note when it looks like a misspelled ckrun option."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        known = sorted(
            {
                o
                for p in self.params
                if isinstance(p, click.Option)
                for o in p.opts + p.secondary_opts
            }
        )
        dashdash = "--" in args
        before = args[: args.index("--")] if dashdash else args
        for token in before:
            if not token.startswith("--") or token == "--":
                continue
            name = token.split("=", 1)[0]
            if name in known:
                continue
            if dashdash:
                close = difflib.get_close_matches(name, known, n=1)
                raise click.NoSuchOption(name, possibilities=close, ctx=ctx)
            # without `--` the option is the script's (`train.py --steps 600`): only a
            # near-exact ckrun option name earns a note
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
            if close:
                click.echo(
                    f"[ckrun] note: {name} is not a ckrun option and goes to the script "
                    f"(did you mean {' or '.join(close)}?); put the script's arguments "
                    "after `--` to have ckrun check its own",
                    err=True,
                )
        return super().parse_args(ctx, args)
