"""A small training loop run under ``ckrun run`` as PID 1 (tests/k8s/test_k8s_pid1.py).

It resumes with :meth:`ckrun.Checkpointer.from_env`, prints ``step N`` per step, checks
:func:`ckrun.preemption_requested` at every step boundary, saves and exits 75 on a
notice, and finalizes at the last step.

``--orphans N``: first leave N daemonized grandchildren behind (double fork + setsid, so
they are re-parented to PID 1 -- ckrun -- and are outside the child's session); each
runs ``sleep ORPHAN_S`` under an ``argv[0]`` of ``ckrun-test-orphan`` and then exits,
so a PID 1 that does not reap would keep their zombies.  ``--ignore-notice``: never
checks for a notice (the supervisor must stop it before the kubelet's SIGKILL).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import ckrun
import torch


def leave_orphans(n: int, sleep_s: float) -> None:
    """Double-fork ``n`` daemons that exit after ``sleep_s`` seconds."""
    for _ in range(n):
        pid = os.fork()
        if pid == 0:  # first child: new session, fork the daemon, exit at once
            os.setsid()
            if os.fork() == 0:
                os.execvp("sleep", ["ckrun-test-orphan", str(sleep_s)])
            os._exit(0)
        os.waitpid(pid, 0)  # reap the first child: the daemon is now an orphan


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--step-s", type=float, default=0.05)
    ap.add_argument("--orphans", type=int, default=0)
    ap.add_argument("--orphan-s", type=float, default=1.0)
    ap.add_argument("--ignore-notice", action="store_true")
    a = ap.parse_args()

    ckpt = ckrun.Checkpointer.from_env(compat={"config": {"steps": a.steps}}, rng=False)
    state = {"w": torch.zeros(4, dtype=torch.float64), "step": 0}
    m = ckpt.load(state)
    start = int(state["step"]) if m is not None else 0
    print(f"resumed {m.step if m else None} pid {os.getpid()}", flush=True)
    leave_orphans(a.orphans, a.orphan_s)
    for step in range(start, a.steps):
        if not a.ignore_notice and ckrun.preemption_requested():
            ckpt.save(step, state)
            print(f"saved {step} on notice", flush=True)
            return 75
        state["w"] = state["w"] * 0.5 + float(step)
        state["step"] = step + 1
        print(f"step {step + 1}", flush=True)
        time.sleep(a.step_s)
    ckpt.finalize(a.steps, state)
    print("done", float(state["w"].sum()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
