"""moto's S3 server on 127.0.0.1 for the S3 tests, plus a fault-injecting loopback proxy.

``moto_s3`` (session fixture) starts ``moto.server.ThreadedMotoServer`` on a free port:
a real HTTP S3 API (multipart, ``If-None-Match``, checksums stored and returned).  It sets
dummy credentials (moto accepts any) and ``AWS_ENDPOINT_URL_S3`` for child processes.
``s3_storage`` gives each test its own fresh bucket.

:class:`FaultProxy` forwards requests to moto and answers the next N with an injected
status and S3 error body instead (a 500 storm, a 403 AccessDenied): the faults travel
over real HTTP, so botocore's own retry logic is what gets tested, not a mock.
"""

from __future__ import annotations

import http.client
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from ckrun.storage.s3 import S3Options, S3Storage

_CREDS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


class MotoS3:
    """A running moto server: ``endpoint`` URL and a plain boto3 ``client``."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def new_bucket(self) -> str:
        name = f"ckrun-{uuid.uuid4().hex[:12]}"
        self.client.create_bucket(Bucket=name)
        return name

    def storage(self, url_or_bucket: str, endpoint: str | None = None, **opts: Any) -> S3Storage:
        url = url_or_bucket if url_or_bucket.startswith("s3://") else f"s3://{url_or_bucket}"
        return S3Storage.from_url(url, S3Options(endpoint_url=endpoint or self.endpoint, **opts))

    def stop(self) -> None:
        self._server.stop()


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in _CREDS.items():
            mp.setenv(k, v)
        mp.delenv("AWS_PROFILE", raising=False)
        srv = MotoS3()
        mp.setenv("AWS_ENDPOINT_URL_S3", srv.endpoint)
        yield srv
        srv.stop()


@pytest.fixture
def s3_storage(moto_s3: MotoS3) -> S3Storage:
    """A fresh bucket, opened with a prefix (keys must not leak outside it)."""
    return moto_s3.storage(f"s3://{moto_s3.new_bucket()}/runs/test")


def s3_error_xml(code: str, message: str) -> bytes:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        f"<Message>{message}</Message><RequestId>ckrun-test</RequestId></Error>"
    ).encode()


class FaultProxy:
    """HTTP proxy to ``target`` that injects failures: ``fail_next(n, status, code, match)``.

    Attributes:
        endpoint: the proxy's URL (use it as ``endpoint_url``).
        forwarded, injected: request counts.
    """

    def __init__(self, target: str) -> None:
        self.target = target.removeprefix("http://")
        self.lock = threading.Lock()
        self.faults: list[tuple[int, bytes, str]] = []
        self.drops: list[tuple[str, int]] = []
        self.forwarded = 0
        self.injected = 0
        self.dropped = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def _any(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                with owner.lock:
                    i = next((i for i, f in enumerate(owner.faults) if f[2] in self.path), None)
                    fault = owner.faults.pop(i) if i is not None else None
                    j = None
                    if self.command == "GET":
                        j = next((j for j, d in enumerate(owner.drops) if d[0] in self.path), None)
                    # peek only: a drop is used by a body long enough to be cut
                    drop = owner.drops[j][1] if j is not None and not fault else None
                    if fault:
                        owner.injected += 1
                    else:
                        owner.forwarded += 1
                if fault:
                    status, payload, _ = fault
                    return self._send(status, [("Content-Type", "application/xml")], payload)
                conn = http.client.HTTPConnection(owner.target, timeout=60)
                hdrs = {k: v for k, v in self.headers.items() if k.lower() != "expect"}
                conn.request(self.command, self.path, body=body, headers=hdrs)
                resp = conn.getresponse()
                data = resp.read()
                skip = {"content-length", "transfer-encoding", "connection"}
                headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in skip]
                length = None
                if self.command == "HEAD":  # no body: pass the object's length through
                    length = int(resp.getheader("Content-Length") or 0)
                conn.close()
                if drop is not None and len(data) > drop:
                    with owner.lock:
                        k = next((k for k, d in enumerate(owner.drops) if d[0] in self.path), None)
                        cut = k is not None
                        if cut:
                            owner.drops.pop(k)
                            owner.dropped += 1
                    if cut:
                        return self._send_cut(resp.status, headers, data, drop)
                self._send(resp.status, headers, data, length)

            def _send_cut(
                self, status: int, headers: list[tuple[str, str]], data: bytes, cut: int
            ) -> None:
                """Announce the whole body, send ``cut`` bytes of it, close the socket."""
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[:cut])
                self.wfile.flush()
                self.close_connection = True
                import socket

                self.connection.shutdown(socket.SHUT_RDWR)

            def _send(
                self,
                status: int,
                headers: list[tuple[str, str]],
                data: bytes,
                length: int | None = None,
            ) -> None:
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data) if length is None else length))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def fail_next(
        self, n: int, status: int = 500, code: str = "InternalError", match: str = ""
    ) -> None:
        """Answer the next ``n`` requests whose path+query contains ``match`` with ``status``."""
        with self.lock:
            body = s3_error_xml(code, "injected by FaultProxy")
            self.faults.extend([(status, body, match)] * n)

    def drop_next(self, n: int, match: str, after_bytes: int) -> None:
        """Cut the body of the next ``n`` GETs whose path contains ``match`` and whose
        body is longer than ``after_bytes``, after ``after_bytes`` bytes: headers announce
        the whole body, then the connection closes (a connection dropped mid-download).
        Shorter GETs of the same key (a ranged read of a shard's header) pass untouched."""
        with self.lock:
            self.drops.extend([(match, after_bytes)] * n)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.fixture
def fault_proxy(moto_s3: MotoS3) -> Iterator[FaultProxy]:
    p = FaultProxy(moto_s3.endpoint)
    yield p
    p.close()


def child_env() -> dict[str, str]:
    """Environment for child processes that talk to the session's moto server."""
    return dict(os.environ)
