"""A STUB of the Kubernetes API server on 127.0.0.1, for the k8s client tests.

No real API server can run on these machines.  This stub speaks just enough of the REST
API (https://kubernetes.io/docs/reference/kubernetes-api/) for ckrun's calls:

* ``POST   /apis/batch/v1/namespaces/{ns}/jobs``         201, or 409 ``AlreadyExists``
* ``GET    /apis/batch/v1/namespaces/{ns}/jobs/{name}``  200, or 404 ``NotFound``
* ``DELETE /apis/batch/v1/namespaces/{ns}/jobs/{name}``  200, or 404 ``NotFound``
* ``GET    /api/v1/namespaces/{ns}/pods?labelSelector=k=v``  the pods the test seeded

Errors are ``v1.Status`` bodies like the real server's.  It runs no Job controller: tests
seed pods and Job status themselves (:meth:`StubApi.set_pods`, :meth:`StubApi.patch_job`).
A namespace named ``forbidden`` answers 403 to everything, like missing RBAC.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class StubApi:
    """The stub's state and server thread.  Use as a context manager."""

    def __init__(self) -> None:
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> StubApi:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def write_kubeconfig(self, path: Path, token: str = "stub-token") -> Path:
        """A kubeconfig pointing at the stub with a bearer token."""
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "stub",
                    "clusters": [{"name": "stub", "cluster": {"server": self.url}}],
                    "users": [{"name": "stub", "user": {"token": token}}],
                    "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub"}}],
                }
            )
        )
        return path

    def set_pods(self, ns: str, job: str, pods: list[dict[str, Any]]) -> None:
        """Seed the pods a Job controller would have created (labelled with the job)."""
        for p in pods:
            p.setdefault("metadata", {}).setdefault("labels", {})[
                "batch.kubernetes.io/job-name"
            ] = job
        with self.lock:
            self.pods[(ns, job)] = pods

    def patch_job(self, ns: str, name: str, status: dict[str, Any]) -> None:
        """Set a Job's ``.status`` as the controller would."""
        with self.lock:
            self.jobs[(ns, name)]["status"] = status

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _reply(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self) -> tuple[list[str], dict[str, list[str]], Any]:
                url = urlsplit(self.path)
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                with stub.lock:
                    stub.requests.append(
                        {
                            "method": self.command,
                            "path": url.path,
                            "query": parse_qs(url.query),
                            "body": body,
                            "authorization": self.headers.get("Authorization"),
                        }
                    )
                return url.path.strip("/").split("/"), parse_qs(url.query), body

            def do_POST(self) -> None:
                parts, _, body = self._record()
                if parts[:3] != ["apis", "batch", "v1"] or len(parts) != 6 or parts[5] != "jobs":
                    return self._reply(404, _status(404, "NotFound", "no such path"))
                ns = parts[4]
                if ns == "forbidden":
                    return self._reply(
                        403,
                        _status(403, "Forbidden", "jobs.batch is forbidden: User cannot create"),
                    )
                name = body["metadata"]["name"]
                with stub.lock:
                    if (ns, name) in stub.jobs:
                        return self._reply(
                            409,
                            _status(409, "AlreadyExists", f'jobs.batch "{name}" already exists'),
                        )
                    obj = json.loads(json.dumps(body))
                    obj["metadata"].update(
                        uid=str(uuid.uuid4()),
                        resourceVersion="1",
                        creationTimestamp=dt.datetime.now(dt.timezone.utc).strftime(
                            "%Y-%m-%dT%H:%M:%SZ"
                        ),
                    )
                    obj["status"] = {}
                    stub.jobs[(ns, name)] = obj
                self._reply(201, obj)

            def do_GET(self) -> None:
                parts, query, _ = self._record()
                if parts[:2] == ["api", "v1"] and len(parts) == 5 and parts[4] == "pods":
                    key, _, value = query.get("labelSelector", [""])[0].partition("=")
                    assert key == "batch.kubernetes.io/job-name", key
                    with stub.lock:
                        items = list(stub.pods.get((parts[3], value), []))
                    return self._reply(
                        200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}
                    )
                if parts[:3] == ["apis", "batch", "v1"] and len(parts) == 7:
                    with stub.lock:
                        obj = stub.jobs.get((parts[4], parts[6]))
                    if obj is None:
                        return self._reply(
                            404, _status(404, "NotFound", f'jobs.batch "{parts[6]}" not found')
                        )
                    return self._reply(200, obj)
                self._reply(404, _status(404, "NotFound", "no such path"))

            def do_DELETE(self) -> None:
                parts, _, _ = self._record()
                if parts[:3] != ["apis", "batch", "v1"] or len(parts) != 7:
                    return self._reply(404, _status(404, "NotFound", "no such path"))
                with stub.lock:
                    obj = stub.jobs.pop((parts[4], parts[6]), None)
                    stub.pods.pop((parts[4], parts[6]), None)
                if obj is None:
                    return self._reply(
                        404, _status(404, "NotFound", f'jobs.batch "{parts[6]}" not found')
                    )
                self._reply(
                    200,
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Success",
                        "details": {"name": parts[6]},
                    },
                )

        return Handler
