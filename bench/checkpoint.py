"""Checkpoint save/load benchmark (issue 2): ckrun against the disk and torch.save.

One run, side by side, on a transformer-shaped state (fp32 weights + AdamW exp_avg and
exp_avg_sq, so the weights are a third of the bytes):

    saves : O_DIRECT write + fsync (the disk's limit), page-cache write + fsync,
            torch.save + fsync, ckrun save (default: O_DIRECT staging writer; and through
            the page cache with and without sync_file_range write-behind)
    loads : cold read of the file, torch.load(weights_only) into the model and
            optimizer, torch.load(mmap=True), ckrun load — each after dropping the page
            cache (``echo 3 > /proc/sys/vm/drop_caches`` as root, else
            ``posix_fadvise(DONTNEED)`` on the files; the table says which)

GB/s are 10^9 bytes per second; ratios are computed within the run.  Extra RSS during
the ckrun save is sampled every 2 ms from /proc/self/statm.

Usage: python bench/checkpoint.py [--size-gib 0.25] [--throttle-mbps 150] [--repeats 2]
           (issue 19: one table per disk regime, quiet and throttled; bench/regimes.py)
       python bench/checkpoint.py --issue2 [--size-gib 1] [--dir /tmp/ckrun-bench] [--json OUT]
       python bench/checkpoint.py --sizes 0.25,1[,4] [--repeats 3] [--compute-s 3]
           (issue 7: the side-by-side table with async saves, safetensors and DCP; see
           bench/checkpoint_async.py)
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import ckrun
import torch
from ckrun.storage.local import LocalStorage

GB = 1e9
CHUNK = 64 << 20


def build_state(size_gib: float, d_model: int = 1024) -> dict[str, Any]:
    """Transformer blocks (qkv, proj, mlp up/down, 2 layernorms) + AdamW with state."""
    per_block = 12 * d_model * d_model + 13 * d_model
    blocks = max(1, round(size_gib * (1 << 30) / (3 * 4 * per_block)))
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(blocks):
        layers += [
            torch.nn.LayerNorm(d_model),
            torch.nn.Linear(d_model, 3 * d_model),
            torch.nn.Linear(d_model, d_model),
            torch.nn.LayerNorm(d_model),
            torch.nn.Linear(d_model, 4 * d_model),
            torch.nn.Linear(4 * d_model, d_model),
        ]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"model": model, "optimizer": opt, "extra": {"step": 1}}


def state_bytes(state: dict[str, Any]) -> int:
    n = sum(t.numel() * t.element_size() for t in state["model"].state_dict().values())
    for st in state["optimizer"].state_dict()["state"].values():
        n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return n


def _tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    out = list(state["model"].state_dict().values())
    for st in state["optimizer"].state_dict()["state"].values():
        out += [v for v in st.values() if torch.is_tensor(v)]
    return out


def drop_cache(paths: list[str]) -> str:
    """Evict ``paths`` from the page cache; returns the method used."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        return "fadvise"


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    r = fn()
    return time.perf_counter() - t, r


def odirect_write(path: str, nbytes: int) -> None:
    buf = mmap.mmap(-1, CHUNK)  # page aligned, as O_DIRECT requires
    buf.write(os.urandom(1 << 20) * (CHUNK >> 20))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        done = 0
        while done < nbytes:
            done += os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)


def pagecache_write(path: str, tensors: list[torch.Tensor]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            os.write(fd, t.reshape(-1).view(torch.uint8).numpy())
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save(path: str, state: dict[str, Any]) -> None:
    with open(path, "wb") as f:
        torch.save(
            {"model": state["model"].state_dict(), "optimizer": state["optimizer"].state_dict()}, f
        )
        f.flush()
        os.fsync(f.fileno())


def cold_read(path: str, *, sequential: bool = False) -> int:
    """Bytes of ``path`` read front to back into a reused CHUNK buffer; ``sequential``
    first advises ``POSIX_FADV_SEQUENTIAL`` (Linux doubles the readahead window)."""
    buf = bytearray(CHUNK)
    n = 0
    with open(path, "rb", buffering=0) as f:
        if sequential:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while got := f.readinto(buf):
            n += got
    return n


class RssPeak:
    """Samples resident memory (bytes) every 2 ms in a thread."""

    def __init__(self) -> None:
        self.base = self._rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> RssPeak:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._rss())


def run(size_gib: float, root: str) -> dict[str, Any]:
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    state = build_state(size_gib)
    nbytes = state_bytes(state)
    tensors = _tensors(state)
    rows: dict[str, Any] = {"state_bytes": nbytes, "saves": {}, "loads": {}}
    odirect_write(f"{root}/warmup", 256 << 20)  # the first write of a run is slow: discard
    os.unlink(f"{root}/warmup")
    s = rows["saves"]
    s["O_DIRECT write + fsync"] = timed(lambda: odirect_write(f"{root}/odirect", nbytes))[0]
    s["page-cache write + fsync"] = timed(lambda: pagecache_write(f"{root}/pagecache", tensors))[0]
    s["torch.save + fsync"] = timed(lambda: torch_save(f"{root}/torch.pt", state))[0]
    plain = ckrun.Checkpointer(
        storage=LocalStorage(f"{root}/plain", direct=False, write_behind=False),
        rng=False,
        lock=False,
    )
    s["ckrun save (no write-behind)"] = timed(lambda: plain.save(1, state))[0]
    behind = ckrun.Checkpointer(
        storage=LocalStorage(f"{root}/direct", direct=False), rng=False, lock=False
    )
    s["ckrun save (page cache + write-behind)"] = timed(lambda: behind.save(1, state))[0]
    shutil.rmtree(f"{root}/plain")
    shutil.rmtree(f"{root}/direct")
    ck = ckrun.Checkpointer(storage=f"{root}/ckrun", rng=False, lock=False)
    with RssPeak() as rss:
        dt, m = timed(lambda: ck.save(1, state))
    s["ckrun save"] = dt
    rows["ckrun_file_bytes"] = m.total_size_bytes
    rows["torch_file_bytes"] = os.path.getsize(f"{root}/torch.pt")
    rows["save_extra_rss_bytes"] = rss.peak - rss.base
    shard = os.path.join(root, "ckrun", m.shards[0].key)
    files = [shard, f"{root}/torch.pt", f"{root}/odirect", f"{root}/pagecache"]
    tensors.clear()
    ld = rows["loads"]
    rows["cache_drop"] = drop_cache(files)
    ld["cold read (file → reused buffer)"] = timed(lambda: cold_read(shard))[0]

    def tload(mmap_: bool, touch: bool = False) -> None:
        sd = torch.load(f"{root}/torch.pt", weights_only=True, mmap=mmap_)
        state["model"].load_state_dict(sd["model"])
        state["optimizer"].load_state_dict(sd["optimizer"])
        if touch:  # mmap is lazy: read one element per 4 KiB page of the optimizer state
            for st in state["optimizer"].state.values():
                for v in st.values():
                    if torch.is_tensor(v) and v.numel() > 1:
                        v.view(-1)[:: 4096 // v.element_size()].sum()

    drop_cache(files)
    ld["torch.load(weights_only) → model+opt"] = timed(lambda: tload(False))[0]
    drop_cache(files)
    ld["torch.load(mmap=True) → model+opt"] = timed(lambda: tload(True))[0]
    drop_cache(files)
    ld["torch.load(mmap=True) → model+opt, pages touched"] = timed(lambda: tload(True, True))[0]
    drop_cache(files)
    loader = ckrun.Checkpointer(storage=f"{root}/ckrun", rng=False, lock=False)
    ld["ckrun load → model+opt"] = timed(lambda: loader.load(state))[0]
    drop_cache(files)  # cold read again; the faster of the two is the baseline
    again = timed(lambda: cold_read(shard))[0]
    ld["cold read (file → reused buffer)"] = min(again, ld["cold read (file → reused buffer)"])
    shutil.rmtree(root, ignore_errors=True)
    return rows


def table(r: dict[str, Any]) -> str:
    n = r["state_bytes"]
    size_of = {
        "torch.save + fsync": r["torch_file_bytes"],
        "ckrun save": r["ckrun_file_bytes"],
        "ckrun save (no write-behind)": r["ckrun_file_bytes"],
        "ckrun save (page cache + write-behind)": r["ckrun_file_bytes"],
    }
    lines = [
        f"state: {n / (1 << 30):.2f} GiB ({n} bytes); torch {sys.modules['torch'].__version__}"
        f"; page cache dropped with {r['cache_drop']}",
        "",
        "| operation | seconds | GB/s |",
        "|---|---:|---:|",
    ]
    rate = {}
    for k, dt in r["saves"].items():
        rate[k] = size_of.get(k, n) / dt / GB
        lines.append(f"| save: {k} | {dt:.3f} | {rate[k]:.2f} |")
    for k, dt in r["loads"].items():
        size = r["torch_file_bytes"] if k.startswith("torch") else r["ckrun_file_bytes"]
        rate[k] = size / dt / GB
        lines.append(f"| load: {k} | {dt:.3f} | {rate[k]:.2f} |")
    ck, cold = rate["ckrun save"], rate["cold read (file → reused buffer)"]
    wb = rate["ckrun save (page cache + write-behind)"]
    ld = rate["ckrun load → model+opt"]
    lines += [
        "",
        f"ckrun save / O_DIRECT limit: {ck / rate['O_DIRECT write + fsync']:.2f}× (target ≥ 0.75)",
        f"ckrun save / torch.save: {ck / rate['torch.save + fsync']:.2f}× (target ≥ 1.5)",
        f"ckrun save / page-cache write: {ck / rate['page-cache write + fsync']:.2f}×",
        f"write-behind gain (page cache): {wb / rate['ckrun save (no write-behind)']:.2f}×",
        f"O_DIRECT writer (default) / write-behind: {ck / wb:.2f}×",
        f"ckrun load / cold read: {ld / cold:.2f}× (target ≥ 1.0)",
        f"ckrun load / torch.load: {ld / rate['torch.load(weights_only) → model+opt']:.2f}×",
        f"extra RSS during ckrun save: {r['save_extra_rss_bytes'] / (1 << 20):.1f} MiB = "
        f"{100 * r['save_extra_rss_bytes'] / n:.1f} % of the state (target ≤ 10 %)",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=0.25, help="state size in GiB [0.25]")
    ap.add_argument("--dir", default="/tmp/ckrun-bench", help="scratch directory (removed)")
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    ap.add_argument(
        "--throttle-mbps",
        type=float,
        default=150.0,
        help="also run on a loop device limited to this many MB/s (bench/throttle.py; "
        "needs root); 0: the quiet disk only [150]",
    )
    ap.add_argument(
        "--issue2",
        action="store_true",
        help="issue 2's single table instead (ckrun writers against the disk)",
    )
    ap.add_argument(
        "--sizes",
        default=None,
        help="issue 7's side-by-side table instead (bench/checkpoint_async.py): "
        "comma-separated GiB, e.g. 0.25,1 or 0.25,1,4",
    )
    ap.add_argument("--repeats", type=int, default=None, help="rounds per figure (median)")
    ap.add_argument(
        "--small-only",
        action="store_true",
        help="issue 19's small-save rows alone (1 MB and 40 MB states saved every few "
        "steps), on the quiet and the throttled disk",
    )
    ap.add_argument(
        "--compute-s", type=float, default=3.0, help="seconds of matmul per compute-loop figure [3]"
    )
    a = ap.parse_args()
    out: Any
    if a.sizes:
        import checkpoint_async as ca

        rows = []
        for size in (float(x) for x in a.sizes.split(",")):
            rows.append(ca.run(size, a.dir, a.repeats or 3, a.compute_s))
            print(f"# {size:g} GiB done", file=sys.stderr, flush=True)
        print(ca.table(rows))
        out = rows
    elif a.issue2:
        out = run(a.size_gib, a.dir)
        print(table(out))
    else:
        import tempfile

        import regimes
        import throttle

        # a fresh probe per run (its GB/s in the table), not one remembered in ~/.cache
        os.environ.setdefault("CKRUN_CACHE_DIR", tempfile.mkdtemp(prefix="ckrun-bench-probe-"))
        out = {}
        reps = a.repeats or 2
        if a.small_only:
            return _small_only(a, reps)
        out["quiet"] = regimes.run(a.size_gib, a.dir, reps)
        print(regimes.table(out["quiet"], f"quiet disk: {a.dir}"), flush=True)
        if a.throttle_mbps > 0:
            size = int(max(1 << 30, 5 * out["quiet"]["state_bytes"] + (512 << 20)))
            scratch = os.path.dirname(os.path.abspath(a.dir))
            with throttle.throttled_dir(scratch, size, a.throttle_mbps) as (d, how):
                out["throttled"] = regimes.run(a.size_gib, os.path.join(d, "b"), reps)
                out["throttled"]["throttle"] = how
            print()
            print(
                regimes.table(out["throttled"], f"throttled disk: {a.throttle_mbps:g} MB/s, {how}")
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _small_only(a: argparse.Namespace, reps: int) -> int:
    """``--small-only``: the small-save rows on the quiet and the throttled disk."""
    import regimes
    import throttle

    out: dict[str, Any] = {"quiet": regimes.run_small(a.dir, reps)}
    print(regimes.small_table(out["quiet"], f"quiet disk: {a.dir}"), flush=True)
    if a.throttle_mbps > 0:
        scratch = os.path.dirname(os.path.abspath(a.dir))
        with throttle.throttled_dir(scratch, 1 << 30, a.throttle_mbps) as (d, how):
            out["throttled"] = regimes.run_small(os.path.join(d, "b"), reps)
            out["throttled"]["throttle"] = how
        print()
        print(regimes.small_table(out["throttled"], f"throttled disk: {a.throttle_mbps:g} MB/s"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
