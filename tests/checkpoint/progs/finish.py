"""Trains a tiny state to step 4 and finalizes it (issue 13, item 3).

``finish.py RUN_DIR [--die-before-marker]``: resumes from RUN_DIR, saves steps up to 4,
then ``finalize(4)``.  With ``--die-before-marker`` the process SIGKILLs itself at the
moment ``finalize`` is about to write ``COMPLETE.json``, i.e. after the final artifact's
manifest is committed: the window of a machine dying between the two.  The state counts
the process's restarts (``extra.starts``), as real scripts do, so a re-saved final
artifact differs from the committed one.  Prints ``finalized STEP`` on success.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import ckrun
import torch
from ckrun.checkpoint import layout


def main() -> int:
    run_dir = sys.argv[1]
    ck = ckrun.Checkpointer(storage=run_dir, rng=False)
    if "--die-before-marker" in sys.argv:
        put = ck.storage.put

        def put_or_die(key: str, data: Any, **kw: Any) -> Any:
            if key == layout.COMPLETE:
                os.kill(os.getpid(), signal.SIGKILL)
            return put(key, data, **kw)

        ck.storage.put = put_or_die  # type: ignore[method-assign]
    state: dict[str, Any] = {"w": torch.zeros(8), "extra": {"starts": 0}}
    m = ck.load(state)
    state["extra"]["starts"] += 1
    for step in range(m.step + 1 if m else 0, 5):
        state["w"] += 1
        ck.save(step, state)
    fin = ck.finalize(4, state)
    ck.close()
    print(f"finalized {fin.step} {state['w'][0].item()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
