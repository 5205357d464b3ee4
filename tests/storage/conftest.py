"""Fixtures of the Storage contract suite.

``storage`` is parametrized over :data:`BACKENDS`; each name ``X`` needs a fixture
``X_storage`` returning an empty Storage.  Adding a backend is one line in BACKENDS
(e.g. ``pytest.param("s3", marks=pytest.mark.s3)``) plus its ``s3_storage`` fixture.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ckrun.storage.local import LocalStorage

# S3 backend: moto's server on 127.0.0.1 (s3_server.py, owned by the spot/S3 work).
from s3_server import fault_proxy, moto_s3, s3_storage  # noqa: F401

BACKENDS: list[Any] = ["local", "local_buffered", pytest.param("s3", marks=pytest.mark.s3)]


@pytest.fixture
def local_storage(tmp_path: Path) -> LocalStorage:
    """The default LocalStorage (O_DIRECT streaming writes where supported)."""
    return LocalStorage(str(tmp_path / "root"))


@pytest.fixture
def local_buffered_storage(tmp_path: Path) -> LocalStorage:
    """LocalStorage writing through the page cache with sync_file_range write-behind."""
    return LocalStorage(str(tmp_path / "root"), direct=False)


@pytest.fixture(params=BACKENDS)
def storage(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_storage")


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    return r.returncode == 0


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs (needs root / CAP_SYS_ADMIN; skipped otherwise)."""
    mnt = tmp_path / "small"
    if os.geteuid() != 0 or not _mount_tmpfs(mnt, "2m"):
        pytest.skip("mounting a small tmpfs needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def ro_fs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs with one file, remounted read-only (root only, else skipped)."""
    mnt = tmp_path / "ro"
    if os.geteuid() != 0 or not _mount_tmpfs(mnt, "4m"):
        pytest.skip("mounting a tmpfs needs root")
    (mnt / "existing").write_bytes(b"x")
    r = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True)
    if r.returncode != 0:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        pytest.skip("cannot remount read-only")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fork_call(fn: Callable[[], object]) -> int:
    """Fork; the child calls ``fn`` and exits 0 if it returns, 1 if it raises (it never
    returns here).  Returns the child's pid in the parent."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            fn()
            code = 0
        finally:
            os._exit(code)
    return pid


@pytest.fixture
def fork_call() -> Callable[[Callable[[], object]], int]:
    """:func:`_fork_call`: run a function in a forked child; returns its pid."""
    return _fork_call


def _reap(pid: int, limit_s: float = 20) -> int | None:
    """The exit code of forked child ``pid``, or None (and the child killed) when it
    has not exited within ``limit_s`` seconds: a bounded wait for a child that may hang."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


@pytest.fixture
def reap_child() -> Callable[[int], int | None]:
    """:func:`_reap`: wait, bounded, for a forked child; None if it hung (killed)."""
    return _reap
