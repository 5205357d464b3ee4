"""A tiny GPT-2 trained with the Hugging Face Trainer under ckrun (issue 15).

The model is built from a config (no download); the data are synthetic sequences from a
fixed generator (a noisy counting task), shuffled by the Trainer's own
``DataLoader(shuffle=True)``.  ckrun needs two lines: the callback and the resume line::

    ckrun submit examples/train_hf.py --chaos-preempt-every 20s -- --steps 60

Under ``ckrun submit --nproc-per-node 2`` (torchrun) it trains with DDP over gloo.

Options: ``--steps`` (optimizer steps), ``--out`` (the Trainer's output_dir, default
``$CKRUN_STORAGE/hf-out`` under the supervisor, else ``hf-out``), ``--no-ckrun`` (train
without the integration: check-resume then fails, as it should), ``--ignore-data-skip``
(a broken resume for the tests: the data position is not restored).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


class Counting(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``n`` sequences of ``length`` tokens: a start token, then counting up mod ``vocab``."""

    def __init__(self, n: int = 256, length: int = 16, vocab: int = 64) -> None:
        g = torch.Generator().manual_seed(1234)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        self.x = (start + torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class Pace(TrainerCallback):
    """Sleep after every step (a stand-in for a bigger model, for preemption demos)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args: object, state: object, control: object, **kw: object) -> None:
        time.sleep(self.seconds)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", default=None)
    p.add_argument("--save-steps", type=int, default=20)
    p.add_argument("--no-ckrun", action="store_true")
    p.add_argument("--step-seconds", type=float, default=0.0, help="pace: sleep per step")
    p.add_argument(
        "--ignore-data-skip",
        action="store_true",
        help="a deliberately broken resume: the Trainer does not skip consumed batches",
    )
    a = p.parse_args()
    out = a.out or os.path.join(os.environ.get("CKRUN_STORAGE", "."), "hf-out")
    torch.set_num_threads(1)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    args = TrainingArguments(
        output_dir=out,
        max_steps=a.steps,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=5,
        weight_decay=0.01,
        save_strategy="steps",
        save_steps=a.save_steps,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        ignore_data_skip=a.ignore_data_skip,
        # under torchrun (``ckrun submit --nproc-per-node 2``): DDP over gloo on CPU
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)  # dropout 0.1: every step draws from the torch RNG
    pace = [Pace(a.step_seconds)] if a.step_seconds else []
    if a.no_ckrun:
        trainer = Trainer(model=model, args=args, train_dataset=Counting(), callbacks=pace)
        trainer.train()
        return
    from ckrun.integrations.hf import CkrunCallback, resume_checkpoint

    trainer = Trainer(
        model=model, args=args, train_dataset=Counting(), callbacks=[CkrunCallback(), *pace]
    )
    trainer.train(resume_from_checkpoint=resume_checkpoint(args.output_dir))


if __name__ == "__main__":
    try:
        main()  # returns, or raises SystemExit(75) after a preemption save
    finally:
        if torch.distributed.is_initialized():  # gloo's threads must not outlive the
            torch.distributed.destroy_process_group()  # interpreter (an abort at exit)
