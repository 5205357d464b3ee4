"""Lightning's own ModelCheckpoint saves are ckrun commits (issue 15, left over).

In-process Lightning runs on CPU with the example's tiny model: a run with a
``ModelCheckpoint`` and ckrun's callback (no periodic saves of its own) is stopped hard
after a ModelCheckpoint save; the file Lightning was writing next is left half-written.
The restart resumes from ckrun's newest verified commit (the ModelCheckpoint save) and
ends with the uninterrupted run's weights, bit for bit.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from ckrun.checkpoint import fileset  # noqa: E402
from ckrun.checkpoint.discovery import committed  # noqa: E402
from ckrun.storage import open_storage  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_lightning import Regressor, dataset  # noqa: E402

STEPS = 10


class Killed(Exception):
    """Stands for the SIGKILL of a node lost without notice."""


class KillAt(pl.Callback):  # type: ignore[misc]
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
        if trainer.global_step == self.step:
            raise Killed(f"killed at step {self.step}")


def _fit(root: Path, run: Path, *extra: Any, ckpt_path: str | None = None) -> Any:
    from ckrun.integrations.lightning import CkrunCallback

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = Regressor()
    loader = torch.utils.data.DataLoader(dataset(), batch_size=8, shuffle=True)
    mc = pl.callbacks.ModelCheckpoint(
        dirpath=str(root / "mc"), every_n_train_steps=3, save_top_k=-1, save_last=True
    )
    trainer = pl.Trainer(
        max_steps=STEPS,
        default_root_dir=str(root),
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        callbacks=[CkrunCallback(storage=str(run)), mc, *extra],
    )
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return model


def test_model_checkpoint_saves_are_committed_and_resume_exactly(tmp_path: Path) -> None:
    from ckrun.integrations.lightning import resume_checkpoint

    ref = _fit(tmp_path / "ref", tmp_path / "ref-run")
    st = open_storage(str(tmp_path / "ref-run"))
    steps = sorted((m.step, str(m.kind)) for m in committed(st))
    # ModelCheckpoint's saves (last.ckpt of the same step is not a second commit) + final
    assert steps == [(3, "recovery"), (6, "recovery"), (9, "recovery"), (10, "final")]

    root, run = tmp_path / "cut", tmp_path / "cut-run"
    with pytest.raises(Killed):
        _fit(root, run, KillAt(8))  # after ModelCheckpoint's save of step 6
    st = open_storage(str(run))
    assert [m.step for m in committed(st)] == [6, 3]
    fs = fileset.newest(st, prefix="lightning/")
    assert fs is not None and list(fs.files) == ["lightning/epoch=0-step=6.ckpt"]
    # the kill came while Lightning rewrote its newest file: half of it is on disk
    newest = root / "mc" / "epoch=0-step=6.ckpt"
    os.truncate(newest, os.path.getsize(newest) // 2)

    path = resume_checkpoint(str(root / "mc"), storage=str(run))
    assert path == str(newest)
    assert torch.load(path, weights_only=True)["global_step"] == 6  # the verified one
    got = _fit(root, run, ckpt_path=path)
    for (name, a), b in zip(ref.state_dict().items(), got.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # bitwise: same batches, same RNG, same steps
    assert max(m.step for m in committed(st)) == STEPS


def test_weights_only_saves_are_not_committed(tmp_path: Path) -> None:
    from ckrun.integrations.lightning import CkrunCallback

    pl.seed_everything(0, verbose=False)
    mc = pl.callbacks.ModelCheckpoint(
        dirpath=str(tmp_path / "mc"), every_n_train_steps=2, save_weights_only=True
    )
    trainer = pl.Trainer(
        max_steps=4,
        default_root_dir=str(tmp_path),
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[CkrunCallback(storage=str(tmp_path / "run")), mc],
    )
    trainer.fit(Regressor(), torch.utils.data.DataLoader(dataset(), batch_size=8))
    ms = committed(open_storage(str(tmp_path / "run")))
    assert [(m.step, m.kind) for m in ms] == [(4, "final")]
    assert os.listdir(tmp_path / "mc")  # Lightning's own files are still written
