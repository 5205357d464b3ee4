"""A throttled disk for the benchmark (issue 19): ext4 on a loop device with a block-I/O
bandwidth limit, so one run shows the quiet and the throttled regime side by side.

The limit is the kernel's block throttle on the loop device's ``MAJ:MIN``:

* cgroup v2 ``io.max`` (``wbps=`` / ``rbps=``) when the v2 hierarchy has the ``io``
  controller: the bench process moves into a child cgroup ``ckrun-bench-<pid>``;
* else cgroup v1 ``blkio.throttle.write_bps_device`` / ``read_bps_device`` in the v1
  root group (the same blk-throttle code).  On a hybrid host (blkio bound to v1, as on
  the benchmark VM) the v2 ``io`` controller cannot be enabled, and v1 does not
  attribute page-cache write-back to a child group (it is issued by kernel flusher
  threads in the root group); a rule in the v1 root group on a device only this
  benchmark uses does throttle it all (write-back, ``O_DIRECT`` and reads; checked with
  ``dd``: 87 MB/s buffered + fsync and 99 MB/s ``O_DIRECT`` under a 100 MB/s limit).

Needs root (``losetup``, ``mount``, cgroup files).  Everything is undone on exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

V2 = "/sys/fs/cgroup"
V1 = "/sys/fs/cgroup/blkio"


def _sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _v2_io() -> bool:
    try:
        with open(f"{V2}/cgroup.controllers") as f:
            return "io" in f.read().split()
    except OSError:
        return False


@contextlib.contextmanager
def throttled_dir(scratch: str, size_bytes: int, mbps: float) -> Iterator[tuple[str, str]]:
    """Yield ``(directory, method)``: a fresh ext4 of ``size_bytes`` on a loop device
    backed by a file in ``scratch``, limited to ``mbps`` MB/s (10^6 bytes/s) of reads
    and of writes.

    Raises:
        RuntimeError: not root, or neither cgroup mechanism is usable (the message says
            which file refused the limit).
        subprocess.CalledProcessError: losetup/mkfs/mount failed.
    """
    if os.geteuid() != 0:
        raise RuntimeError("the throttled regime needs root (losetup, mount, cgroup files)")
    img = os.path.join(scratch, f"ckrun-bench-{os.getpid()}.img")
    mnt = os.path.join(scratch, f"ckrun-bench-{os.getpid()}.mnt")
    os.makedirs(scratch, exist_ok=True)
    with open(img, "wb") as f:
        f.truncate(size_bytes)
    loop = _sh("losetup", "--find", "--show", "--direct-io=on", img)
    undo: list[tuple[str, str]] = []
    cg = None
    try:
        _sh("mkfs.ext4", "-q", "-F", loop)
        os.makedirs(mnt, exist_ok=True)
        _sh("mount", loop, mnt)
        dev = _sh("lsblk", "-dno", "MAJ:MIN", loop).strip()
        bps = int(mbps * 1e6)
        if _v2_io():
            cg = f"{V2}/ckrun-bench-{os.getpid()}"
            os.makedirs(cg, exist_ok=True)
            _write(f"{cg}/io.max", f"{dev} rbps={bps} wbps={bps}")
            _write(f"{cg}/cgroup.procs", str(os.getpid()))
            method = f"cgroup v2 io.max on {dev} (loop)"
        elif os.path.exists(f"{V1}/blkio.throttle.write_bps_device"):
            for name in ("write_bps_device", "read_bps_device"):
                path = f"{V1}/blkio.throttle.{name}"
                _write(path, f"{dev} {bps}")
                undo.append((path, f"{dev} 0"))
            method = (
                f"cgroup v1 blkio.throttle (root group) on {dev} (loop, ext4); "
                "v2 io controller not available on this hybrid host"
            )
        else:
            raise RuntimeError(f"no block throttle: neither {V2}/io nor {V1} is available")
        yield mnt, method
    finally:
        for path, text in undo:
            with contextlib.suppress(OSError):
                _write(path, text)
        if cg is not None:
            with contextlib.suppress(OSError):
                _write(f"{V2}/cgroup.procs", str(os.getpid()))
                os.rmdir(cg)
        subprocess.run(["umount", mnt], check=False, capture_output=True)
        subprocess.run(["losetup", "-d", loop], check=False, capture_output=True)
        shutil.rmtree(mnt, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(img)
