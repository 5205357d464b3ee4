"""The names of an encoded tree's tensors (:func:`tensor_paths`): the entry names of
a shard, the keys of its layout and of a resharded load.

A tensor is named by its place in the state: ``user.model.weight``,
``user.optimizer.state.0.exp_avg``, ``rng.torch``.  The name is a function of the
encoder's chain for that tensor (:attr:`ckrun.checkpoint.shard.Snapshot.chains`), which
is ``"state"`` and then, per level:

* ``(parent, ".", key)``: a ``str`` key (exactly ``str``): adds ``.key`` (the root's
  keys are bare);
* ``(parent, "[", index)``: a list or tuple item: adds ``.index``;
* ``(parent, "#", (position, type(key), key))``: a key of a subclass of ``str``, or an
  ``int`` key of a dict with other than string keys: adds ``.key`` as the key formats
  itself;
* ``(parent, "#", (position,))``: any other key: adds ``.#position``;
* ``(parent, "@", position or "meta")``: inside a key or an ``OrderedDict``'s
  metadata: no name; the encoder refuses a tensor there.

A name seen before, holding ``@`` or equal to ``__metadata__`` gets ``#i`` (its index)
appended, so names are unique and never a safetensors reserved key.
"""

from __future__ import annotations

from typing import Any

from ckrun.checkpoint.shard import TAG


def tensor_paths(tree: Any) -> list[str]:
    """Unique names of the tensor placeholders of an encoded tree, by index: the dotted
    path (``user.model.weight``, ``user.optimizer.state.0.exp_avg``, ``rng.torch``)."""
    out: dict[int, str] = {}

    def walk(v: Any, path: str) -> None:
        if isinstance(v, list):
            for i, x in enumerate(v):
                walk(x, f"{path}.{i}")
            return
        if not isinstance(v, dict):
            return
        tag = v.get(TAG)
        if tag is None:
            for k, x in v.items():
                walk(x, f"{path}.{k}" if path else k)
        elif tag in ("tensor", "ndarray"):
            out[int(v["i"])] = path
        elif tag == "tuple":
            for i, x in enumerate(v["items"]):
                walk(x, f"{path}.{i}")
        elif tag in ("dict", "odict"):
            for j, (k, x) in enumerate(v["items"]):
                plain = isinstance(k, (str, int)) and not isinstance(k, bool)
                walk(x, f"{path}.{k if plain else f'#{j}'}")

    walk(tree, "")
    names, seen = [], set()
    for i in range(len(out)):
        n = out[i]
        if n in seen or "@" in n or n == "__metadata__":
            n = f"{n}#{i}"
        seen.add(n)
        names.append(n)
    return names
