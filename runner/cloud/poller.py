"""Shared machinery of the cloud notice sources: HTTP helper and the polling thread.

A :class:`Poller` runs :meth:`Poller._round` on a daemon thread (first round at once),
counts and logs failures instead of raising them, and queues each notice once so that
:meth:`Poller.poll` (called from the supervisor's loop) never blocks.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import http.client
import logging
import queue
import socket
import threading
import urllib.parse
from collections.abc import Mapping
from typing import Any

from ckrun.errors import ConfigError
from ckrun.notices import Notice

log = logging.getLogger("ckrun.cloud")


class Transient(Exception):
    """A failure worth retrying on the next round (timeout, refused, 5xx, 429)."""


class Unexpected(Exception):
    """An answer that retrying will not fix by itself (400, 403...): logged as an error."""


def request(
    url: str,
    *,
    method: str = "GET",
    headers: Mapping[str, str] | None = None,
    timeout_s: float = 1.0,
    conn_holder: list[http.client.HTTPConnection] | None = None,
) -> tuple[int, http.client.HTTPMessage, bytes]:
    """One HTTP request on a fresh connection.

    Returns:
        (status, response headers, body bytes).

    Raises:
        Transient: connection errors, timeouts, 5xx and 429.
    """
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "", u.port, timeout=timeout_s)
    if conn_holder is not None:
        conn_holder[:] = [conn]
    path = u.path + (f"?{u.query}" if u.query else "")
    try:
        conn.request(method, path or "/", headers=dict(headers or {}))
        resp = conn.getresponse()
        body = resp.read()
    except (OSError, http.client.HTTPException) as exc:
        raise Transient(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
    finally:
        conn.close()
    if resp.status >= 500 or resp.status == 429:
        raise Transient(f"{method} {url}: HTTP {resp.status}")
    return resp.status, resp.headers, body


class Poller:
    """Base of the cloud sources: a daemon thread runs :meth:`_round` and queues notices.

    Attributes:
        name: source name (``"aws"``, ``"gcp"``, ``"azure"``).
        interval_s: seconds between rounds (and the back-off after a failure).
        stats: counters: ``rounds``, ``errors`` (all failed rounds), ``consecutive_errors``,
            ``notices``, plus source-specific ones; ``last_error`` (str or None).
    """

    name = "cloud"

    def __init__(self, *, interval_s: float, timeout_s: float, start: bool = True) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ConfigError(f"{self.name}: interval_s and timeout_s must be > 0")
        self.interval_s = float(interval_s)
        self.timeout_s = float(timeout_s)
        self.stats: dict[str, Any] = {
            "rounds": 0,
            "errors": 0,
            "consecutive_errors": 0,
            "notices": 0,
            "last_error": None,
        }
        self._queue: queue.Queue[Notice] = queue.Queue()
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._conn: list[http.client.HTTPConnection] = []
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    def start(self) -> None:
        """Start the polling thread (its first round runs immediately)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name=f"ckrun-notice-{self.name}", daemon=True
            )
            self._thread.start()

    def poll(self) -> Notice | None:
        """Return the next unreported notice, or None; never blocks, never raises."""
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stop the thread, aborting a hanging request; idempotent."""
        self._stop.set()
        for conn in list(self._conn):
            if conn.sock is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout_s + 1.0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            delay = self._safe_round()
            if delay > 0:
                self._stop.wait(delay)

    def _safe_round(self) -> float:
        """One round with error accounting; returns the seconds to wait before the next."""
        self.stats["rounds"] += 1
        try:
            delay = self._round()
        except (Transient, Unexpected, ValueError) as exc:
            if not self._stop.is_set():  # an aborted request at close() is no error
                self._count_error(exc)
            return self.interval_s
        except Exception as exc:  # a bug here must not kill the supervisor's poller
            log.exception("%s notice poller: unexpected error", self.name)
            self._count_error(exc)
            return self.interval_s
        if self.stats["consecutive_errors"]:
            log.info(
                "%s metadata endpoint answers again after %d failed rounds",
                self.name,
                self.stats["consecutive_errors"],
            )
            self.stats["consecutive_errors"] = 0
        return delay

    def _count_error(self, exc: Exception) -> None:
        self.stats["errors"] += 1
        self.stats["consecutive_errors"] += 1
        self.stats["last_error"] = str(exc)
        n = self.stats["consecutive_errors"]
        level = logging.DEBUG
        if isinstance(exc, Unexpected):
            level = logging.ERROR if n == 1 else logging.DEBUG
        elif n == 1 or n % 100 == 0:
            level = logging.WARNING
        log.log(
            level,
            "%s notice poller: %s (%d in a row; retrying every %.1f s)",
            self.name,
            exc,
            n,
            self.interval_s,
        )

    def _emit(self, key: str, notice: Notice) -> None:
        """Queue ``notice`` unless a notice with ``key`` was already reported."""
        if key in self._seen:
            return
        self._seen.add(key)
        self.stats["notices"] += 1
        log.warning(
            "%s notice: %s, deadline %s (%.0f s left)",
            self.name,
            notice.kind,
            notice.deadline_utc.isoformat(),
            notice.seconds_left(),
        )
        self._queue.put(notice)

    def _round(self) -> float:
        """Ask the endpoint once; return the delay before the next round."""
        raise NotImplementedError


def parse_time(s: str, default: dt.datetime) -> dt.datetime:
    """Parse ISO-8601 (AWS) or RFC 1123 (Azure ``NotBefore``) as aware UTC, else default."""
    s = s.strip()
    if not s:
        return default
    try:
        t = dt.datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        try:
            t = email.utils.parsedate_to_datetime(s)
        except (TypeError, ValueError):
            log.warning("unparseable notice time %r; using the default lead", s)
            return default
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)
