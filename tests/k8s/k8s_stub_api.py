"""A STUB of the Kubernetes API server on 127.0.0.1, for the k8s client tests.

No real API server can run on these machines.  This stub speaks just enough of the REST
API (https://kubernetes.io/docs/reference/kubernetes-api/) for ckrun's calls:

* ``POST   /apis/batch/v1/namespaces/{ns}/jobs``         201, or 409 ``AlreadyExists``
* ``GET    /apis/batch/v1/namespaces/{ns}/jobs/{name}``  200, or 404 ``NotFound``
* ``DELETE /apis/batch/v1/namespaces/{ns}/jobs/{name}``  200, or 404 ``NotFound``
* ``GET    /api/v1/namespaces/{ns}/pods?labelSelector=k=v``  the pods the test seeded
* ``POST   /api/v1/namespaces/{ns}/services`` (``GET|DELETE .../services/{name}``)
* ``POST|GET|DELETE /apis/jobset.x-k8s.io/v1alpha2/namespaces/{ns}/jobsets[/{name}]``
  (404 on every path when :attr:`StubApi.jobset_installed` is False: no such CRD)

Errors are ``v1.Status`` bodies like the real server's.  It runs no Job controller: tests
seed pods and Job status themselves (:meth:`StubApi.set_pods`, :meth:`StubApi.patch_job`).
Of the garbage collector it does one thing: deleting a Job deletes the Services whose
``ownerReferences`` name its uid.  A namespace named ``forbidden`` answers 403 to
everything, like missing RBAC.
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
        self.services: dict[tuple[str, str], dict[str, Any]] = {}
        self.jobsets: dict[tuple[str, str], dict[str, Any]] = {}
        self.jobset_installed = True
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

    def set_pods(
        self,
        ns: str,
        job: str,
        pods: list[dict[str, Any]],
        label: str = "batch.kubernetes.io/job-name",
    ) -> None:
        """Seed the pods a controller would have created (labelled ``label=job``)."""
        for p in pods:
            p.setdefault("metadata", {}).setdefault("labels", {})[label] = job
        with self.lock:
            self.pods[(ns, job)] = pods

    def _store(self, parts: list[str]) -> tuple[dict[tuple[str, str], Any], str] | None:
        """The object store and kind of a collection or object path, else None."""
        if parts[:3] == ["apis", "batch", "v1"] and len(parts) in (6, 7) and parts[5] == "jobs":
            return self.jobs, "jobs.batch"
        if parts[:2] == ["api", "v1"] and len(parts) in (5, 6) and parts[4] == "services":
            return self.services, "services"
        if (
            parts[:3] == ["apis", "jobset.x-k8s.io", "v1alpha2"]
            and len(parts) in (6, 7)
            and parts[5] == "jobsets"
            and self.jobset_installed
        ):
            return self.jobsets, "jobsets.jobset.x-k8s.io"
        return None

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
                found = stub._store(parts)
                if found is None or parts[0] + str(len(parts)) not in ("api5", "apis6"):
                    return self._reply(404, _status(404, "NotFound", "no such path"))
                store, kind = found
                ns = parts[3] if parts[0] == "api" else parts[4]
                if ns == "forbidden":
                    return self._reply(
                        403,
                        _status(403, "Forbidden", f"{kind} is forbidden: User cannot create"),
                    )
                name = body["metadata"]["name"]
                with stub.lock:
                    if (ns, name) in store:
                        return self._reply(
                            409,
                            _status(409, "AlreadyExists", f'{kind} "{name}" already exists'),
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
                    store[(ns, name)] = obj
                self._reply(201, obj)

            def do_GET(self) -> None:
                parts, query, _ = self._record()
                if parts[:2] == ["api", "v1"] and len(parts) == 5 and parts[4] == "pods":
                    key, _, value = query.get("labelSelector", [""])[0].partition("=")
                    with stub.lock:
                        items = [
                            p
                            for p in stub.pods.get((parts[3], value), [])
                            if p["metadata"]["labels"].get(key) == value
                        ]
                    return self._reply(
                        200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}
                    )
                found = stub._store(parts)
                if (
                    found is not None
                    and len(parts) in (6, 7)
                    and parts[0] + str(len(parts))
                    in (
                        "api6",
                        "apis7",
                    )
                ):
                    store, kind = found
                    ns = parts[3] if parts[0] == "api" else parts[4]
                    with stub.lock:
                        obj = store.get((ns, parts[-1]))
                    if obj is None:
                        return self._reply(
                            404, _status(404, "NotFound", f'{kind} "{parts[-1]}" not found')
                        )
                    return self._reply(200, obj)
                self._reply(404, _status(404, "NotFound", "no such path"))

            def do_DELETE(self) -> None:
                parts, _, _ = self._record()
                found = stub._store(parts)
                if found is None or parts[0] + str(len(parts)) not in ("api6", "apis7"):
                    return self._reply(404, _status(404, "NotFound", "no such path"))
                store, kind = found
                ns, name = (parts[3] if parts[0] == "api" else parts[4]), parts[-1]
                with stub.lock:
                    obj = store.pop((ns, name), None)
                    if obj is not None and kind != "services":
                        stub.pods.pop((ns, name), None)
                        uid = obj["metadata"]["uid"]
                        for key, svc in list(stub.services.items()):  # the garbage collector
                            owners = svc["metadata"].get("ownerReferences") or []
                            if any(o.get("uid") == uid for o in owners):
                                del stub.services[key]
                if obj is None:
                    return self._reply(404, _status(404, "NotFound", f'{kind} "{name}" not found'))
                self._reply(
                    200,
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Success",
                        "details": {"name": name},
                    },
                )

        return Handler
