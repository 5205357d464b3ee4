"""Fork server for the crash-consistency test (imports torch once, forks savers).

Reads commands on stdin, one per line: ``go RUN_DIR`` forks a saver that resumes from
RUN_DIR and saves step after step forever, printing ``committed N`` after each save
returns; the zygote prints ``started PID`` and, once the test has SIGKILLed the saver,
``reaped PID STATUS``.  Forking keeps each trial at a few milliseconds instead of the
1.5 s of ``import torch``.
"""

from __future__ import annotations

import os
import sys

import ckrun
import torch

SIZE = 64 * 1024  # float32 elements per tensor: 256 KiB, x2 tensors


def state_for(step: int) -> dict[str, object]:
    return {
        "w": torch.full((SIZE,), float(step)),
        "b": torch.arange(SIZE) + step,
        "extra": {"step": step},
    }


def saver(run_dir: str) -> None:
    ck = ckrun.Checkpointer(storage=run_dir, keep_last=2, milestone_every=25, rng=False)
    state = {
        "w": torch.zeros(SIZE),
        "b": torch.zeros(SIZE, dtype=torch.int64),
        "extra": {"step": -1},
    }
    m = ck.load(state)
    step = m.step + 1 if m else 0
    while True:
        ck.save(step, state_for(step))
        os.write(1, f"committed {step}\n".encode())
        step += 1


def main() -> None:
    torch.set_num_threads(1)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd != "go":
            break
        pid = os.fork()
        if pid == 0:
            try:
                saver(arg)
            finally:
                os._exit(1)
        print(f"started {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"reaped {pid} {status}", flush=True)


if __name__ == "__main__":
    main()
