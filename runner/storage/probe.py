"""The adaptive writer of :class:`ckrun.storage.local.LocalStorage`: which streaming
writer suits a storage location, chosen by a short measured probe and remembered.

Candidates (issue 19): ``O_DIRECT`` with one write outstanding (the double buffer of
:class:`~ckrun.storage.direct.DirectWriter`), ``O_DIRECT`` with :data:`DEEP` writes
outstanding (a busy, throttled or network device needs a deeper queue to reach its
rate), and the page cache with ``sync_file_range`` write-behind
(:class:`~ckrun.storage.local_writer.LocalWriter`; the kernel's write-back keeps many
requests in flight).  Each writes :data:`PROBE_BYTES` to a temp file in the storage
root, fsynced, and the fastest wins (``O_DIRECT`` on a tie within 5 %, as it leaves the
page cache alone).  The choice is kept in memory and in a small JSON file,
``$CKRUN_CACHE_DIR`` (default ``$XDG_CACHE_HOME/ckrun`` or ``~/.cache/ckrun``)
``/writer-probe.json``, keyed by the device number and mount point of the location, so
a location is probed once per machine (by one process at a time: the ranks of a job that
reach their first save together share one probe); it is logged at INFO.

``CKRUN_WRITER`` overrides the probe: ``direct`` (depth 1), ``direct:N`` (depth N),
``writebehind``, ``auto`` (the default: probe).  Measurements: bench/README.md.

The probe writes ``3 × PROBE_BYTES`` (288 MiB) and is run only where its answer is
worth it: a caller that writes an object every candidate would write through the page
cache anyway (a small state) passes ``may_probe=False``, and once a preemption notice
has reached the process (:func:`defer_probes`, called by :mod:`ckrun.control`) no probe
runs at all: on a fresh machine the first save is often the emergency one, and on a slow
volume the probe would take longer than the save it tunes.  Both get ``direct:1``
(source ``deferred``, the writer used before the probe existed), not remembered, so a
later save probes as usual.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass

from ckrun.errors import ConfigError, StorageError
from ckrun.storage.local_writer import DirectUnsupported

log = logging.getLogger(__name__)

#: Bytes each candidate writes: six of :class:`~ckrun.storage.direct.DirectWriter`'s
#: 16 MiB requests, so the deep candidate does keep :data:`DEEP` of them outstanding
#: (48 MiB, three requests, never had more than one in flight).
PROBE_BYTES = 96 << 20
DEEP = 4
_TIE = 0.95
_lock = threading.Lock()
_memo: dict[str, WriterChoice] = {}
_deferred: list[str] = []  # why probes are deferred in this process (first reason)


@dataclass(frozen=True)
class WriterChoice:
    """A streaming writer for one location.

    Attributes:
        mode: ``direct`` (``O_DIRECT`` staging writer) or ``writebehind``.
        depth: ``O_DIRECT`` writes outstanding (1 for ``writebehind``).
        source: ``probe``, ``cache`` (remembered probe), ``env`` (CKRUN_WRITER),
            ``fallback`` (the probe failed, e.g. no room: ``direct:1``, not remembered)
            or ``deferred`` (no probe now, :func:`choose`: ``direct:1``, not remembered).
        rates: the probe's GB/s per candidate (empty unless probed).
    """

    mode: str
    depth: int = 1
    source: str = "probe"
    rates: tuple[tuple[str, float], ...] = ()

    @property
    def label(self) -> str:
        """``direct:N`` or ``writebehind``."""
        return f"direct:{self.depth}" if self.mode == "direct" else "writebehind"


def parse(spec: str) -> WriterChoice | None:
    """``CKRUN_WRITER``'s value as a choice; None for ``auto``/empty.

    Raises:
        ConfigError: not one of ``auto``, ``direct``, ``direct:N`` (N >= 1), ``writebehind``.
    """
    s = spec.strip().lower()
    if s in ("", "auto"):
        return None
    if s == "writebehind":
        return WriterChoice("writebehind", 1, "env")
    if s == "direct":
        return WriterChoice("direct", 1, "env")
    if s.startswith("direct:") and s[7:].isdigit() and int(s[7:]) >= 1:
        return WriterChoice("direct", int(s[7:]), "env")
    raise ConfigError(
        f"CKRUN_WRITER={spec!r}: expected auto, direct, direct:N (N >= 1) or writebehind"
    )


def cache_file() -> str:
    """The JSON file that remembers probe results (see module docstring)."""
    d = os.environ.get("CKRUN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ckrun"
    )
    return os.path.join(d, "writer-probe.json")


def location_key(root: str) -> str:
    """``<st_dev>:<mount point>`` of ``root``: one probe per device and mount."""
    mnt = os.path.abspath(root)
    while not os.path.ismount(mnt):
        mnt = os.path.dirname(mnt)
    return f"{os.stat(root).st_dev}:{mnt}"


def _read_cache() -> dict[str, dict[str, object]]:
    try:
        with open(cache_file()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, c: WriterChoice) -> None:
    path = cache_file()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = _read_cache()
        data[key] = {**asdict(c), "probed_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ")}
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(3)}"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: the choice is still kept in memory
        log.debug("cannot remember the writer probe in %s: %s", path, e)


def _cached(key: str) -> WriterChoice | None:
    """The remembered choice for location ``key``, if the cache file has a valid one."""
    entry = _read_cache().get(key)
    return _from_cache(entry) if isinstance(entry, dict) else None


def _from_cache(entry: dict[str, object]) -> WriterChoice | None:
    mode, depth, rates = entry.get("mode"), entry.get("depth"), entry.get("rates")
    if mode not in ("direct", "writebehind") or not isinstance(depth, int) or depth < 1:
        return None
    kept = tuple(
        (str(r[0]), float(r[1]))
        for r in (rates if isinstance(rates, list) else [])
        if isinstance(r, list) and len(r) == 2 and isinstance(r[1], (int, float))
    )
    return WriterChoice(str(mode), depth, "cache", kept)


def _time_write(root: str, mode: str, depth: int, nbytes: int) -> float:
    """Seconds to write and fsync ``nbytes`` with one candidate writer (temp file)."""
    from ckrun.storage.direct import DirectWriter
    from ckrun.storage.local_writer import TEMP_PREFIX, LocalWriter

    class _Root:
        def __init__(self, r: str) -> None:
            self.root, self.url = r, r

    # a temp-prefixed key: invisible to list(), removed by sweep_temp if left behind
    name = f"{TEMP_PREFIX}{os.getpid()}-probe-{secrets.token_hex(3)}"
    w = (
        DirectWriter(_Root(root), name, depth=depth)
        if mode == "direct"
        else LocalWriter(_Root(root), name, write_behind=True)
    )
    chunk = memoryview(bytearray(os.urandom(1 << 20) * 8))
    try:
        t = time.perf_counter()
        done = 0
        while done < nbytes:
            if _deferred:  # a notice came during the probe: the save goes first
                raise ProbeDeferred(_deferred[0])
            done += w.write(chunk)
        if _deferred:  # nor its fsync of up to PROBE_BYTES
            raise ProbeDeferred(_deferred[0])
        w.commit()  # fsync + rename + directory fsync, as for a shard
        return time.perf_counter() - t
    finally:
        w.abort()
        try:
            os.unlink(os.path.join(root, name))
        except OSError:
            pass


def probe(root: str, nbytes: int = PROBE_BYTES) -> WriterChoice:
    """Measure the candidates on ``root`` (module docstring); returns the fastest.

    Raises:
        DirectUnsupported: the filesystem refuses ``O_DIRECT`` (the caller falls back).
        StorageError: the probe's writes failed.
        ProbeDeferred: :func:`defer_probes` was called while it ran (nothing is left).
    """
    cands = [("direct", 1), ("direct", DEEP), ("writebehind", 1)]
    rates: dict[str, float] = {}
    for mode, depth in cands:
        dt = _time_write(root, mode, depth, nbytes)
        rates[WriterChoice(mode, depth).label] = nbytes / dt / 1e9
    best = max(rates, key=lambda k: rates[k])
    best_direct = max((k for k in rates if k.startswith("direct")), key=lambda k: rates[k])
    if rates[best_direct] >= _TIE * rates[best]:
        best = best_direct
    mode, _, d = best.partition(":")
    from ckrun.storage.direct import keep_free

    keep_free(int(d or 1) if mode == "direct" else None)  # not the deep candidate's 80 MiB
    return WriterChoice(mode, int(d or 1), "probe", tuple(sorted(rates.items())))


class ProbeDeferred(Exception):
    """No probe now: probes were deferred (:func:`defer_probes`), also while one ran, or
    another process's probe took too long."""


#: The writer of a location without a probe (the one used before the probe existed).
_DEFERRED = WriterChoice("direct", 1, "deferred")


#: Seconds a process waits for another one's probe of the same machine before it
#: writes with ``direct:1`` for now (a probe takes 0.3 s on a quiet disk, 30 s at 10 MB/s).
PROBE_WAIT_S = 60.0


def _probe_once(root: str, key: str) -> WriterChoice:
    """Probe ``root`` and remember the result, one process of the machine at a time: under
    the file lock ``<cache file>.lock`` (``flock``), re-reading the cache first, so the
    ranks of a job that reach their first save together probe once and the others use
    that result (several probes at once would also each measure a fraction of the disk).
    Without a usable lock file (a read-only home) it probes alone.

    Returns:
        The probed choice (source ``probe``) or the remembered one (``cache``).

    Raises:
        ProbeDeferred: a notice came, or another process probed for longer than
            :data:`PROBE_WAIT_S`.  Otherwise as :func:`probe`.
    """
    from filelock import FileLock, Timeout

    path = cache_file() + ".lock"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock: FileLock | None = FileLock(path, thread_local=False)
    except OSError:
        lock = None
    deadline = time.monotonic() + PROBE_WAIT_S
    while lock is not None:
        try:
            lock.acquire(timeout=0.1)
            break
        except Timeout:
            if _deferred:
                raise ProbeDeferred(_deferred[0]) from None
            if time.monotonic() > deadline:
                raise ProbeDeferred(f"another process probes for {PROBE_WAIT_S:g} s") from None
        except OSError:  # the lock file cannot be created: probe alone
            lock = None
    try:
        c = _cached(key)
        if c is None:
            c = probe(root)
            _write_cache(key, c)
        return c
    finally:
        if lock is not None:
            lock.release()


def defer_probes(reason: str) -> None:
    """From now on this process runs no probe (module docstring): an unprobed location
    gets ``direct:1`` (source ``deferred``, not remembered).  Safe in a signal handler
    (one list append, no lock).

    Args:
        reason: for the log line, e.g. ``"a preemption notice is pending"``.
    """
    if not _deferred:
        _deferred.append(reason)


def choose(root: str, *, may_probe: bool = True) -> WriterChoice:
    """The writer for ``root``: CKRUN_WRITER, else remembered, else probed (and kept).

    A probe that fails with a storage error (no room for its 48 MiB, say) gives
    ``direct:1`` for this process, logged as a warning and not remembered.  Without
    ``may_probe``, or after :func:`defer_probes` (also one that comes while the probe
    runs: it stops between two 8 MiB writes), an unprobed location gets ``direct:1``
    (source ``deferred``) for this call, not remembered.

    Raises:
        ConfigError: CKRUN_WRITER is malformed.
        DirectUnsupported: the probe found ``O_DIRECT`` refused.
    """
    env = parse(os.environ.get("CKRUN_WRITER", ""))
    if env is not None:
        return env
    key = location_key(root)
    with _lock:
        if key in _memo:
            return _memo[key]
        c = _cached(key)
        if c is None and not may_probe:
            return _DEFERRED
        if c is None:
            try:
                if _deferred:
                    raise ProbeDeferred(_deferred[0])
                c = _probe_once(root, key)
            except ProbeDeferred as e:  # not remembered: a later call asks again
                log.info("writer probe for %s deferred (%s): direct:1", key, e)
                return _DEFERRED
            except DirectUnsupported:
                raise
            except StorageError as e:  # e.g. no room for the probe: the classic writer
                log.warning("writer probe for %s failed (%s): using direct:1", key, e)
                c = WriterChoice("direct", 1, "fallback")
                _memo[key] = c
                return c
        if c.source == "probe":
            log.info(
                "writer probe for %s: %s (GB/s %s)",
                key,
                c.label,
                ", ".join(f"{k} {v:.2f}" for k, v in c.rates),
            )
        else:
            log.info("writer for %s: %s (remembered in %s)", key, c.label, cache_file())
        _memo[key] = c
        return c


def forget() -> None:
    """Drop the in-memory choices and a deferral (the JSON file stays); for tests and
    the benchmark."""
    with _lock:
        _memo.clear()
        _deferred.clear()
