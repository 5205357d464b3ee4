"""Fork server for the crash-consistency test (imports torch once, forks savers).

Reads commands on stdin, one per line: ``go RUN_DIR`` forks a saver that resumes from
RUN_DIR and saves step after step forever, printing ``saving N`` as each save begins and
``committed N`` after it returns (the test times its kills from these lines, so they
land in the start-up or inside a save however slow the machine is); the zygote prints
``started PID`` and, once the test has SIGKILLed the saver, ``reaped PID STATUS``.
Forking keeps each trial at a few milliseconds instead of the 1.5 s of ``import torch``.
``CRASH_ZYGOTE_STARTUP_S`` (seconds, default 0) lengthens each saver's start-up, as a
loaded machine would.
"""

from __future__ import annotations

import os
import sys
import time

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
    time.sleep(float(os.environ.get("CRASH_ZYGOTE_STARTUP_S", "0")))  # a slow machine
    ck = ckrun.Checkpointer(storage=run_dir, keep_last=2, milestone_every=25, rng=False)
    state = {
        "w": torch.zeros(SIZE),
        "b": torch.zeros(SIZE, dtype=torch.int64),
        "extra": {"step": -1},
    }
    m = ck.load(state)
    step = m.step + 1 if m else 0
    while True:
        data = state_for(step)
        os.write(1, f"saving {step}\n".encode())
        ck.save(step, data)
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
