"""A tiny model trained with PyTorch Lightning under ckrun (issue 15).

A two-layer MLP with dropout learns a fixed random linear map from synthetic data; the
loader is the plain ``DataLoader(dataset, shuffle=True)`` people write.  ckrun needs one
callback and the resume line::

    ckrun submit examples/train_lightning.py --chaos-preempt-every 20s -- --steps 80

Under ``ckrun submit --nproc-per-node 2`` (torchrun) it trains with DDP (gloo on CPU).

Options: ``--steps`` (optimizer steps; 4 epochs of 16 batches by default), ``--root``
(Lightning's ``default_root_dir``, default ``$CKRUN_STORAGE/pl`` under the supervisor),
``--no-ckrun`` (no integration: check-resume then fails, as it should),
``--no-data-position`` (a broken resume for the tests: the loader restarts its epoch).
"""

from __future__ import annotations

import argparse
import os
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(pl.LightningModule):
    def __init__(
        self, d_in: int = 8, hidden: int = 32, lr: float = 0.01, step_seconds: float = 0.0
    ) -> None:
        super().__init__()
        self.step_seconds = step_seconds  # pace, a stand-in for a bigger model
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 1)
        )
        self.lr = lr

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        if self.step_seconds:
            time.sleep(self.step_seconds)
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> object:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def dataset(n: int = 128, d: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--root", default=None)
    p.add_argument("--no-ckrun", action="store_true")
    p.add_argument("--step-seconds", type=float, default=0.0, help="pace: sleep per step")
    p.add_argument(
        "--no-data-position",
        action="store_true",
        help="a deliberately broken resume: the loader's position is not restored",
    )
    a = p.parse_args()
    root = a.root or os.path.join(os.environ.get("CKRUN_STORAGE", "."), "pl")
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = Regressor(step_seconds=a.step_seconds)
    loader = DataLoader(dataset(), batch_size=8, shuffle=True)
    kw: dict[str, object] = dict(
        max_steps=a.steps,
        default_root_dir=root,
        accelerator="cpu",
        # under torchrun (``ckrun submit --nproc-per-node 2``): one DDP process per rank
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "auto",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    if a.no_ckrun:
        pl.Trainer(**kw).fit(model, loader)  # type: ignore[arg-type]
        return
    from ckrun.integrations.lightning import CkrunCallback, resume_checkpoint

    trainer = pl.Trainer(callbacks=[CkrunCallback(data_position=not a.no_data_position)], **kw)  # type: ignore[arg-type]
    trainer.fit(model, loader, ckpt_path=resume_checkpoint(os.path.join(root, "ckrun")))


if __name__ == "__main__":
    try:
        main()  # returns, or raises SystemExit(75) after a preemption save
    finally:
        if torch.distributed.is_initialized():  # gloo's threads must not outlive the
            torch.distributed.destroy_process_group()  # interpreter (an abort at exit)
