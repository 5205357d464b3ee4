"""Python ``random``'s state in a checkpoint (issue 19, small saves): saved as one tensor
leaf, restored exactly, and the tuple form older checkpoints hold still restores."""

from __future__ import annotations

import random
from pathlib import Path

import ckrun
import torch
from ckrun.checkpoint.state import rng_state, set_rng_state


def test_python_state_is_one_tensor_leaf() -> None:
    py = rng_state()["python"]
    version, words, gauss = py
    assert version == random.getstate()[0]
    assert isinstance(words, torch.Tensor) and words.dtype == torch.int64
    assert words.tolist() == list(random.getstate()[1])
    assert gauss == random.getstate()[2]


def test_save_load_restores_the_next_draws(run_dir: Path) -> None:
    random.seed(1234)
    random.gauss(0, 1)  # a cached gauss value is part of the state
    ck = ckrun.Checkpointer(str(run_dir), lock=False)
    ck.save(1, {"extra": {"x": 1}})
    want = [random.random() for _ in range(5)] + [random.gauss(0, 1)]
    random.seed(99)
    assert ck.load({"extra": {}}) is not None
    got = [random.random() for _ in range(5)] + [random.gauss(0, 1)]
    assert got == want


def test_the_tuple_form_of_older_checkpoints_still_restores() -> None:
    random.seed(7)
    old = {"python": random.getstate(), "torch": torch.get_rng_state()}
    want = [random.random() for _ in range(3)]
    random.seed(8)
    set_rng_state(old)
    assert [random.random() for _ in range(3)] == want
    listed = dict(old, python=[old["python"][0], list(old["python"][1]), None])
    set_rng_state(listed)  # as a list, the way a decoded tree may hold it
    assert [random.random() for _ in range(3)] == want
