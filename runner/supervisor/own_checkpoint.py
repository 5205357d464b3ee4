"""The supervisor's side of own-checkpoint mode (``checkpoint_paths``): a script that writes
its own checkpoint files, which the supervisor commits, restores and drills.

The file mechanics (versions, validation, commit to storage, restore) are
:class:`ckrun.supervisor.watched.WatchedFiles`; here are the three moments the loop
acts on them: every round while the child runs (commit a finished new version), after
the child's exit (commit the last trustworthy version, say what was lost), and before a
start (restore the newest verified version and append the script's resume arguments).
A failed commit never stops the run: the last committed version stands.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ckrun.config import RunConfig
from ckrun.errors import CkrunError
from ckrun.storage.base import Storage
from ckrun.supervisor.watched import WatchedFiles


def watched_files(cfg: RunConfig, storage: Storage) -> WatchedFiles:
    """The run's own-checkpoint files (``cfg.checkpoint_paths``), committed to ``storage``
    under the run's launch hash."""
    paths = tuple(cfg.checkpoint_paths)
    return WatchedFiles(paths, storage, cfg.run, compat={"launch_hash": cfg.launch_hash()})


def commit_new_version(
    w: WatchedFiles,
    members: Sequence[int],
    say: Callable[[str], None],
    append: Callable[..., None],
) -> bool:
    """Commit a finished new version of the files (``members``: the child's processes,
    to tell a file still open for writing); True when a drill notice is due now."""
    try:
        step = w.poll(list(members))
    except CkrunError as e:  # the last committed version stands; retried next round
        say(f"warning: own checkpoint not committed: {e}")
        return False
    if step is None:
        return False
    append("own_checkpoint", step=step, message="new version committed")
    return w.drill_due()


def commit_after_exit(
    w: WatchedFiles, status: int, notice_at: float | None, say: Callable[[str], None]
) -> None:
    """After the child's exit ``status``: commit the last trustworthy version and say
    what was lost (``notice_at``: monotonic seconds of the notice, None without one)."""
    try:
        w.after_exit(status, notice_at)
    except CkrunError as e:
        say(f"warning: own checkpoint not committed: {e}")
    lost = w.lost_report(status, notice_at)
    if lost:
        say(lost)


def restore_command(
    w: WatchedFiles | None,
    attempt: int,
    command: tuple[str, ...],
    resume_args: Sequence[str],
    say: Callable[[str], None],
) -> tuple[str, ...]:
    """The command of ``attempt``: restore the newest verified version of the script's
    files and append ``resume_args`` when there was one to restore."""
    if w is None or w.restore(attempt) is None:
        return command
    say(f"restored {', '.join(w.paths)} (version {w.last.step if w.last else '?'})")
    return (*command, *resume_args)
