"""A loopback Kubernetes API server for ``mlaunch trainjob`` and ``status|logs|stop
trainjob/NAME``: a real HTTP server on 127.0.0.1 that the real ``kubernetes`` client talks to
through a real kubeconfig, speaking the API paths mlaunch uses and answering as the API does.

What it does (each request is checked, and recorded in :attr:`KubeDouble.requests`):

- authentication: every request must carry the kubeconfig's bearer token (else 401 ``Status``);
- ``GET/POST /apis/trainer.kubeflow.org/v1alpha1/namespaces/NS/trainjobs``: list (``limit``),
  create: JSON (no Content-Type reads as JSON, as the API server's first media type), the
  body a TrainJob of Trainer v2.3.0, strictly (Kubeflow's models, unknown
  fields refused: :func:`support.trainjob_model.strict_trainjob`), with the CRD's name rule
  (RFC 1035, at most 63), the body's namespace equal to the path's, no ``PET_*`` in
  ``spec.trainer.env`` (the Trainer webhook's rule); a second create of a name is 409
  ``AlreadyExists``; the stored object gets ``uid``, ``resourceVersion``,
  ``creationTimestamp``, ``spec.suspend: false`` and ``spec.managedBy`` (the CRD's defaults);
- ``GET/PATCH/DELETE .../trainjobs/NAME``: 404 ``NotFound`` for an unknown one; PATCH only as
  ``application/merge-patch+json`` (415 otherwise), applied per RFC 7386 and validated again;
  DELETE takes ``propagationPolicy`` and removes the TrainJob and its pods;
- ``GET /api/v1/namespaces/NS/pods?labelSelector=K=V``: the pods a test put there, selected by
  equality on one label;
- ``GET /api/v1/namespaces/NS/pods/POD/log`` (``container``, ``tailLines``, ``follow``): the
  pod's log text (``follow``: chunked, a line a chunk, then the stream's end, as for an ended
  container).

What it does not simulate (so what the suite cannot show): no Trainer controller, JobSet,
Job, scheduler or kubelet: creating a TrainJob makes no pod, sets no condition, and suspending
or deleting one sends no SIGTERM (a test puts pods, conditions and logs in by hand, as a
cluster would show them); no admission webhooks but the ``PET_*`` rule, no CEL rules but the
name's, no Kueue; no watch, and no ``follow`` stream that stays open while a container
writes; no field selectors, set-based label selectors, pagination (``continue``) or
server-side apply; no RBAC, TLS or token refresh; no OpenAPI discovery.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from support.trainjob_model import StrictModelError, strict_trainjob

TOKEN = "loopback-test-token"
_TJ = re.compile(r"/apis/trainer\.kubeflow\.org/v1alpha1/namespaces/([^/]+)/trainjobs(?:/([^/]+))?")
_PODS = re.compile(r"/api/v1/namespaces/([^/]+)/pods")
_LOG = re.compile(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/log")
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any


@dataclass
class KubeDouble:
    """The server's state: TrainJobs by (namespace, name), pods, logs; and what was asked."""

    trainjobs: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    logs: dict[tuple[str, str], str] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    port: int = 0
    serves_trainer: bool = True
    """False: a cluster without Kubeflow Trainer (its API paths are 404 NotFound)."""
    kubeconfig: Path | None = None
    on_change: Any = None
    """Called (under the lock) with (verb, namespace, name, object) after each PATCH or DELETE
    of a TrainJob: a test's stand-in for the controllers' reaction (e.g. its pods going)."""
    _version: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # ---- what a test puts in, as a cluster would show it

    def add_pod(
        self, namespace: str, trainjob: str, node: int, *, phase: str = "Running",
        log: str = "", container_state: dict[str, Any] | None = None,
        conditions: list[dict[str, Any]] | None = None, job: str = "node",
    ) -> str:  # fmt: skip
        """A pod of ``trainjob``'s JobSet, labelled as JobSet labels them."""
        name = f"{trainjob}-{job}-0-{node}-{uuid.uuid4().hex[:5]}"
        status: dict[str, Any] = {"phase": phase, "conditions": conditions or []}
        if container_state is not None:
            status["containerStatuses"] = [{"name": "node", "state": container_state}]
        self.pods[(namespace, name)] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {
                    "jobset.sigs.k8s.io/jobset-name": trainjob,
                    "jobset.sigs.k8s.io/replicatedjob-name": job,
                    "batch.kubernetes.io/job-completion-index": str(node),
                },
            },
            "spec": {"nodeName": f"worker-{node}", "containers": [{"name": "node"}]},
            "status": status,
        }
        self.logs[(namespace, name)] = log
        return name

    def set_condition(
        self, namespace: str, name: str, kind: str, reason: str, message: str
    ) -> None:
        tj = self.trainjobs[(namespace, name)]
        conditions = tj.setdefault("status", {}).setdefault("conditions", [])
        conditions[:] = [c for c in conditions if c["type"] != kind]
        conditions.append(
            {"type": kind, "status": "True", "reason": reason, "message": message,
             "lastTransitionTime": "2026-01-01T00:00:00Z"}
        )  # fmt: skip

    def calls(self) -> list[tuple[str, str]]:
        """(verb, path) of every request, in order."""
        return [(r.method, r.path) for r in self.requests]

    # ---- the API

    def handle(self, req: Request) -> tuple[int, Any, str]:
        """(status, body, content type) for one request."""
        with self._lock:
            self.requests.append(req)
            if req.headers.get("authorization") != f"Bearer {TOKEN}":
                return _status(401, "Unauthorized", "Unauthorized")
            if (m := _TJ.fullmatch(req.path)) and self.serves_trainer:
                return self._trainjobs(req, m.group(1), m.group(2))
            if m := _LOG.fullmatch(req.path):
                return self._log(req, m.group(1), m.group(2))
            if m := _PODS.fullmatch(req.path):
                return self._pods(req, m.group(1))
            return _status(
                404, "NotFound", f"the server could not find the requested resource ({req.path})"
            )

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    def _check(self, ns: str, body: Any) -> tuple[int, Any, str] | None:
        """The CRD's and the webhook's refusals, as the API answers them (422 Invalid)."""
        if (
            not isinstance(body, dict)
            or body.get("apiVersion") != "trainer.kubeflow.org/v1alpha1"
            or body.get("kind") != "TrainJob"
        ):
            return _status(
                400, "BadRequest", "the body is not a trainer.kubeflow.org/v1alpha1 TrainJob"
            )
        name = (body.get("metadata") or {}).get("name", "")
        if not _NAME.fullmatch(name) or len(name) > 63:
            return _status(
                422,
                "Invalid",
                f"TrainJob.trainer.kubeflow.org {name!r} is invalid: metadata.name must match RFC 1035 DNS label format",
            )
        if body["metadata"].get("namespace", ns) != ns:
            return _status(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on the request",
            )
        env = ((body.get("spec") or {}).get("trainer") or {}).get("env") or []
        reserved = sorted(e["name"] for e in env if str(e.get("name", "")).startswith("PET_"))
        if reserved:
            return _status(
                422,
                "Invalid",
                f"spec.trainer.env: must not have reserved envs, invalid envs configured: {reserved}",
            )
        try:
            strict_trainjob(body)
        except StrictModelError as exc:
            return _status(
                422, "Invalid", f"TrainJob.trainer.kubeflow.org {name!r} is invalid: {exc}"
            )
        return None

    def _trainjobs(self, req: Request, ns: str, name: str | None) -> tuple[int, Any, str]:
        if name is None:
            if req.method == "GET":
                items = [tj for (n, _), tj in sorted(self.trainjobs.items()) if n == ns]
                limit = int(req.query.get("limit", ["0"])[0] or 0)
                items = items[:limit] if limit else items
                return (
                    200,
                    {
                        "apiVersion": "trainer.kubeflow.org/v1alpha1",
                        "kind": "TrainJobList",
                        "metadata": {"resourceVersion": str(self._version)},
                        "items": items,
                    },
                    "application/json",
                )
            if req.method != "POST":
                return _status(405, "MethodNotAllowed", f"{req.method} is not supported here")
            ctype = req.headers.get("content-type", "").split(";")[0]
            if ctype not in ("", "application/json"):  # the API server's default is JSON
                return _status(415, "UnsupportedMediaType", f"unknown body format: {ctype}")
            if bad := self._check(ns, req.body):
                return bad
            name = req.body["metadata"]["name"]
            if (ns, name) in self.trainjobs:
                return _status(
                    409, "AlreadyExists", f'trainjobs.trainer.kubeflow.org "{name}" already exists'
                )
            tj = json.loads(json.dumps(req.body))
            meta = tj["metadata"]
            meta.update(
                namespace=ns,
                uid=str(uuid.uuid4()),
                resourceVersion=self._next_version(),
                generation=1,
                creationTimestamp="2026-01-01T00:00:00Z",
            )
            tj["spec"].setdefault("suspend", False)
            tj["spec"].setdefault("managedBy", "trainer.kubeflow.org/trainjob-controller")
            self.trainjobs[(ns, name)] = tj
            return 201, tj, "application/json"
        tj = self.trainjobs.get((ns, name))
        if tj is None:
            return _status(404, "NotFound", f'trainjobs.trainer.kubeflow.org "{name}" not found')
        if req.method == "GET":
            return 200, tj, "application/json"
        if req.method == "PATCH":
            ctype = req.headers.get("content-type", "").split(";")[0]
            if ctype != "application/merge-patch+json":
                return _status(
                    415,
                    "UnsupportedMediaType",
                    f"the body of the request was in an unknown format: {ctype}",
                )
            patched = _merge(json.loads(json.dumps(tj)), req.body)
            status = patched.pop("status", None)
            check = {k: v for k, v in patched.items()}
            check["metadata"] = {
                k: v
                for k, v in patched["metadata"].items()
                if k in ("name", "namespace", "labels", "annotations")
            }
            if bad := self._check(ns, check):
                return bad
            if status is not None:
                patched["status"] = tj.get("status", status)
            patched["metadata"]["resourceVersion"] = self._next_version()
            self.trainjobs[(ns, name)] = patched
            if self.on_change is not None:
                self.on_change("PATCH", ns, name, patched)
            return 200, patched, "application/json"
        if req.method == "DELETE":
            policy = req.query.get("propagationPolicy", [None])[0] or (req.body or {}).get(
                "propagationPolicy"
            )
            if policy not in (None, "Foreground", "Background", "Orphan"):
                return _status(400, "BadRequest", f"unknown propagationPolicy {policy!r}")
            del self.trainjobs[(ns, name)]
            if policy != "Orphan":
                for key in [
                    k
                    for k, p in self.pods.items()
                    if k[0] == ns
                    and p["metadata"]["labels"].get("jobset.sigs.k8s.io/jobset-name") == name
                ]:
                    del self.pods[key]
            return (
                200,
                {**tj, "metadata": {**tj["metadata"], "deletionTimestamp": "2026-01-01T00:00:01Z"}},
                "application/json",
            )
        return _status(405, "MethodNotAllowed", f"{req.method} is not supported here")

    def _pods(self, req: Request, ns: str) -> tuple[int, Any, str]:
        if req.method != "GET":
            return _status(405, "MethodNotAllowed", f"{req.method} is not supported here")
        selector = req.query.get("labelSelector", [""])[0]
        want = dict(part.split("=", 1) for part in selector.split(",") if part)
        items = [
            p for (n, _), p in sorted(self.pods.items())
            if n == ns and all(p["metadata"]["labels"].get(k) == v for k, v in want.items())
        ]  # fmt: skip
        return (
            200,
            {
                "apiVersion": "v1",
                "kind": "PodList",
                "metadata": {"resourceVersion": str(self._version)},
                "items": items,
            },
            "application/json",
        )

    def _log(self, req: Request, ns: str, pod: str) -> tuple[int, Any, str]:
        if (ns, pod) not in self.pods:
            return _status(404, "NotFound", f'pods "{pod}" not found')
        container = req.query.get("container", ["node"])[0]
        if container != "node":
            return _status(400, "BadRequest", f"container {container} is not valid for pod {pod}")
        if self.pods[(ns, pod)]["status"]["phase"] == "Pending":
            return _status(
                400,
                "BadRequest",
                f'container "node" in pod "{pod}" is waiting to start: ContainerCreating',
            )
        text = self.logs.get((ns, pod), "")
        if "tailLines" in req.query:
            n = int(req.query["tailLines"][0])
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-n:] if n else [])
        if req.query.get("follow") == ["true"]:
            # a container that has ended: its whole output, chunked a line at a time, then the
            # end of the stream (a running one's would stay open: not simulated)
            return 200, Chunks(text.splitlines(keepends=True)), "text/plain"
        return 200, text, "text/plain"


@dataclass
class Chunks:
    """A streamed body (``follow``): each part one HTTP chunk."""

    parts: list[str]


def _status(code: int, reason: str, message: str) -> tuple[int, Any, str]:
    """The API's error body: a ``Status`` object."""
    return (
        code,
        {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        },
        "application/json",
    )


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    target = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        else:
            target[k] = _merge(target.get(k), v)
    return target


def _handler(double: KubeDouble) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            url = urlparse(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                self._send(*_status(400, "BadRequest", "the body is not JSON"))
                return
            req = Request(
                method=self.command, path=url.path, query=parse_qs(url.query),
                headers={k.lower(): v for k, v in self.headers.items()}, body=body,
            )  # fmt: skip
            self._send(*double.handle(req))

        def _send(self, code: int, body: Any, ctype: str) -> None:
            if isinstance(body, Chunks):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for part in body.parts:
                    raw = part.encode()
                    self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                return
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _serve

        def log_message(self, *args: Any) -> None:  # quiet
            pass

    return Handler


@contextmanager
def kube_api() -> Iterator[KubeDouble]:
    """The double, serving on a free loopback port until the block ends."""
    double = KubeDouble()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(double))
    double.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield double
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def write_kubeconfig(path: Path, port: int, *, namespace: str = "team") -> Path:
    """A kubeconfig whose current context is the double (plain HTTP, the bearer token), in
    ``namespace``."""
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: loopback
  cluster:
    server: http://127.0.0.1:{port}
users:
- name: tester
  user:
    token: {TOKEN}
contexts:
- name: loopback
  context:
    cluster: loopback
    user: tester
    namespace: {namespace}
current-context: loopback
""",
        encoding="utf-8",
    )
    return path
