"""Child process of the async kill tests (SIGKILLed by the test while it persists).

Usage: python async_saver.py RUN_DIR stall|loop|plain
    stall: async_save step 1 and wait for it (prints ``durable 1``), change the state,
        async_save step 2 (``returned 2``) through a disk that stops answering after
        40 MiB of the shard (``stalled``), then wait to be killed.
    plain: as stall up to ``returned 2``, on the plain local storage (the zero-copy
        O_DIRECT writer of the host buffers), then wait to be killed.
    loop: async_save steps 0, 1, 2, ... forever, printing ``durable N`` once the save of
        step N is known committed (the next save drained it).
The state of step N is ``w = N`` (16 Mi float32 = 64 MiB) and ``extra.step = N``.
"""

from __future__ import annotations

import os
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import ckrun  # noqa: E402
import torch  # noqa: E402
from async_helpers import GatedStorage  # noqa: E402

N = 16 << 20


def main() -> None:
    run_dir, mode = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    st = GatedStorage(run_dir)
    ck = ckrun.Checkpointer(storage=run_dir if mode == "plain" else st, rng=False, keep_last=2)
    w, extra = torch.zeros(N), {"step": -1}
    state = {"w": w, "extra": extra}
    m = ck.load(state)
    step = m.step + 1 if m else 0
    if mode in ("stall", "plain"):
        w.fill_(1.0)
        extra["step"] = 1
        ck.async_save(1, state).result()
        print("durable 1", flush=True)
        w.fill_(2.0)
        extra["step"] = 2
        st.stall_after = 40 << 20
        ck.async_save(2, state)
        print("returned 2", flush=True)
        if mode == "plain":
            threading.Event().wait()
        st.stalled.wait()
        print("stalled", flush=True)
        threading.Event().wait()
    while True:
        w.fill_(float(step))
        extra["step"] = step
        h = ck.async_save(step, state)  # drains the previous save first
        if step > 0:
            print(f"durable {step - 1}", flush=True)
        del h
        step += 1


if __name__ == "__main__":
    main()
