"""``mlaunch status|logs|stop trainjob/NAME``: a TrainJob and its pods, read through the API, in
the words ``mlaunch status`` uses for local and SLURM runs.

State, from the TrainJob's conditions (``Complete``, ``Failed``, ``Suspended``: Trainer v2.3.0's
types), its ``spec.suspend`` and its pods:

- ``Failed`` true: **failed** (the condition's message is the cause); ``Complete`` true:
  **completed**;
- suspended (``spec.suspend``): **stopped** when ``mlaunch stop`` suspended it (its annotation),
  else **queued** with a Kueue queue label (Kueue holds a job suspended until it admits it), else
  **suspended**;
- otherwise **running** once a pod of the ``node`` job runs, else **queued** (no pod yet, or pods
  pending: the scheduler's or the kubelet's reason is shown).

Stop: ``spec.suspend: true`` (a JSON merge patch, with the ``mlaunch/stopped`` annotation). The
Trainer suspends the JobSet, whose Jobs delete their pods: each pod gets SIGTERM, its ``mlaunch
train`` stops the workers gracefully (the iteration finishes, a checkpoint is saved on the
volume) within the pod's grace period, and the job is resumable by unsuspending it (the same run
id, the same run directory). ``--now`` deletes the TrainJob (its JobSet and pods with it): not
resumable by unsuspending; create it again from ``trainjob.yaml`` to resume from the volume.
"""

from __future__ import annotations

import json
import queue
import shlex
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlaunch.kube.client import (
    Kube,
    KubeApiError,
    delete_trainjob,
    follow_pod_log,
    get_trainjob,
    patch_trainjob,
    pod_log,
    pod_node,
    trainjob_pods,
)
from mlaunch.kube.names import (
    MAX_NAME,
    NODE,
    QUEUE_LABEL,
    RFC1035,
    RUN_ID_ANNOTATION,
    STOPPED_ANNOTATION,
)
from mlaunch.launcher.run_status import JobStatus, NodeView
from mlaunch.rundir import layout as lay
from mlaunch.rundir.atomic import read_json

#: How ``status``, ``logs`` and ``stop`` name a TrainJob (a run directory or a job id otherwise).
PREFIX = "trainjob/"
#: The states in which nothing is left to stop.
ENDED = frozenset({"completed", "failed"})


class TrainJobInputError(ValueError):
    """The argument is not a TrainJob name, or the TrainJob cannot be stopped: exit 2."""


def is_trainjob_target(target: str) -> bool:
    """Whether ``target`` names a TrainJob (``trainjob/NAME``)."""
    return target.startswith(PREFIX)


def trainjob_target(target: str) -> str:
    """The TrainJob's name in ``trainjob/NAME``; raises :class:`TrainJobInputError`."""
    name = target.removeprefix(PREFIX)
    if not (len(name) <= MAX_NAME and RFC1035.fullmatch(name)):
        raise TrainJobInputError(
            f"{target!r}: give trainjob/NAME with the TrainJob's name (as mlaunch trainjob"
            " printed it: lower-case letters, digits and '-')"
        )
    return name


@dataclass(frozen=True)
class TrainJobRef:
    """A TrainJob a command was pointed at: by ``trainjob/NAME`` or by the run directory
    ``mlaunch trainjob`` wrote its manifest and record into."""

    name: str
    namespace: str | None
    """None: the kubeconfig context's (or the command's ``--namespace``)."""


def resolve_trainjob(target: str, cwd: Path) -> TrainJobRef | None:
    """The TrainJob ``target`` names (``trainjob/NAME``, or a run directory holding
    ``trainjob.json``), else None (a run directory or job id of another engine). Raises
    :class:`TrainJobInputError` for ``trainjob/`` and a name that cannot be one."""
    if is_trainjob_target(target):
        return TrainJobRef(trainjob_target(target), None)
    path = Path(target).expanduser()
    record = read_json((path if path.is_absolute() else cwd / path) / lay.TRAINJOB_RECORD_FILE)
    if not isinstance(record, dict) or not isinstance(record.get("name"), str):
        return None
    return TrainJobRef(trainjob_target(PREFIX + record["name"]), record.get("namespace"))


def trainjob_record(name: str, namespace: str, server: str, run_id: str) -> dict[str, Any]:
    """``trainjob.json``: what :func:`resolve_trainjob` reads back from the run directory."""
    return {
        "name": name,
        "namespace": namespace,
        "server": server,
        "run_id": run_id,
        "created": time.time(),
        "manifest": lay.TRAINJOB_FILE,
    }


def _read(kube: Kube, name: str) -> dict[str, Any]:
    try:
        return get_trainjob(kube, name)
    except KubeApiError as exc:
        if exc.status == 404:
            raise TrainJobInputError(
                f"no TrainJob {name} in namespace {kube.namespace} (give --namespace?)"
            ) from None
        raise


# --------------------------------------------------------------------------------------------
# Status


@dataclass(frozen=True)
class PodView:
    """One pod of the TrainJob, as ``status`` shows it."""

    name: str
    node: int | None
    phase: str
    reason: str | None
    host: str | None

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "node": self.node,
            "phase": self.phase,
            "reason": self.reason,
            "host": self.host,
        }


def _true(conditions: Mapping[str, Mapping[str, Any]], kind: str) -> bool:
    return str((conditions.get(kind) or {}).get("status")) == "True"


def pod_view(pod: Mapping[str, Any]) -> PodView:
    """A pod's phase and, when it is not simply running, why (a waiting or terminated
    container's reason, else the scheduler's)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    phase = str(status.get("phase") or "Unknown")
    reason = None
    for cs in status.get("containerStatuses") or []:
        if cs.get("name") != NODE:
            continue
        state = cs.get("state") or {}
        for key in ("waiting", "terminated"):
            if state.get(key):
                s = state[key]
                code = f", exit code {s['exitCode']}" if "exitCode" in s else ""
                reason = f"{s.get('reason') or key}{code}"
    if reason is None and phase == "Pending":
        for c in status.get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False":
                reason = f"{c.get('reason')}: {c.get('message')}".rstrip(": ")
    return PodView(
        name=str(meta.get("name", "")),
        node=pod_node(pod),
        phase=phase,
        reason=reason,
        host=(pod.get("spec") or {}).get("nodeName"),
    )


def trainjob_state(trainjob: Mapping[str, Any], pods: list[PodView]) -> tuple[str, str | None]:
    """(mlaunch's word for the TrainJob's state, why: a condition's message or a pod's reason)."""
    meta = trainjob.get("metadata") or {}
    conditions = {
        str(c.get("type")): c for c in (trainjob.get("status") or {}).get("conditions") or []
    }
    if _true(conditions, "Failed"):
        c = conditions["Failed"]
        return "failed", c.get("message") or c.get("reason")
    if _true(conditions, "Complete"):
        return "completed", None
    if (trainjob.get("spec") or {}).get("suspend"):
        if STOPPED_ANNOTATION in (meta.get("annotations") or {}):
            return "stopped", None
        if QUEUE_LABEL in (meta.get("labels") or {}):
            return "queued", f"Kueue LocalQueue {meta['labels'][QUEUE_LABEL]}"
        return "suspended", (conditions.get("Suspended") or {}).get("message")
    nodes = [p for p in pods if p.node is not None]
    if any(p.phase in ("Running", "Succeeded", "Failed") for p in nodes):
        # a pod that has ended before the TrainJob's condition says so: still its run
        return "running", None
    waiting = next((p.reason for p in nodes if p.reason), None)
    return "queued", waiting or ("no pod yet" if not nodes else None)


def trainjob_status(kube: Kube, name: str, *, log_lines: bool = True) -> JobStatus:
    """The TrainJob's status in :class:`JobStatus` (``trainjob``: the API's side; ``nodes``: each
    pod's last log line). Raises :class:`TrainJobInputError` when there is no such TrainJob."""
    tj = _read(kube, name)
    pods = [pod_view(p) for p in trainjob_pods(kube, name)]
    state, why = trainjob_state(tj, pods)
    st = JobStatus(job_id=f"{PREFIX}{name}", state=state, run_dir=None)
    meta, spec = tj.get("metadata") or {}, tj.get("spec") or {}
    trainer = spec.get("trainer") or {}
    st.trainjob = {
        "name": name,
        "namespace": kube.namespace,
        "run_id": (meta.get("annotations") or {}).get(RUN_ID_ANNOTATION),
        "image": trainer.get("image"),
        "nodes": trainer.get("numNodes"),
        "reason": why,
        "suspended": bool(spec.get("suspend")),
        "conditions": [
            {k: c.get(k) for k in ("type", "status", "reason", "message")}
            for c in (tj.get("status") or {}).get("conditions") or []
        ],
        "pods": [p.as_json() for p in pods],
    }
    if state == "failed":
        st.cause = why
    elif state == "stopped":
        st.note = f"resume it with: {resume_command(name, kube.namespace)}"
    if log_lines:
        for p in pods:
            if p.node is None or p.phase == "Pending":
                continue
            try:
                tail = pod_log(kube, p.name, tail=1).strip().splitlines()
            except KubeApiError:
                tail = []  # a pod gone between the list and the read: no line, not an error
            st.nodes.append(
                NodeView(node=p.node, log=f"pod {p.name}", last_line=tail[-1] if tail else None)
            )
    return st


def resume_command(name: str, namespace: str) -> str:
    """The command that resumes a TrainJob ``mlaunch stop`` suspended."""
    patch = json.dumps(
        {"metadata": {"annotations": {STOPPED_ANNOTATION: None}}, "spec": {"suspend": False}},
        separators=(",", ":"),
    )
    return f"kubectl patch trainjob {name} -n {namespace} --type merge -p {shlex.quote(patch)}"


# --------------------------------------------------------------------------------------------
# Logs


def trainjob_logs(
    kube: Kube, name: str, *, node: int | None = None, tail: int | None = None,
    follow: bool = False,
) -> Iterator[str]:  # fmt: skip
    """Each pod's ``mlaunch train`` output (its launcher's console, node order), every line
    prefixed ``[node R]`` when several pods are shown; ``follow``: every pod's lines as they
    are written, until every pod's output ends (a pod started later is not picked up). Raises
    :class:`TrainJobInputError` for an unknown TrainJob, a node it does not have, or no pod to
    read yet."""
    _read(kube, name)
    pods = [pod_view(p) for p in trainjob_pods(kube, name)]
    pods = [p for p in pods if p.node is not None and (node is None or p.node == node)]
    if not pods:
        raise TrainJobInputError(
            f"TrainJob {name} has no pod"
            + (f" for node {node}" if node is not None else "")
            + f" to read yet (mlaunch status trainjob/{name} says why)"
        )
    prefix = len(pods) > 1

    def shown(p: PodView, line: str) -> str:
        return f"[node {p.node}] {line}" if prefix else line

    if not follow:
        for p in pods:
            for line in pod_log(kube, p.name, tail=tail).splitlines():
                yield shown(p, line)
        return
    # One reader per pod, lines whole through one queue: never two pods' text in one line.
    lines: queue.Queue[tuple[str | None, BaseException | None]] = queue.Queue(maxsize=10_000)

    def read(p: PodView) -> None:
        try:
            for line in follow_pod_log(kube, p.name, tail=tail):
                lines.put((shown(p, line), None))
            lines.put((None, None))
        except BaseException as exc:  # handed to the reader of the queue, raised there
            lines.put((None, exc))

    threads = [threading.Thread(target=read, args=(p,), daemon=True) for p in pods]
    for t in threads:
        t.start()
    open_streams = len(threads)
    while open_streams:
        line, exc = lines.get()
        if exc is not None:
            raise exc
        if line is None:
            open_streams -= 1
        else:
            yield line


# --------------------------------------------------------------------------------------------
# Stop


def stop_trainjob(kube: Kube, name: str, *, now: bool = False) -> str:
    """Suspend the TrainJob (``now``: delete it); returns what was done, for the console.
    Raises :class:`TrainJobInputError` when it is unknown or has ended (nothing changed)."""
    tj = _read(kube, name)
    state, _ = trainjob_state(tj, [pod_view(p) for p in trainjob_pods(kube, name)])
    if state in ENDED:
        raise TrainJobInputError(f"TrainJob {name} has {state}: nothing to stop")
    if now:
        delete_trainjob(kube, name)
        return (
            f"TrainJob {name} deleted, its pods with it (not resumable by unsuspending: create"
            f" it again from trainjob.yaml to resume from its run directory on the volume)"
        )
    if state == "stopped":
        raise TrainJobInputError(
            f"TrainJob {name} is already stopped: resume it with {resume_command(name, kube.namespace)}"
        )
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    patch_trainjob(
        kube,
        name,
        {"metadata": {"annotations": {STOPPED_ANNOTATION: stamp}}, "spec": {"suspend": True}},
    )
    return (
        f"TrainJob {name} suspended: each pod gets SIGTERM and saves a checkpoint before it"
        f" exits. Resume it with: {resume_command(name, kube.namespace)}"
    )


def wait_pods_gone(kube: Kube, name: str, *, timeout_s: float, poll_s: float = 1.0) -> list[str]:
    """Wait until no pod of the TrainJob's ``node`` job is left (after a stop: every pod has
    saved and exited, or was killed at the end of its grace period). Returns the pods still
    there when ``timeout_s`` ran out; empty: the run has ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [
            str(p["metadata"]["name"]) for p in trainjob_pods(kube, name) if pod_node(p) is not None
        ]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(poll_s)
