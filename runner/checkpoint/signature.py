"""The model signature and the optimizer's parameter names (issue 13, item 1).

A checkpoint records, in its manifest (:attr:`ckrun.checkpoint.manifest.Manifest.signature`):

* ``modules``: for every ``torch.nn.Module`` in the state (key path ``model``, or
  ``extra.teacher`` for one in a nested dict), each parameter's and buffer's name with its
  shape and dtype (``{"blocks.3.mlp.weight": {"shape": [512, 128], "dtype": "float32"}}``);
* ``optimizers``: for every ``torch.optim.Optimizer`` in the state, the qualified name
  (``model.blocks.3.mlp.weight``) of each parameter of each param group, in the order of
  ``optimizer.state_dict()``'s integer ids (None for a parameter no module in the state
  owns).

On load the signature is compared through the compat gate (field ``signature``, strict
unless allowed: ``allow_change=("signature",)`` or a single path such as
``signature.model.blocks.3.mlp.weight``), with one readable line per difference
(``model.blocks.3.mlp.weight: [512, 128] → [512, 256]``), and the saved optimizer state
is re-keyed by parameter name before ``load_state_dict`` (:func:`remap_optimizer`): torch
keys optimizer state by position, so a refactor that reorders same-shaped submodules
would otherwise hand each parameter the Adam moments of another one.  A checkpoint
without a signature (written before this module) loads by position, with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from ckrun.checkpoint.compat import CompatResult, is_allowed, policy_of

log = logging.getLogger(__name__)

FIELD = "signature"


def _walk(state: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key path, value)`` of every value in ``state`` and its nested dicts."""
    for k, v in state.items():
        path = f"{prefix}{k}"
        if isinstance(v, Mapping) and not callable(getattr(v, "state_dict", None)):
            yield from _walk(v, path + ".")
        else:
            yield path, v


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def of_state(state: Mapping[str, Any]) -> dict[str, Any] | None:
    """The signature of ``state`` (see the module docstring), or None when it holds no
    module and no optimizer."""
    modules: dict[str, dict[str, Any]] = {}
    names: dict[int, str] = {}  # id(parameter) -> qualified name
    optimizers: dict[str, list[list[str | None]]] = {}
    found: list[tuple[str, torch.optim.Optimizer]] = []
    for path, v in _walk(state):
        if isinstance(v, torch.nn.Module):
            sig: dict[str, Any] = {}
            for n, p in v.named_parameters():
                sig[n] = {"shape": list(p.shape), "dtype": _dtype(p)}
                names.setdefault(id(p), f"{path}.{n}")
            for n, b in v.named_buffers():
                sig[n] = {"shape": list(b.shape), "dtype": _dtype(b)}
            modules[path] = sig
        elif isinstance(v, torch.optim.Optimizer):
            found.append((path, v))
    for path, opt in found:
        optimizers[path] = [[names.get(id(p)) for p in g["params"]] for g in opt.param_groups]
    if not modules and not optimizers:
        return None
    return {"modules": modules, "optimizers": optimizers}


def _show(entry: Any) -> str:
    if entry is None:
        return "<absent>"
    return f"{entry['shape']}"


def _line(name: str, old: Any, new: Any) -> str:
    if old is not None and new is not None and old["shape"] == new["shape"]:
        return f"{name}: {old['dtype']} → {new['dtype']}"  # only the dtype differs
    text = f"{name}: {_show(old)} → {_show(new)}"
    if old is not None and new is not None and old["dtype"] != new["dtype"]:
        text += f" ({old['dtype']} → {new['dtype']})"
    return text


def compare(
    current: Mapping[str, Any] | None,
    stored: Mapping[str, Any] | None,
    *,
    allow_change: tuple[str, ...] | list[str] = (),
    policy: Mapping[str, str],
) -> tuple[CompatResult, list[str]]:
    """Compare two module signatures, classified like a compat block.

    Only modules present on both sides are compared (a module added to or dropped from
    the state is the state's business, logged by ``restore``).  Each differing parameter
    or buffer is one line ``model.blocks.3.mlp.weight: [512, 128] → [512, 256]`` (or
    ``<absent>`` on the side that lacks it); its compat path is
    ``signature.model.blocks.3.mlp.weight`` and its policy that of ``signature``
    (default strict).

    Returns:
        The classified lines, and the state keys of the modules with a refused
        difference; nothing when either side has no signature (an old checkpoint).
    """
    res = CompatResult()
    refused: list[str] = []
    if not current or not stored:
        return res, refused
    cur, old = current.get("modules") or {}, stored.get("modules") or {}
    for mod in sorted(cur.keys() & old.keys()):
        a, b = old[mod], cur[mod]
        for n in sorted(a.keys() | b.keys()):
            ea, eb = a.get(n), b.get(n)
            if ea == eb:
                continue
            path = f"{FIELD}.{mod}.{n}"
            kind = policy_of(path, policy)
            if kind == "ignore":
                continue
            line = _line(f"{mod}.{n}", ea, eb)
            if is_allowed(path, allow_change):
                res.allowed.append(line)
            elif kind == "warn":
                res.warn.append(line)
            else:
                res.refuse.append(line)
                if mod not in refused:
                    refused.append(mod)
    return res, refused


def remap_optimizer(
    saved: Mapping[str, Any],
    saved_names: list[list[str | None]] | None,
    current: torch.optim.Optimizer,
    current_names: list[list[str | None]] | None,
    *,
    where: str,
) -> Mapping[str, Any]:
    """Re-key a saved ``optimizer.state_dict()`` so state follows parameters by name.

    Args:
        saved: the saved state dict (``{"state": {id: ...}, "param_groups": [...]}``).
        saved_names: the saved optimizer's parameter names per group (manifest), or
            None for a checkpoint without a signature.
        current: the optimizer being restored.
        current_names: its parameter names per group (:func:`of_state`).
        where: for messages.

    Returns:
        A state dict in ``current``'s parameter order: each parameter gets the state
        saved under its name, and each group the hyper-parameters of the saved group that
        held its parameters.  A parameter whose name the checkpoint lacks (allowed by the
        compat gate) starts without optimizer state.  Without names on either side (or
        with unnamed parameters) ``saved`` is returned unchanged: positional, as torch.
    """
    if not saved_names or not current_names:
        log.warning(
            "%s: the checkpoint records no optimizer parameter names (written by an older "
            "ckrun): optimizer state is restored by position",
            where,
        )
        return saved
    flat_saved = [n for g in saved_names for n in g]
    flat_cur = [n for g in current_names for n in g]
    if None in flat_saved or None in flat_cur or len(set(flat_saved)) != len(flat_saved):
        log.warning(
            "%s: some optimizer parameters belong to no module in the state: optimizer "
            "state is restored by position",
            where,
        )
        return saved
    groups = saved.get("param_groups")
    state = saved.get("state", {})
    if not isinstance(groups, list) or len(groups) != len(saved_names):
        return saved
    saved_id: dict[str, Any] = {}
    saved_group: dict[str, int] = {}
    for gi, (g, gnames) in enumerate(zip(groups, saved_names, strict=True)):
        if len(g["params"]) != len(gnames):
            return saved
        for pid, n in zip(g["params"], gnames, strict=True):
            assert n is not None
            saved_id[n], saved_group[n] = pid, gi
    if flat_saved == flat_cur:
        return saved  # same order: nothing to do
    new_state: dict[Any, Any] = {}
    new_groups: list[dict[str, Any]] = []
    nid = 0
    for gi, (cg, cnames) in enumerate(zip(current.param_groups, current_names, strict=True)):
        src = next((saved_group[n] for n in cnames if n in saved_group), gi)
        g = {k: v for k, v in groups[min(src, len(groups) - 1)].items() if k != "param_names"}
        ids = []
        for n in cnames:
            assert n is not None
            old = saved_id.get(n)
            if old is not None and old in state:
                new_state[nid] = state[old]
            ids.append(nid)
            nid += 1
        g["params"] = ids
        if "param_names" in cg:
            g["param_names"] = list(cg["param_names"])
        new_groups.append(g)
    moved = sum(1 for a, b in zip(flat_saved, flat_cur, strict=False) if a != b)
    log.info("%s: optimizer state re-keyed by parameter name (%d moved)", where, moved)
    return {**saved, "state": new_state, "param_groups": new_groups}


def remap_tree(
    tree: Mapping[str, Any],
    stored: Mapping[str, Any] | None,
    state: Mapping[str, Any],
    current: Mapping[str, Any] | None,
    *,
    where: str,
) -> None:
    """Re-key, in place, every optimizer state dict of a loaded ``tree`` (``capture``'s
    layout) by parameter name (:func:`remap_optimizer`)."""
    user = tree.get("user")
    if not isinstance(user, dict):
        return
    saved_opts = (stored or {}).get("optimizers") or {}
    cur_opts = (current or {}).get("optimizers") or {}
    for path, v in _walk(state):
        if not isinstance(v, torch.optim.Optimizer):
            continue
        node: Any = user
        parts = path.split(".")
        for p in parts[:-1]:
            node = node.get(p) if isinstance(node, dict) else None
        if not isinstance(node, dict) or not isinstance(node.get(parts[-1]), Mapping):
            continue
        node[parts[-1]] = remap_optimizer(
            node[parts[-1]],
            saved_opts.get(path),
            v,
            cur_opts.get(path),
            where=f"{where} [{path!r}]",
        )
