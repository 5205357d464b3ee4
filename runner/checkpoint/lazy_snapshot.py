"""Lazy snapshot of an ``async_save``: copy each tensor during the next step (issue 19).

An eager ``async_save`` blocks while every tensor of the state is copied into the reused
host buffers (:class:`ckrun.checkpoint.host_buffers.HostBuffers`).  With
``lazy=True`` (``Checkpointer(..., lazy_snapshot=True)`` or
``ckpt.async_save(step, state, lazy=True)``) the call returns after:

* capturing everything that is not a tensor (RNG, counters, sampler positions, the
  optimizers' hyper-parameters) and the structure of the state: the snapshot's tree is
  encoded at the call (:func:`ckrun.checkpoint.pipeline.snapshot`);
* copying eagerly every tensor that forward/backward may change: module buffers (e.g.
  BatchNorm running statistics), RNG states, numpy arrays, and any tensor whose storage
  is neither a parameter nor an optimizer-state tensor of an optimizer found in the
  state;
* recording each remaining tensor's version counter (``tensor._version``: bumped by every
  in-place write through the tensor, its views, ``detach()`` or under ``no_grad``) and
  registering a step pre-hook (``torch.optim.Optimizer.register_step_pre_hook``) on
  each optimizer found in the state.

Parameters and optimizer state are then copied into the same host buffers by a
background thread (the *copier*, kept by the saver, at ``SCHED_IDLE`` like the persist,
:mod:`ckrun.checkpoint.persist_policy`: it copies only on cores the training leaves
idle; measured on 2 vCPUs, a copier at the training's priority slowed the overlapped
step 1.31×, at ``SCHED_IDLE`` 1.10-1.18×, bench/README.md; it copies dense CPU tensors
with ``memmove``, one thread, no OpenMP team of its own), while the training loop
runs the next forward and backward pass, in which they are read only.  Before an
optimizer's ``step()`` first writes, its pre-hook copies in the calling thread every one
of its tensors the copier has not taken yet, raises the copier back to the normal policy
when it holds one of them, and waits for it, so no step changes a tensor
before its copy: the committed content is bitwise that of a synchronous save at the same
step (tests/checkpoint/test_lazy_snapshot.py).  This is DataStates-LLM's observation
(Maurya et al., HPDC 2024: parameters and optimizer state are immutable during forward
and backward) with a copy-before-write guard on the optimizer step.

Guard: a tensor whose version counter moved before its optimizer's pre-hook ran was
written outside ``optimizer.step()`` (a manual in-place update, an optimizer that is not
in the state): its copy may mix values of two steps, so the save fails with a
:class:`~ckrun.errors.CheckpointError` naming the tensor and the fix (an eager
``async_save``), the shard is aborted before its commit and the last good checkpoint
stays.  The check runs after each copy, in each pre-hook, and once more just before the
shard is committed.  Not detectable: a write through ``tensor.data`` (PyTorch gives the
``.data`` alias a fresh version counter on purpose), which is why the lazy mode is opt-in
and not the default.

Hooks are removed at the first point where that is safe once their work is done: in the
hook itself when it is the optimizer's last step pre-hook (torch iterates the hooks of an
``OrderedDict`` while calling them; removing the entry just yielded, when it is the last
one, ends the iteration cleanly), otherwise at the next ``save``/``async_save``/
``wait``/``close`` of the Checkpointer.  After that, steps pay nothing.

CUDA (written, untested here: no GPU): copies are issued on a side stream that first
waits for the compute stream at the call; eager copies make the compute stream wait for
them (no host sync in the call); a pre-hook makes the compute stream wait for the copy
events of its tensors; the persist synchronises on every event before writing.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from ckrun.checkpoint.optim_tensors import optimizers_in, owned_storages, storage_key
from ckrun.checkpoint.persist_policy import persist_sched
from ckrun.checkpoint.sharding import Planned
from ckrun.errors import CheckpointError
from ckrun.storage import priority
from ckrun.storage.base import ObjectInfo, ObjectWriter

__all__ = ["LazySnapshot", "optimizers_in"]

log = logging.getLogger(__name__)

PENDING, CLAIMED, DONE = 0, 1, 2


def _same_dense_cpu(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Both contiguous CPU tensors of one dtype and size: a byte copy is the copy."""
    dense = all(t.device.type == "cpu" and t.is_contiguous() for t in (src, dst))
    return dense and src.dtype == dst.dtype and src.numel() == dst.numel()


@dataclass
class _Entry:
    """One tensor copied lazily: ``src`` (the live tensor or a view of it) into ``dst``."""

    index: int
    name: str
    src: torch.Tensor
    dst: torch.Tensor
    version: int
    owners: tuple[int, ...]
    state: int = PENDING
    event: Any = None  # torch.cuda.Event of the copy (CUDA only)
    by_hook: bool = False  # copied by an optimizer's pre-hook (in the training thread)


@dataclass
class _Stats:
    """What happened (for tests and the benchmark): entries copied by each side."""

    eager: int = 0
    by_copier: int = 0
    by_hook: int = 0
    hooks_removed: int = 0
    failures: list[str] = field(default_factory=list)


class LazySnapshot:
    """The lazy copy of one ``async_save`` (module docstring).

    Args:
        step: the step saved (for messages).
        snap: the planned snapshot (tensors referenced, not copied).
        dests: the host-buffer views, one per tensor of ``snap``
            (:meth:`~ckrun.checkpoint.host_buffers.HostBuffers.destinations`).
        state: the user's state, searched for optimizers.

    The constructor copies the eager tensors and registers the hooks (in the caller's
    thread); :meth:`copy_all` runs the copier (its own thread); :meth:`wait`
    returns once every tensor is copied; :meth:`verified` wraps the shard writer so its
    commit first re-checks the version counters; :meth:`close` removes the remaining
    hooks (the training thread, outside ``step``).
    """

    def __init__(
        self, step: int, snap: Planned, dests: list[Any], state: Mapping[str, Any]
    ) -> None:
        self.step = step
        self.stats = _Stats()
        self._cond = threading.Condition()
        self._closed = False
        self._copier_tid: int | None = None
        self._optimizers = optimizers_in(state)
        self._hooked = [False] * len(self._optimizers)
        self._handles: list[Any] = [None] * len(self._optimizers)
        owners: dict[tuple[str, int], list[int]] = {}
        for i, opt in enumerate(self._optimizers):
            for k in owned_storages(opt):
                if i not in owners.setdefault(k, []):
                    owners[k].append(i)
        self._side: dict[torch.device, Any] = {}
        self.entries: list[_Entry] = []
        self._by_opt: list[list[_Entry]] = [[] for _ in self._optimizers]
        for t in snap.tensors:  # copy streams wait for the compute streams' work up to now
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                self._side_stream(t.device)
        eager: list[tuple[Any, Any]] = []
        for i, (name, t, d) in enumerate(zip(snap.names, snap.tensors, dests, strict=True)):
            key = storage_key(t) if isinstance(t, torch.Tensor) else None
            own = tuple(owners.get(key, ())) if key is not None else ()
            if not own or name.startswith("rng.") or not isinstance(d, torch.Tensor):
                eager.append((t, d))
                continue
            assert isinstance(t, torch.Tensor)
            e = _Entry(i, name, t, d, int(t._version), own)
            self.entries.append(e)
            for o in own:
                self._by_opt[o].append(e)
        with torch.no_grad():
            for t, d in eager:
                if isinstance(d, torch.Tensor) and isinstance(t, torch.Tensor):
                    if t.device.type == "cuda":
                        with torch.cuda.stream(self._side_stream(t.device)):
                            d.copy_(t, non_blocking=True)
                    else:
                        d.copy_(t)
                else:
                    d[...] = t
        for dev, side in self._side.items():  # the next forward writes after the copies
            torch.cuda.current_stream(dev).wait_stream(side)
        self.stats.eager = len(eager)
        for o, opt in enumerate(self._optimizers):
            if self._by_opt[o]:
                self._handles[o] = opt.register_step_pre_hook(self._pre_hook(o))

    # -- copying --------------------------------------------------------------------

    def _side_stream(self, device: torch.device) -> Any:
        """The copy stream of ``device``, created at the call in the caller's thread
        (waiting for its current stream's work up to now: the values of the saved step)."""
        side = self._side.get(device)
        if side is None:
            side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(device))
            self._side[device] = side
        return side

    def _claim(self, entries: list[_Entry]) -> list[_Entry]:
        with self._cond:
            mine = [e for e in entries if e.state == PENDING]
            for e in mine:
                e.state = CLAIMED
            return mine

    def _copy(self, e: _Entry, *, one_thread: bool = False) -> None:
        """Copy ``e`` into its host buffer.  ``one_thread`` (the copier): a dense CPU
        tensor is copied with ``ctypes.memmove`` (releases the GIL, no OpenMP team:
        torch's ``copy_`` from another thread starts a worker of its own, which would
        inherit ``SCHED_IDLE`` and stay there when the copier is raised)."""
        try:
            with torch.no_grad():
                if one_thread and _same_dense_cpu(e.src, e.dst):
                    n = e.src.numel() * e.src.element_size()
                    ctypes.memmove(e.dst.data_ptr(), e.src.data_ptr(), n)
                elif e.src.device.type == "cuda":
                    side = self._side[e.src.device]
                    with torch.cuda.stream(side):
                        e.dst.copy_(e.src, non_blocking=True)
                        e.src.record_stream(side)
                        e.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                        e.event.record(side)
                else:
                    e.dst.copy_(e.src)
        except BaseException as exc:
            self._fail(f"{e.name}: copying it into the host buffers failed: {exc}")
        finally:
            with self._cond:
                e.state = DONE
                self._check(e, "before or while it was copied")
                self._cond.notify_all()

    def _check(self, e: _Entry, when: str) -> None:
        """Record a failure when ``e`` was written since the call (under the lock)."""
        now = int(e.src._version)
        if now != e.version:
            self._fail(
                f"{e.name} was modified in place outside optimizer.step() {when} "
                f"(version {e.version} -> {now})"
            )

    def _fail(self, msg: str) -> None:
        if msg not in self.stats.failures:
            self.stats.failures.append(msg)
            log.error("lazy snapshot of step %d: %s; the save will fail", self.step, msg)

    def copy_all(self) -> None:
        """The copier (its own thread): copy every entry no hook has taken, in order;
        never raises (failures are recorded for :meth:`wait`).  At ``SCHED_IDLE`` where
        the persist runs idle (module docstring), else at the training's priority."""
        if persist_sched():
            self._copier_tid = threading.get_native_id()
            priority.lower(0, idle=True)
        mine: list[_Entry] = []  # claimed by the copier
        try:
            for e in self.entries:
                if self._claim([e]):
                    mine.append(e)
                    self._copy(e, one_thread=True)
                    self.stats.by_copier += 1
        except BaseException as exc:  # leave no entry pending: the persist would hang
            with self._cond:
                left = [e for e in mine if e.state != DONE]
            for e in left + self._claim(self.entries):
                self._fail(f"{e.name}: the copier stopped: {exc}")
                with self._cond:
                    e.state = DONE
                    self._cond.notify_all()

    def wait(self) -> None:
        """Block until every entry is copied (device copies included).

        Raises:
            CheckpointError: a tensor was written before its copy (names it).
        """
        with self._cond:
            self._cond.wait_for(lambda: all(e.state == DONE for e in self.entries))
        for e in self.entries:
            if e.event is not None:
                e.event.synchronize()
        self.raise_failures()

    def raise_failures(self) -> None:
        """Raise the recorded failures, if any, as one CheckpointError."""
        f = self.stats.failures
        if f:
            more = f"; and {len(f) - 3} more tensors" if len(f) > 3 else ""
            raise CheckpointError(
                f"lazy snapshot of step {self.step}: "
                + "; ".join(f[:3])
                + more
                + ". Its copy may mix two steps, so this save is not committed (the "
                "previous checkpoint stays). Write parameters and optimizer state only "
                "inside optimizer.step() of an optimizer in the saved state, or save "
                "eagerly: async_save(..., lazy=False) / Checkpointer(lazy_snapshot=False)"
            )

    # -- the guard on optimizer.step() ------------------------------------------------

    def _pre_hook(self, o: int) -> Callable[..., None]:
        def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if not self._hooked[o] and not self._closed:
                self._ensure(o)
            self._remove_if_last(o)

        return hook

    def _ensure(self, o: int) -> None:
        """Before optimizer ``o`` writes: its entries copied, unchanged since the call."""
        entries = self._by_opt[o]
        for e in self._claim(entries):
            e.by_hook = True
            self._copy(e)
            self.stats.by_hook += 1
        if self._copier_tid is not None and any(e.state != DONE for e in entries):
            priority.raise_thread(self._copier_tid)  # the step waits for its copy now
        with self._cond:
            self._cond.wait_for(lambda: all(e.state == DONE for e in entries))
            for e in entries:
                self._check(e, "before its optimizer's next step")
            self._hooked[o] = True  # from here on, optimizer o's writes are legitimate
        for e in entries:
            if e.event is not None:  # the step's kernels run after the copies
                torch.cuda.current_stream(e.src.device).wait_event(e.event)

    def _remove_if_last(self, o: int) -> None:
        """Remove optimizer ``o``'s hook from inside the hook, when that is safe: it is
        the last entry of the ``OrderedDict`` torch is iterating (removing the entry just
        yielded, when last, ends that iteration without a mutation error)."""
        h = self._handles[o]
        hooks = self._optimizers[o]._optimizer_step_pre_hooks
        if (
            h is not None
            and (self._hooked[o] or self._closed)
            and next(reversed(hooks), None) == h.id
        ):
            h.remove()
            self._handles[o] = None
            self.stats.hooks_removed += 1

    def hooks_left(self) -> int:
        """Hooks still registered."""
        return sum(h is not None for h in self._handles)

    def close(self) -> None:
        """Remove every remaining hook (call outside ``optimizer.step()``)."""
        self._closed = True
        for o, h in enumerate(self._handles):
            if h is not None:
                h.remove()
                self._handles[o] = None
                self.stats.hooks_removed += 1

    # -- the last check, just before the shard's commit ------------------------------

    def final_check(self) -> None:
        """Re-check every entry whose optimizers have not stepped since the call.

        Raises:
            CheckpointError: one was written outside ``optimizer.step()``.
        """
        with self._cond:
            for e in self.entries:
                if not any(self._hooked[o] for o in e.owners):
                    self._check(e, "before the shard was committed")
        self.raise_failures()

    def verified(self, open_shard: Callable[[str], ObjectWriter]) -> Callable[[str], ObjectWriter]:
        """``open_shard`` whose writers run :meth:`final_check` before committing (a
        failure aborts the shard: nothing is left under its key, no manifest)."""

        def opener(key: str) -> ObjectWriter:
            return _CheckedWriter(open_shard(key), self.final_check)

        return opener


class _CheckedWriter:
    """An ObjectWriter whose ``commit`` first runs ``check`` (which may raise)."""

    def __init__(self, inner: ObjectWriter, check: Callable[[], None]) -> None:
        self._inner, self._check = inner, check
        self.key = inner.key

    def write(self, data: bytes | bytearray | memoryview) -> int:
        return self._inner.write(data)

    def commit(self) -> ObjectInfo:
        self._check()
        return self._inner.commit()

    def abort(self) -> None:
        self._inner.abort()

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
