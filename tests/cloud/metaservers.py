"""Loopback cloud metadata servers (stdlib ``http.server``) that behave like the real ones.

No emulator of the spot notices exists (moto's IMDS answers ``spot/instance-action`` with
HTTP 500, DESIGN.md §6), so these servers implement the documented behaviour the pollers
rely on, including the ways a careless client gets refused:

* :class:`AwsImds`: IMDSv2 only (``HttpTokens=required``): token PUT needs the TTL
  header (1..21600, else 400), meta-data GETs need a valid unexpired token (else 401);
  ``spot/instance-action`` and ``events/recommendations/rebalance`` are 404 until armed.
* :class:`GcpMetadata`: ``Metadata-Flavor: Google`` required (else 403), answers carry
  ``Metadata-Flavor`` and ``ETag``; ``wait_for_change=true`` hangs until the value's ETag
  differs from ``last_etag`` (or ``timeout_sec`` passes).
* :class:`AzureImds`: ``Metadata: true`` and ``api-version`` required (else 400);
  Scheduled Events document with ``DocumentIncarnation`` and ``Events``; ``NotBefore`` in
  RFC 1123; ``instance/compute/name`` in text format.

Faults common to all: :meth:`_Server.fail_next` (next N requests get a status, e.g. a 503
burst), :attr:`_Server.delay_s` (slow answers), and starting a server on a port chosen in
advance (connection refused until then).
"""

from __future__ import annotations

import datetime as dt
import email.utils
import hashlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ckrun.notices import Notice, NoticeSource


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_notice(src: NoticeSource, timeout_s: float = 5.0) -> Notice:
    """Call ``src.poll()`` like the supervisor's loop (every 10 ms) until a notice comes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = src.poll()
        if n is not None:
            return n
        time.sleep(0.01)
    raise AssertionError(f"no notice from {src.name} within {timeout_s} s")


def wait_until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet tests
        pass

    def _dispatch(self) -> None:
        owner = self.server.owner
        u = urlsplit(self.path)
        with owner.lock:
            owner.requests.append((self.command, u.path, dict(self.headers.items())))
            fail = owner.failures.pop(0) if owner.failures else None
            delay = owner.delay_s
        if delay:
            time.sleep(delay)
        if fail is not None:
            return self.reply(fail, b"injected failure")
        status, headers, body = owner.handle(self.command, u.path, parse_qs(u.query), self.headers)
        self.reply(status, body, headers)

    do_GET = do_PUT = do_POST = _dispatch

    def reply(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        try:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the client gave up (timeout): nothing to do


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: _Server


class _Server:
    """Base: a threaded loopback server; subclasses implement :meth:`handle`.

    Attributes:
        url: ``http://127.0.0.1:PORT``.
        requests: (method, path, headers) of every request, in arrival order.
        delay_s: seconds every answer is delayed by (a slow endpoint).
    """

    def __init__(self, port: int = 0) -> None:
        self.lock = threading.Condition()
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.failures: list[int] = []
        self.delay_s = 0.0
        self.closed = False
        self._httpd = _HTTPServer(("127.0.0.1", port), _Handler)
        self._httpd.owner = self
        self.port = int(self._httpd.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def fail_next(self, n: int, status: int = 503) -> None:
        """Answer the next ``n`` requests with ``status`` (a 5xx burst)."""
        with self.lock:
            self.failures.extend([status] * n)

    def count(self, method: str, path_suffix: str) -> int:
        """Number of requests seen with this method whose path ends with the suffix."""
        with self.lock:
            return sum(1 for m, p, _ in self.requests if m == method and p.endswith(path_suffix))

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.lock.notify_all()
        self._httpd.shutdown()
        self._httpd.server_close()

    def handle(
        self, method: str, path: str, query: dict[str, list[str]], headers: Any
    ) -> tuple[int, dict[str, str], bytes]:
        raise NotImplementedError


def iso(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class AwsImds(_Server):
    """EC2 IMDSv2 with ``HttpTokens=required``."""

    def __init__(self, port: int = 0) -> None:
        self.tokens: dict[str, float] = {}  # token -> monotonic expiry
        self.instance_action: dict[str, str] | None = None
        self.rebalance: dict[str, str] | None = None
        self.unauthorized = 0
        #: seconds a token outlives its TTL here (a test of refresh timing sets it: its
        #: client refreshes at 0.9 TTL, a 0.1 s margin with a 1 s TTL that a GIL stall of
        #: the in-process server can eat)
        self.expiry_grace_s = 0.0
        super().__init__(port)

    def arm(self, deadline_s: float = 120.0, action: str = "terminate") -> dt.datetime:
        """Schedule an interruption ``deadline_s`` from now; returns its time (whole s)."""
        t = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
        t += dt.timedelta(seconds=deadline_s)
        with self.lock:
            self.instance_action = {"action": action, "time": iso(t)}
        return t

    def arm_rebalance(self) -> None:
        with self.lock:
            self.rebalance = {"noticeTime": iso(dt.datetime.now(dt.timezone.utc))}

    def revoke_tokens(self) -> None:
        """Invalidate every token (as an IMDS restart would)."""
        with self.lock:
            self.tokens.clear()

    def handle(self, method, path, query, headers):  # type: ignore[no-untyped-def]
        if path == "/latest/api/token":
            if method != "PUT":
                return 405, {}, b""
            ttl = headers.get("X-aws-ec2-metadata-token-ttl-seconds")
            if ttl is None or not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return 400, {}, b"Bad Request"
            token = uuid.uuid4().hex
            with self.lock:
                self.tokens[token] = time.monotonic() + int(ttl) + self.expiry_grace_s
            return 200, {"X-aws-ec2-metadata-token-ttl-seconds": ttl}, token.encode()
        if not path.startswith("/latest/meta-data/"):
            return 404, {}, b"Not Found"
        token = headers.get("X-aws-ec2-metadata-token", "")
        with self.lock:
            valid = self.tokens.get(token, 0.0) > time.monotonic()
            if not valid:
                self.unauthorized += 1
                return 401, {}, b"Unauthorized"
            doc = {
                "/latest/meta-data/spot/instance-action": self.instance_action,
                "/latest/meta-data/events/recommendations/rebalance": self.rebalance,
            }.get(path)
        if doc is None:
            return 404, {}, b"Not Found"
        return 200, {"Content-Type": "text/plain"}, json.dumps(doc).encode()


class GcpMetadata(_Server):
    """GCE metadata server, ``instance/preempted`` only."""

    PATH = "/computeMetadata/v1/instance/preempted"

    def __init__(self, port: int = 0, preempted: bool = False) -> None:
        self.value = "TRUE" if preempted else "FALSE"
        self.hanging = 0  # requests currently held by wait_for_change
        super().__init__(port)

    @staticmethod
    def etag(value: str) -> str:
        return hashlib.sha1(value.encode()).hexdigest()[:16]

    def preempt(self) -> None:
        with self.lock:
            self.value = "TRUE"
            self.lock.notify_all()

    def handle(self, method, path, query, headers):  # type: ignore[no-untyped-def]
        if headers.get("Metadata-Flavor") != "Google":
            return 403, {}, b"Missing required header: Metadata-Flavor"
        if path != self.PATH:
            return 404, {"Metadata-Flavor": "Google"}, b"Not Found"
        with self.lock:
            if query.get("wait_for_change", [""])[0] == "true":
                last = query.get("last_etag", [""])[0]
                deadline = time.monotonic() + float(query.get("timeout_sec", ["300"])[0])
                self.hanging += 1
                try:
                    while (
                        self.etag(self.value) == last
                        and time.monotonic() < deadline
                        and not self.closed
                    ):
                        self.lock.wait(timeout=min(0.5, deadline - time.monotonic()))
                finally:
                    self.hanging -= 1
            value = self.value
        hdr = {
            "Metadata-Flavor": "Google",
            "ETag": self.etag(value),
            "Content-Type": "application/text",
        }
        return 200, hdr, value.encode()


class AzureImds(_Server):
    """Azure IMDS with Scheduled Events and ``instance/compute/name``."""

    def __init__(self, port: int = 0, vm_name: str = "vm-0") -> None:
        self.vm_name = vm_name
        self.incarnation = 1
        self.events: list[dict[str, Any]] = []
        super().__init__(port)

    def schedule(
        self,
        event_type: str = "Preempt",
        not_before_s: float = 30.0,
        resources: list[str] | None = None,
    ) -> dt.datetime:
        """Add an event; returns its NotBefore (whole seconds, RFC 1123 on the wire)."""
        nb = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
        nb += dt.timedelta(seconds=not_before_s)
        ev = {
            "EventId": str(uuid.uuid4()).upper(),
            "EventStatus": "Scheduled",
            "EventType": event_type,
            "ResourceType": "VirtualMachine",
            "Resources": resources if resources is not None else [self.vm_name],
            "NotBefore": email.utils.format_datetime(nb, usegmt=True),
            "Description": "",
            "EventSource": "Platform",
            "DurationInSeconds": -1,
        }
        with self.lock:
            self.events.append(ev)
            self.incarnation += 1
        return nb

    def handle(self, method, path, query, headers):  # type: ignore[no-untyped-def]
        if headers.get("Metadata") != "true":
            return 400, {}, b'{"error": "Bad request. Required metadata header not specified"}'
        if not query.get("api-version"):
            return 400, {}, b'{"error": "Bad request. api-version was not specified"}'
        if path == "/metadata/instance/compute/name":
            return 200, {"Content-Type": "text/plain"}, self.vm_name.encode()
        if path != "/metadata/scheduledevents":
            return 404, {}, b"Not Found"
        with self.lock:
            doc = {"DocumentIncarnation": self.incarnation, "Events": list(self.events)}
        return 200, {"Content-Type": "application/json"}, json.dumps(doc).encode()
