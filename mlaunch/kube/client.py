"""The Kubernetes API, through the ``kubernetes`` client (the optional ``mlaunch[kubernetes]``).

Every call returns the API's JSON as plain dicts (``_preload_content=False``): the rest of
``mlaunch.kube`` reads the TrainJob and its pods as the API documents them, with no model
classes between. Credentials: in a pod, its service account (``KUBERNETES_SERVICE_HOST`` set);
elsewhere the kubeconfig (``KUBECONFIG`` or ``~/.kube/config``), its current context and that
context's namespace.

Two kinds of failure: :class:`KubeSetupError` before anything reached the cluster (no client, no
kubeconfig, no API server, no Trainer: exit 2, nothing created) and :class:`KubeApiError` when
the API answered with an error (exit 1).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from mlaunch.kube.names import GROUP, PLURAL, VERSION

#: The pip command that brings the client.
INSTALL_HINT = "pip install 'mlaunch[kubernetes]'"
#: Seconds per API request (connect and read): an API server that does not answer is a failure.
REQUEST_TIMEOUT_S = 15
#: JobSet's label on every pod of the TrainJob's JobSet (the JobSet is named after the TrainJob).
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
#: The replicated job a pod belongs to, and its index in it (the node rank, for ``node``).
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
_SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class KubeSetupError(Exception):
    """No way to the cluster (client, credentials, API server, Trainer's API): nothing created."""


class KubeApiError(Exception):
    """The API server answered with an error."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Kube:
    """A connection: the client's API objects and the namespace to work in."""

    custom: Any
    core: Any
    namespace: str
    server: str


def _client() -> Any:
    try:
        import kubernetes
    except ImportError:
        raise KubeSetupError(f"the kubernetes client is not installed: {INSTALL_HINT}") from None
    return kubernetes


def connect(namespace: str | None = None, environ: Mapping[str, str] | None = None) -> Kube:
    """Load credentials and build the API objects (no request yet). ``namespace`` None: the
    context's (the pod's own in-cluster), else ``default``."""
    environ = os.environ if environ is None else environ
    k8s = _client()
    cfg = k8s.client.Configuration()
    context_ns: str | None = None
    try:
        if environ.get("KUBERNETES_SERVICE_HOST"):
            k8s.config.load_incluster_config(client_configuration=cfg)
            try:
                with open(_SA_NAMESPACE, encoding="utf-8") as f:
                    context_ns = f.read().strip() or None
            except OSError:
                pass
        else:
            # Named each time: the client reads KUBECONFIG once, when it is imported.
            path = environ.get("KUBECONFIG") or "~/.kube/config"
            k8s.config.load_kube_config(config_file=path, client_configuration=cfg)
            _, active = k8s.config.list_kube_config_contexts(config_file=path)
            context_ns = (active or {}).get("context", {}).get("namespace")
    except (k8s.config.ConfigException, OSError, TypeError, ValueError) as exc:
        where = environ.get("KUBECONFIG") or "~/.kube/config"
        raise KubeSetupError(
            f"no usable kubeconfig ({where}: {_first_line(exc)}): set KUBECONFIG, or run"
            " inside a cluster"
        ) from None
    cfg.retries = 0  # one try: an unreachable server is reported at once, not after backoff
    api = k8s.client.ApiClient(configuration=cfg)
    return Kube(
        custom=k8s.client.CustomObjectsApi(api),
        core=k8s.client.CoreV1Api(api),
        namespace=namespace or context_ns or "default",
        server=cfg.host,
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def _call(
    kube: Kube, what: str, fn: Any, *args: Any, raw: bool = False, stream: bool = False,
    **kwargs: Any,
) -> Any:  # fmt: skip
    """One request; its JSON body (None when empty; ``raw``: its text; ``stream``: the open
    response, no read timeout). Raises :class:`KubeSetupError` when the server cannot be
    reached, :class:`KubeApiError` for an error answer."""
    k8s = _client()
    if not stream:  # a followed log may be silent for as long as the pod is
        kwargs["_request_timeout"] = REQUEST_TIMEOUT_S
    try:
        resp = fn(*args, _preload_content=False, **kwargs)
    except k8s.client.exceptions.ApiException as exc:
        raise KubeApiError(f"{what}: {_api_message(exc)}", exc.status) from None
    except Exception as exc:  # urllib3's connection errors and timeouts, whichever class
        if _is_connection_error(exc):
            raise KubeSetupError(
                f"cannot reach the Kubernetes API server at {kube.server}: {_reason(exc)}"
            ) from None
        raise
    if stream:
        return resp
    data = resp.data
    if raw:
        return (data or b"").decode("utf-8", "replace")
    return json.loads(data) if data else None


def _is_connection_error(exc: Exception) -> bool:
    import urllib3

    return isinstance(exc, urllib3.exceptions.HTTPError | OSError)


def _reason(exc: Exception) -> str:
    reason = getattr(exc, "reason", None) or exc
    text = _first_line(reason)
    # urllib3 prefixes its pool's repr: keep what the OS said
    return text.rsplit(": ", 1)[-1] if "Failed to establish" in text else text


def _api_message(exc: Any) -> str:
    """The API's own ``Status`` message, else the HTTP reason."""
    try:
        body = json.loads(exc.body)
        message = body.get("message")
    except (TypeError, ValueError, AttributeError):
        message = None
    return f"{exc.status} {message or exc.reason}"


# --------------------------------------------------------------------------------------------
# The calls


def check_trainer_api(kube: Kube) -> None:
    """Reach the API server and check that it serves TrainJobs (Kubeflow Trainer v2 installed),
    before anything is created."""
    try:
        _call(
            kube,
            "listing TrainJobs",
            kube.custom.list_namespaced_custom_object,
            GROUP,
            VERSION,
            kube.namespace,
            PLURAL,
            limit=1,
        )
    except KubeApiError as exc:
        if exc.status == 404:
            raise KubeSetupError(
                f"the API server at {kube.server} does not serve {PLURAL}.{GROUP}/{VERSION}:"
                " install Kubeflow Trainer v2 (v2.3.0) on the cluster"
            ) from None
        raise


def create_trainjob(kube: Kube, body: dict[str, Any]) -> dict[str, Any]:
    return _call(
        kube,
        f"creating TrainJob {body['metadata']['name']}",
        kube.custom.create_namespaced_custom_object,
        GROUP,
        VERSION,
        kube.namespace,
        PLURAL,
        body,
    )


def get_trainjob(kube: Kube, name: str) -> dict[str, Any]:
    return _call(
        kube,
        f"TrainJob {name}",
        kube.custom.get_namespaced_custom_object,
        GROUP,
        VERSION,
        kube.namespace,
        PLURAL,
        name,
    )


def patch_trainjob(kube: Kube, name: str, patch: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch (the client's content type for a dict body)."""
    return _call(
        kube,
        f"patching TrainJob {name}",
        kube.custom.patch_namespaced_custom_object,
        GROUP,
        VERSION,
        kube.namespace,
        PLURAL,
        name,
        patch,
    )


def delete_trainjob(kube: Kube, name: str) -> None:
    """Delete it; its JobSet, Jobs and pods go with it (foreground: the answer comes once the
    deletion is under way)."""
    _call(
        kube,
        f"deleting TrainJob {name}",
        kube.custom.delete_namespaced_custom_object,
        GROUP,
        VERSION,
        kube.namespace,
        PLURAL,
        name,
        propagation_policy="Foreground",
    )


def trainjob_pods(kube: Kube, name: str) -> list[dict[str, Any]]:
    """The pods of the TrainJob's ``node`` job, by node index."""
    data = _call(
        kube,
        f"pods of TrainJob {name}",
        kube.core.list_namespaced_pod,
        kube.namespace,
        label_selector=f"{JOBSET_LABEL}={name}",
    )
    pods = (data or {}).get("items") or []
    return sorted(pods, key=lambda p: (pod_node(p) is None, pod_node(p) or 0, _pod_name(p)))


def pod_node(pod: Mapping[str, Any]) -> int | None:
    """The node rank of a pod (its index in the ``node`` job); None for another job's pod."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if labels.get(REPLICATED_JOB_LABEL, "node") != "node":
        return None
    index = labels.get(JOB_INDEX_LABEL)
    return int(index) if index is not None and str(index).isdigit() else None


def _pod_name(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("name", ""))


def pod_log(kube: Kube, pod: str, *, tail: int | None = None, container: str = "node") -> str:
    """The ``node`` container's output (``tail``: only its last lines)."""
    kwargs: dict[str, Any] = {"container": container}
    if tail is not None:
        kwargs["tail_lines"] = tail
    return _call(
        kube,
        f"log of pod {pod}",
        kube.core.read_namespaced_pod_log,
        pod,
        kube.namespace,
        raw=True,
        **kwargs,
    )


def follow_pod_log(
    kube: Kube, pod: str, *, tail: int | None = None, container: str = "node"
) -> Iterator[str]:
    """The container's output as it is written (``follow``), line by line, until it ends."""
    kwargs: dict[str, Any] = {"container": container, "follow": True}
    if tail is not None:
        kwargs["tail_lines"] = tail
    resp = _call(
        kube,
        f"log of pod {pod}",
        kube.core.read_namespaced_pod_log,
        pod,
        kube.namespace,
        stream=True,
        **kwargs,
    )
    rest = b""
    try:
        for chunk in resp.stream(4096, decode_content=True):
            rest += chunk
            *lines, rest = rest.split(b"\n")
            for line in lines:
                yield line.decode("utf-8", "replace")
        if rest:
            yield rest.decode("utf-8", "replace")
    finally:
        resp.release_conn()
