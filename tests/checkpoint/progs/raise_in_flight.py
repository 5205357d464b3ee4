"""An uncaught ckrun error while an async save is in flight (issue 13, item 4).

``raise_in_flight.py RUN_DIR``: ``from_env`` (installs ckrun's excepthook), starts an
``async_save`` of step 1 whose shard writer is held until the excepthook runs, then
raises ``ckrun.StorageError``.  So the save is certainly in flight when the hook starts;
the process must still commit it before exiting with status 5.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import ckrun
import torch
from ckrun.storage.local import LocalStorage

GATE = threading.Event()


class HeldStorage(LocalStorage):
    """Shard writes wait until the excepthook has started."""

    def open_write(self, key: str, **kw: Any) -> Any:
        if "/shard-" in key:
            GATE.wait(60)
        return super().open_write(key, **kw)


def main() -> None:
    ck = ckrun.Checkpointer.from_env(storage=HeldStorage(sys.argv[1]), rng=False)
    hook = sys.excepthook

    def opening_the_gate(*a: Any) -> None:
        GATE.set()
        hook(*a)

    sys.excepthook = opening_the_gate
    ck.async_save(1, {"w": torch.arange(1000.0)})
    print("save in flight", flush=True)
    raise ckrun.StorageError("the dataset mount went away (raised by the training code)")


if __name__ == "__main__":
    main()
