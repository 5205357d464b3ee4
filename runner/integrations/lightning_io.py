"""Every full checkpoint Lightning writes becomes a ckrun commit (issue 15).

Lightning routes each checkpoint file through its strategy's ``CheckpointIO``
(``Trainer.save_checkpoint`` -> ``Strategy.save_checkpoint``, which calls
``checkpoint_io.save_checkpoint`` on global rank 0 only) -- ``ModelCheckpoint``'s saves,
a user's own ``trainer.save_checkpoint`` calls and :class:`CkrunCallback`'s saves alike
(sources: Lightning 2.6 ``CheckpointIO``, ``Strategy.checkpoint_io``,
``ModelCheckpoint._save_checkpoint``).  :class:`CkrunCheckpointIO` wraps the strategy's
plugin: the file is written by the wrapped plugin as before (same path, same format),
then committed as a ckrun file set (:mod:`ckrun.checkpoint.fileset`: streamed,
checksummed, manifest last, ckrun's retention).  A kill while Lightning writes a
``.ckpt`` therefore never makes that file what a restart sees:
:func:`ckrun.integrations.lightning.resume_checkpoint` restores the newest *verified*
commit, whoever saved it.

Not committed (logged once each): weights-only checkpoints (``save_weights_only=True``:
no optimizer or loop state, a resume from them is not a resume), files not on the local
file system (a remote ``dirpath``), and saves through an asynchronous plugin
(``AsyncCheckpointIO`` returns before the file is complete; it is left unwrapped).
``ModelCheckpoint``'s removals of its old files touch Lightning's files only: ckrun's
commits follow ckrun's own retention.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ckrun.integrations.common import commit
from ckrun.storage.base import Storage
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import AsyncCheckpointIO

log = logging.getLogger(__name__)

PREFIX = "lightning/"


class CkrunCheckpointIO(CheckpointIO):
    """Write through ``inner``, then commit the file with ckrun (module docstring).

    Args:
        inner: the plugin that writes the file (the strategy's own).
        storage: the run root.
        keep_last: ckrun's retention of committed recovery checkpoints (>= 1).

    Attributes:
        kind: the manifest kind of the next commits (``"final"`` while the final
            artifact is saved).
        resumed_from: the step this attempt resumed from (protected from retention).
    """

    def __init__(self, inner: CheckpointIO, storage: Storage, keep_last: int = 3) -> None:
        self.inner, self.storage, self.keep_last = inner, storage, keep_last
        self.kind = "recovery"
        self.resumed_from: int | None = None
        self.committed: tuple[str, int] | None = None  # (kind, step) of the last commit
        self._told: set[str] = set()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        """Save with the wrapped plugin, then commit the file as step
        ``checkpoint["global_step"]`` (raises what the plugin or the commit raises:
        a failed commit leaves the previous commit the newest)."""
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
        p = os.fspath(path)
        if "optimizer_states" not in checkpoint or "loops" not in checkpoint:
            self._once("weights-only checkpoints are not committed (no state to resume from)")
            return
        if not os.path.isfile(p):
            self._once(f"{p} is not a local file: Lightning's saves there are not committed")
            return
        step = int(checkpoint.get("global_step", 0))
        if self.committed == (self.kind, step):
            return  # the same step again (ModelCheckpoint's last.ckpt beside its top-k)
        m = commit(
            self.storage,
            step,
            {PREFIX + os.path.basename(p): p},
            kind=self.kind,
            keep_last=self.keep_last,
            resumed_from=self.resumed_from,
        )
        if m is not None:
            self.committed = (self.kind, step)

    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The wrapped plugin's load."""
        return self.inner.load_checkpoint(
            path, map_location=map_location, weights_only=weights_only
        )

    def remove_checkpoint(self, path: _PATH) -> None:
        """The wrapped plugin's removal (ckrun's commits are not touched)."""
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        """The wrapped plugin's teardown."""
        self.inner.teardown()

    def _once(self, msg: str) -> None:
        if msg not in self._told:
            self._told.add(msg)
            log.warning(msg)


def install(strategy: Any, storage: Storage, keep_last: int) -> CkrunCheckpointIO | None:
    """Wrap ``strategy.checkpoint_io`` in a :class:`CkrunCheckpointIO` (idempotent).

    Returns:
        The plugin, or None when the strategy's plugin is asynchronous (left alone: its
        files are complete only later; the callback then commits its own saves itself).
    """
    cur = strategy.checkpoint_io
    if isinstance(cur, CkrunCheckpointIO):
        return cur
    if isinstance(cur, AsyncCheckpointIO):
        log.warning(
            "an asynchronous CheckpointIO is in use: only ckrun's own saves are committed, "
            "not ModelCheckpoint's"
        )
        return None
    io = CkrunCheckpointIO(cur, storage, keep_last)
    strategy.checkpoint_io = io
    return io
