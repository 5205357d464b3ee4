"""A manifest written with its layout's global tensors spliced from their kept text
(``ckrun.checkpoint.json_text``, issue 19): the same bytes as encoding the whole
manifest, save after save of a training run, and the kept text is what is written."""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ckrun import Checkpointer
from ckrun.checkpoint import json_text
from ckrun.checkpoint.json_text import Rendered, encode_spliced


def _whole(m: Any) -> bytes:
    """The reference: the manifest's JSON object encoded in one piece."""
    return json.dumps(m.to_json(), sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _mlp_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)) for _ in range(20)]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {"model": model, "optimizer": opt, "step_rng": np.arange(5)}


def _train(state: dict[str, Any]) -> None:
    model, opt = state["model"], state["optimizer"]
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("rng", [False, True])
def test_each_manifest_is_the_text_of_the_whole(tmp_path: Path, rng: bool) -> None:
    """Saves of one structure, training between them (the shards' CRCs and the step
    change; the layout's global tensors do not): every manifest's bytes, as written and
    as ``dumps`` gives them, equal the whole manifest encoded at once, and the layout's
    tensors are the memo's kept mapping."""
    state = _mlp_state()
    with Checkpointer(str(tmp_path), rng=rng, lock=False) as ck:
        for step in range(1, 5):
            _train(state)
            m = ck.save(step, state, metrics={"loss": 1.0 / step, "note": "ok"})
            assert m.tensor_layout is not None
            assert isinstance(m.tensor_layout["tensors"], Rendered)
            assert m.dumps() == _whole(m)
            assert (tmp_path / m.key).read_bytes() == _whole(m)
        assert ck._ctx.plans.hits == 3
    # and the kept text is what dumps writes (a fallback to encoding the whole, or
    # another key path, would not show this altered, still valid, text)
    kept = m.tensor_layout["tensors"]
    real = kept.text
    kept.text = '{"altered":true}'
    try:
        assert b'"tensors":{"altered":true}' in m.dumps()
    finally:
        kept.text = real


def test_the_kept_text_is_what_is_written() -> None:
    """The splice writes the mapping's kept text (here altered on purpose to a valid
    text of another value), not a new encoding of the mapping."""
    r = Rendered({"b": [1, 2], "a": {"x": "y"}})
    assert r.text == '{"a":{"x":"y"},"b":[1,2]}'
    body = {"z": 1, "layout": {"tensors": r, "version": 1}, "a": [r.text]}
    assert encode_spliced(body, "layout", "tensors") == json_text.ENCODE(body)
    r.text = '{"a":0}'
    assert encode_spliced(body, "layout", "tensors") == (
        '{"a":["{\\"a\\":{\\"x\\":\\"y\\"},\\"b\\":[1,2]}"],"layout":{"tensors":{"a":0},'
        '"version":1},"z":1}'
    )


def test_a_value_that_looks_like_the_stand_in_is_encoded_whole() -> None:
    """A string equal to the stand-in used while encoding (a metric, say) cannot move
    the splice: the record is then encoded in one piece."""
    r = Rendered({"t": 1})
    slot = json.loads(json_text._SLOT_TEXT)
    body = {"metrics": {"m": slot}, "layout": {"tensors": r}}
    assert encode_spliced(body, "layout", "tensors") == json_text.ENCODE(body)
    body = {"layout": {"tensors": r}}
    assert encode_spliced(body, "missing", "tensors") == json_text.ENCODE(body)


def test_a_copy_is_a_plain_dict_and_nan_is_refused() -> None:
    r = Rendered({"a": [1.5]})
    for c in (copy.deepcopy(r), copy.copy(r), pickle.loads(pickle.dumps(r))):
        assert type(c) is dict and c == {"a": [1.5]}
    with pytest.raises(ValueError):
        Rendered({"a": float("nan")})
