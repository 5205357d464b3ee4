"""The run's lease object ``locks/lease.json``: its record, its holder, and reading it.

The protocol (acquire, renew, release, expiry, fencing) is in
:mod:`ckrun.checkpoint.lease`; this module is the data it works on.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from dataclasses import dataclass
from typing import Any

from ckrun.checkpoint import layout
from ckrun.errors import CorruptCheckpoint, ObjectNotFound
from ckrun.storage.base import Storage

FORMAT = "ckrun.lease"
FORMAT_VERSION = 1
EPOCH_ENV = "CKRUN_LEASE_EPOCH"
DEFAULT_TTL_S = 60.0


def authority(storage: Storage) -> Storage:
    """The tier where the lease lives: the durable remote tier of a two-tier storage."""
    remote = getattr(storage, "remote", None)
    return remote if isinstance(remote, Storage) else storage


def machine_id() -> str:
    """``CKRUN_MACHINE_ID``, else ``<boot id>/<pid namespace inode>`` (one kernel's pids)."""
    env = os.environ.get("CKRUN_MACHINE_ID")
    if env:
        return env
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return f"host:{socket.gethostname()}"
    return f"{boot}/{ns}"


def process_started(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            tail = f.read().rsplit(")", 1)[1].split()
        return int(tail[19])
    except (OSError, IndexError, ValueError):
        return None


@dataclass(frozen=True)
class Holder:
    """Who holds the lease.

    Attributes:
        host: hostname; pid: the supervisor's pid; job_id: the scheduler's job id (or
        None); attempt: the run's attempt number at acquisition; machine: see
        :func:`machine_id`; started: the pid's start time (ticks), to tell a reused pid;
        token: random, unique to this acquisition.
    """

    host: str
    pid: int
    job_id: str | None
    attempt: int
    machine: str
    started: int | None
    token: str

    @classmethod
    def this_process(cls, *, job_id: str | None = None, attempt: int = 0) -> Holder:
        """The calling process as a holder (fresh token)."""
        pid = os.getpid()
        return cls(
            socket.gethostname(),
            pid,
            job_id,
            attempt,
            machine_id(),
            process_started(pid),
            secrets.token_hex(8),
        )

    def describe(self) -> str:
        """``host H pid P job J attempt A`` for messages."""
        job = f" job {self.job_id}" if self.job_id else ""
        return f"host {self.host} pid {self.pid}{job} attempt {self.attempt}"

    def provably_dead(self) -> bool:
        """True when the holder ran on this machine and its process is gone."""
        if self.machine != machine_id():
            return False
        started = process_started(self.pid)
        return started is None or (self.started is not None and started != self.started)


@dataclass(frozen=True)
class LeaseRecord:
    """A parsed ``locks/lease.json`` (see the module docstring)."""

    run: str
    epoch: int
    holder: Holder | None
    ttl_s: float
    renewals: int
    acquired_utc: str
    renewed_utc: str
    expires_utc: str

    def dumps(self) -> bytes:
        """Strict JSON bytes (every write differs: ``renewals`` or the token changes)."""
        body: dict[str, Any] = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "run": self.run,
            "epoch": self.epoch,
            "holder": None if self.holder is None else self.holder.__dict__,
            "ttl_s": self.ttl_s,
            "renewals": self.renewals,
            "acquired_utc": self.acquired_utc,
            "renewed_utc": self.renewed_utc,
            "expires_utc": self.expires_utc,
        }
        return json.dumps(body, sort_keys=True, indent=1).encode()

    @classmethod
    def loads(cls, data: bytes) -> LeaseRecord:
        """Parse a lease object.

        Raises:
            CorruptCheckpoint: not a ckrun lease document (the message names the fix).
        """
        try:
            obj = json.loads(data)
            if obj.get("format") != FORMAT or obj.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"format {obj.get('format')!r} {obj.get('format_version')!r}")
            h = obj["holder"]
            holder = None if h is None else Holder(**{k: h[k] for k in Holder.__dataclass_fields__})
            rec = cls(
                str(obj["run"]),
                int(obj["epoch"]),
                holder,
                float(obj["ttl_s"]),
                int(obj["renewals"]),
                str(obj["acquired_utc"]),
                str(obj["renewed_utc"]),
                str(obj["expires_utc"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpoint(
                f"{layout.LEASE} is not a ckrun lease ({e}); if no supervisor of this run is "
                "alive, delete it and start again",
                key=layout.LEASE,
            ) from e
        if rec.epoch < 1 or rec.ttl_s <= 0:
            raise CorruptCheckpoint(f"{layout.LEASE}: invalid epoch or ttl_s", key=layout.LEASE)
        return rec


def read_lease(storage: Storage) -> tuple[LeaseRecord, str] | None:
    """The run's lease and its version token, or None when it has none.

    Raises:
        CorruptCheckpoint: the lease object is not a lease; StorageError: storage failed.
    """
    try:
        data, version = authority(storage).get_versioned(layout.LEASE)
    except ObjectNotFound:
        return None
    return LeaseRecord.loads(data), version
