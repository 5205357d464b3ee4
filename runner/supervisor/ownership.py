"""The supervisor's hold on the run's lease (DESIGN.md §7; :mod:`ckrun.checkpoint.lease`).

:class:`Ownership` acquires the lease before preflight (waiting up to
``wait_for_lease_s`` for another owner to release it or go silent for its TTL, else
:class:`ckrun.errors.LeaseHeld`, exit 2 naming the holder), renews it from a heartbeat
thread every ``heartbeat_s`` (a slow storage request never stalls the supervisor's loop,
which keeps handling notices), and releases it when the supervisor exits.  A refused
renewal means another supervisor took the run over: :attr:`Ownership.lost` is set and
the loop turns it into a ``lease_lost`` notice (the child is told and stops; its commit
is refused by fencing) and exits 2 without requeueing.

The epoch held goes to the child as ``CKRUN_LEASE_EPOCH``.  A renewal that fails for a
storage error is retried at the next beat; the lease is lost only when the storage says
so (a conditional write refused), never by this machine's own guess.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from ckrun.checkpoint.lease import Lease, LeaseRecord
from ckrun.config import RunConfig
from ckrun.errors import LeaseLost, StorageError
from ckrun.storage.base import Storage

log = logging.getLogger(__name__)


def wait_for_lease_s(cfg: RunConfig, environ: dict[str, str] | None = None) -> float:
    """Seconds to wait for the lease: the configured value, or the default of
    :attr:`ckrun.config.RunConfig.wait_for_lease_s` (``2 * lease_ttl_s`` for a booting or
    requeued attempt: a cloud profile, a requeued Slurm job, a Kubernetes pod; else 0)."""
    if cfg.sources.get("wait_for_lease_s", "default") != "default":
        return cfg.wait_for_lease_s
    env = os.environ if environ is None else environ
    requeued = env.get("SLURM_RESTART_COUNT", "0").strip() not in ("", "0")
    # every pod start is a (re)boot; a pod as the k8s backend detects one
    # (:func:`ckrun.scheduler.k8s.current_from_env`): the Downward API's job name that
    # ckrun's rendered Job gives every pod, or the API server's address
    pod = bool(env.get("CKRUN_K8S_JOB_NAME") or env.get("KUBERNETES_SERVICE_HOST"))
    return 2 * cfg.lease_ttl_s if cfg.notice_sources or requeued or pod else 0.0


class Ownership:
    """Acquire, heartbeat and release the run's lease for one supervisor.

    Args:
        cfg: the run config (``lease_ttl_s``, ``heartbeat_s``, ``wait_for_lease_s``).
        storage: the run root.
        job_id, attempt: recorded as the holder.
        say: prints a ``[ckrun]`` line.

    Attributes:
        lease: the underlying :class:`ckrun.checkpoint.lease.Lease`.
        lost: the loss message once another owner took over (set by the heartbeat).
    """

    def __init__(
        self,
        cfg: RunConfig,
        storage: Storage,
        *,
        job_id: str | None,
        attempt: int,
        say: Callable[[str], None],
    ) -> None:
        self.cfg = cfg
        self.lease = Lease(storage, cfg.run, ttl_s=cfg.lease_ttl_s, job_id=job_id, attempt=attempt)
        self.say = say
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()

    @property
    def epoch(self) -> int | None:
        """The epoch held (None when not held)."""
        return self.lease.epoch

    def acquire(self) -> LeaseRecord:
        """Acquire (waiting as configured) and start the heartbeat thread.

        Raises:
            LeaseHeld: another owner holds the run (exit 2, naming it).
            StorageError: the lease cannot be read or written.
        """
        wait = wait_for_lease_s(self.cfg)

        def waiting(held: LeaseRecord) -> None:
            who = held.holder.describe() if held.holder else "another owner"
            self.say(
                f"run is owned by {who} (lease epoch {held.epoch}); waiting up to {wait:g} s "
                f"for its lease to be released or to expire (TTL {held.ttl_s:g} s)"
            )

        rec = self.lease.acquire(wait, on_wait=waiting if wait > 0 else None)
        self.say(f"holding the run's lease, epoch {rec.epoch} (TTL {rec.ttl_s:g} s)")
        self._thread = threading.Thread(target=self._beat, name="ckrun-lease", daemon=True)
        self._thread.start()
        return rec

    def _beat(self) -> None:
        while not self._stop.wait(self.cfg.heartbeat_s):
            if self.check() is not None:
                return

    def check(self) -> str | None:
        """Renew now; the loss message when the lease was lost (also kept in :attr:`lost`)."""
        with self._mutex:
            if self.lost is not None or self.lease.epoch is None:
                return self.lost
            try:
                self.lease.renew()
            except LeaseLost as e:
                self.lost = str(e)
            except StorageError as e:  # transient: the next beat retries
                log.warning("lease renewal of run %s failed (retrying): %s", self.cfg.run, e)
            return self.lost

    def release(self) -> None:
        """Stop the heartbeat and release the lease (idempotent; never raises)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, self.cfg.heartbeat_s))
        with self._mutex:
            if self.lost is None:
                self.lease.release()
