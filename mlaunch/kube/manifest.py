"""``mlaunch trainjob``: a validated launch plan, turned into a readable Kubeflow Trainer v2
``TrainJob`` (``trainer.kubeflow.org/v1alpha1``, as Trainer v2.3.0 defines it).

Pure, like :mod:`mlaunch.slurm.batch`: :func:`plan_trainjob` validates (every problem at once, as
:class:`~mlaunch.settings.SettingsError`) and :func:`render_yaml` writes the text; creating it is
:mod:`mlaunch.kube.client`'s job. The decisions, explained to users in ``docs/kubernetes.md``:

Validation
    :func:`plan_trainjob` runs :func:`~mlaunch.launcher.plan.build_plan` exactly as ``mlaunch
    train`` does, as node 0 of the job would (``--nodes`` nodes, the rendezvous at node 0's pod,
    where the torch runtime's ``PET_MASTER_ADDR`` points), so a bad setting fails here, not in a
    pod after the queue.

The pods
    Every pod of the runtime's ``node`` replicated job runs plain ``mlaunch train`` with every
    setting frozen as a flag (the pod does not see this machine's config file or environment),
    the telemetry settings and the run id in ``spec.trainer.env``. What the runtime decides per
    pod (node count, node rank, rendezvous host and port: ``PET_*``) is left to ``mlaunch train``
    in the pod; ``PET_*`` is the runtime's and never set here, the node rank never written.

Name and run id
    A TrainJob's name is an RFC 1035 label (a letter first, at most 63 characters); a run id may
    start with a digit and be 128 long. :func:`trainjob_name` derives the name from the run id,
    deterministically: ``mlaunch-<run id>``, or, when the run id had to be changed to fit
    (upper case, ``.``/``_``, too long), the fitted part and 8 hex digits of its hash. The run id
    itself is in ``MEGATRON_OTEL_RUN_ID`` and the ``mlaunch/run-id`` annotation.

Run directory, resume, telemetry
    With ``--volume CLAIM:MOUNT`` the claim is mounted in the ``node`` container of the ``node``
    replicated job (through ``runtimePatches``: Trainer v2.3.0's only place for volumes) and the
    run directory is ``MOUNT/runs/<run id>``, shared by every pod: with no collector every pod's
    traces land there (the file exporter); a pod restarted, or the TrainJob created again with the
    same run id, finds its checkpoint there and resumes. Without a volume each pod's run directory
    dies with it (said on the console and in the manifest). A pod's SIGTERM (deletion,
    preemption, suspension) makes ``mlaunch train`` stop its workers gracefully: they finish the
    iteration and save, within :data:`TERMINATION_GRACE_S`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlaunch import envcontract as ec
from mlaunch.configs import CONFIGS_DIR
from mlaunch.kube.names import (
    API_VERSION,
    DEFAULT_RUNTIME,
    KIND,
    MANAGED_BY_LABEL,
    MAX_IMAGE,
    NODE,
    PATCH_MANAGER,
    QUEUE_LABEL,
    RDZV_PORT,
    RUN_ID_ANNOTATION,
    RUNTIME_ENV_PREFIX,
    VOLUME_NAME,
    dns_label,
    trainjob_name,
)
from mlaunch.launcher.configs import config_launch_keys
from mlaunch.launcher.plan import LaunchPlan, build_plan
from mlaunch.launcher.worker_env import worker_environment
from mlaunch.settings import SECRET_ENV, SettingsError, new_run_id
from mlaunch.slurm.batch import (
    DEFAULT_SIGNAL_GRACE_S,
    frozen_flags,
    one_worker_per_gpu,
    restart_saves,
    take_scheduler_decided,
)

#: Pod's grace between SIGTERM and SIGKILL: one iteration plus a save, as SLURM's warning
#: (Kubernetes' default, 30 s, is too short for a checkpoint of any size).
TERMINATION_GRACE_S = DEFAULT_SIGNAL_GRACE_S
#: What a runtime's name, a queue (a label value) and a claim may be.
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")

#: Launch settings the runtime decides per pod -> what to give instead.
KUBE_DECIDED: dict[str, str] = {
    "launch.nnodes": "give --nodes (mlaunch train reads PET_NNODES in the pod)",
    "launch.node_rank": "the runtime numbers the pods (mlaunch train reads PET_NODE_RANK)",
    "launch.rdzv_endpoint": "the runtime puts it at node 0's pod (PET_MASTER_ADDR:PET_MASTER_PORT)",
    "launch.run_dir": "the run directory is MOUNT/runs/<run id> on the --volume",
}


@dataclass(frozen=True)
class TrainJobOptions:
    """The Kubernetes side of ``mlaunch trainjob`` (the training side is ``mlaunch train``'s)."""

    image: str
    """The container image; it must hold mlaunch (and the script, if any) for ``mlaunch train``."""
    nodes: int = 1
    namespace: str | None = None
    """None: the namespace of the kubeconfig's context (``default`` in-cluster or unset)."""
    gpus_per_node: int | None = None
    """``nvidia.com/gpu`` per pod; also the workers per pod unless --nproc-per-node is given."""
    runtime: str = DEFAULT_RUNTIME
    queue: str | None = None
    """Kueue's LocalQueue (the ``kueue.x-k8s.io/queue-name`` label)."""
    volume: str | None = None
    """``CLAIM:MOUNT``: a PersistentVolumeClaim mounted at MOUNT in every pod."""


@dataclass(frozen=True)
class TrainJobPlan:
    """Everything the manifest says, decided and validated."""

    plan: LaunchPlan
    """The launch as node 0 will plan it."""
    options: TrainJobOptions
    name: str
    claim: str | None
    mount: str | None
    pod_run_dir: str | None
    """The run directory in every pod (None without a volume: each pod's own ``runs/<id>``)."""
    train_args: list[str]
    """``mlaunch train``'s arguments in the pod."""
    environment: dict[str, str]
    notes: list[str] = field(default_factory=list)
    created: float = field(default_factory=time.time)

    @property
    def run_id(self) -> str:
        return self.plan.run_id

    @property
    def workers_per_node(self) -> int:
        return self.plan.settings.launch.nproc_per_node

    @property
    def local_run_dir(self) -> Path:
        """Where ``trainjob.yaml`` is written on this machine (the default run directory)."""
        return self.plan.run_dir


def _option_problems(o: TrainJobOptions) -> list[tuple[str, str]]:
    """The Kubernetes options, each problem one line naming the flag and the fix."""
    problems: list[tuple[str, str]] = []
    if not o.image.strip():
        problems.append(("--image", "empty: give the container image, e.g. ghcr.io/me/train:1"))
    elif any(ch.isspace() for ch in o.image) or len(o.image) > MAX_IMAGE:
        problems.append(
            (
                "--image",
                f"{o.image!r} is not an image reference (no spaces, at most {MAX_IMAGE}"
                " characters): REGISTRY/NAME[:TAG][@DIGEST]",
            )
        )
    if o.namespace is not None and not dns_label(o.namespace):
        problems.append(
            (
                "--namespace",
                f"{o.namespace!r} is not a namespace name (a DNS label: lower-case letters,"
                " digits and '-', at most 63, starting and ending with a letter or digit)",
            )
        )
    if not (len(o.runtime) <= 253 and _DNS_SUBDOMAIN.fullmatch(o.runtime)):
        problems.append(
            (
                "--runtime",
                f"{o.runtime!r} is not a ClusterTrainingRuntime name (lower-case letters,"
                f" digits, '-' and '.'); the shipped one is {DEFAULT_RUNTIME}",
            )
        )
    if o.queue is not None and not (len(o.queue) <= 63 and _LABEL_VALUE.fullmatch(o.queue)):
        problems.append(
            (
                "--queue",
                f"{o.queue!r} is not a Kueue LocalQueue name (a label value: letters, digits,"
                " '-', '_', '.', at most 63)",
            )
        )
    if o.volume is not None:
        claim, sep, mount = o.volume.partition(":")
        if not sep or not (len(claim) <= 253 and _DNS_SUBDOMAIN.fullmatch(claim)):
            problems.append(
                (
                    "--volume",
                    f"{o.volume!r}: give CLAIM:MOUNT, a PersistentVolumeClaim name and an"
                    " absolute path in the pod, e.g. --volume train-runs:/runs",
                )
            )
        elif not mount.startswith("/") or ":" in mount or any(c.isspace() for c in mount):
            problems.append(
                (
                    "--volume",
                    f"mount {mount!r}: an absolute path in the pod without ':' or spaces,"
                    " e.g. /runs",
                )
            )
    return problems


def _validation_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment node 0's ``mlaunch train`` plans in: this one without another engine's
    per-job variables (a SLURM allocation we run in is not the pod's)."""
    return {
        k: v
        for k, v in environ.items()
        if not k.startswith(("SLURM_", RUNTIME_ENV_PREFIX)) or k == "SLURM_CONF"
    }


def plan_trainjob(
    *,
    flags: Mapping[str, Any],
    config: str | None,
    passthrough: Sequence[str],
    environ: Mapping[str, str],
    cwd: Path,
    options: TrainJobOptions,
) -> TrainJobPlan:
    """Validate the whole TrainJob (settings as ``mlaunch train`` does, and the Kubernetes
    options) and decide the manifest. Raises :class:`SettingsError` with every problem; creates
    nothing."""
    flags = dict(flags)
    problems = take_scheduler_decided(
        flags,
        KUBE_DECIDED,
        "mlaunch trainjob",
        "a secret is never written into trainjob.yaml: mlaunch trainjob cannot pass collector"
        " credentials yet (reach a collector Service inside the cluster)",
    )
    problems += _option_problems(options)
    notes = one_worker_per_gpu(flags, options.gpus_per_node)
    # The run id is chosen here, once (the setting's flag, else its variable, else a fresh id):
    # it names the TrainJob and the run directory, and travels to every pod in
    # spec.trainer.env, where the pods of one job have no other id they all share.
    given = flags.get("telemetry.run_id") or next(
        (environ[k] for k in (ec.RUN_ID, ec.FALLBACK_PREFIX + "RUN_ID") if environ.get(k)), None
    )
    flags["telemetry.run_id"] = str(given).strip() if given else new_run_id()
    flags["launch.nnodes"] = str(options.nodes)
    if options.nodes > 1:
        # Validation only: in the pod the runtime's PET_MASTER_ADDR:PET_MASTER_PORT (node 0's
        # pod) decides, and this flag is not frozen.
        flags["launch.rdzv_endpoint"] = f"{NODE}-0:{RDZV_PORT}"
    job_env = _validation_environ(environ)
    try:
        plan = build_plan(
            flags=flags, config=config, passthrough=passthrough, environ=job_env, cwd=cwd
        )
    except SettingsError as exc:
        raise SettingsError(problems + exc.problems) from None
    s = plan.settings
    run_id = plan.run_id
    if options.gpus_per_node and s.launch.device == "cpu":
        problems.append(
            (
                "--gpus-per-node",
                f"the workers run on CPU (device 'cpu' from {s.source('launch.device')}):"
                " give --device cuda, or drop --gpus-per-node",
            )
        )
    for key in sorted(config_launch_keys(plan.config)):
        # The config file's own per-node values would be shadowed here and lost in the pod.
        if f"launch.{key}" in KUBE_DECIDED:
            problems.append(
                (
                    f"{plan.config} [launch] {key}",
                    f"not for mlaunch trainjob: {KUBE_DECIDED[f'launch.{key}']}",
                )
            )
    if problems:
        raise SettingsError(problems)
    claim = mount = pod_run_dir = None
    if options.volume is not None:
        claim, _, mount = options.volume.partition(":")
        pod_run_dir = f"{mount.rstrip('/')}/runs/{run_id}"
        if note := restart_saves(flags, s, "a restarted pod"):
            notes.append(note)
            plan = build_plan(
                flags=flags, config=config, passthrough=passthrough, environ=job_env, cwd=cwd
            )
            s = plan.settings
    else:
        notes.append(
            "no --volume: each pod's run directory (traces, checkpoints) is inside the pod and"
            " lost with it; a restart starts over. Give --volume CLAIM:MOUNT to keep them"
        )
    secrets = sorted(k for k in SECRET_ENV if environ.get(k, "").strip())
    if secrets:
        notes.append(
            f"{', '.join(secrets)} set here is not passed to the pods (a secret is never written"
            " into trainjob.yaml): give it to the pods another way, e.g. in the runtime"
        )
    shipped = plan.config.parent == CONFIGS_DIR
    # A shipped config is in the image too (it is mlaunch's); a file of this machine is not:
    # then every setting is frozen, defaults included, over the default config.
    kinds = ("flag", "file", "env") if shipped else ("flag", "file", "env", "default")
    train_args = [
        "--config",
        plan.config.stem if shipped else "tiny",
        *frozen_flags(plan, None, decided=tuple(KUBE_DECIDED), kinds=kinds),
    ]
    if pod_run_dir is not None:
        train_args += ["--run-dir", pod_run_dir]
    if passthrough:
        train_args += ["--", *passthrough]
    # The pod's mlaunch train reads its telemetry settings from these, as the launcher's input
    # (mlaunch's own keys whatever the entry point: it translates them for a script's workers
    # itself); what it derives per launch (device mask, hook path, run directory) it derives.
    mlaunch_env, _, _ = worker_environment(s, run_id, plan.run_dir, job_env, external=False)
    environment = {
        k: v
        for k, v in mlaunch_env.items()
        if k.startswith((ec.PRIMARY_PREFIX, ec.OTEL_PREFIX)) and k not in SECRET_ENV
    }
    return TrainJobPlan(
        plan=plan,
        options=options,
        name=trainjob_name(run_id),
        claim=claim,
        mount=mount,
        pod_run_dir=pod_run_dir,
        train_args=train_args,
        environment=environment,
        notes=notes,
    )


# --------------------------------------------------------------------------------------------
# The manifest


def manifest(job: TrainJobPlan) -> dict[str, Any]:
    """The TrainJob as the API takes it (what :func:`render_yaml` writes, without comments)."""
    o = job.options
    metadata: dict[str, Any] = {"name": job.name}
    if o.namespace is not None:
        metadata["namespace"] = o.namespace
    labels = {MANAGED_BY_LABEL: "mlaunch"}
    if o.queue is not None:
        labels[QUEUE_LABEL] = o.queue
    metadata["labels"] = labels
    metadata["annotations"] = {RUN_ID_ANNOTATION: job.run_id}
    trainer: dict[str, Any] = {
        "image": o.image,
        "command": ["mlaunch", "train"],
        "args": list(job.train_args),
        "env": [{"name": k, "value": v} for k, v in job.environment.items()],
        "numNodes": o.nodes,
        "numProcPerNode": job.workers_per_node,
    }
    if o.gpus_per_node:
        gpus = str(o.gpus_per_node)
        trainer["resourcesPerNode"] = {"limits": {"nvidia.com/gpu": gpus}}
    pod_spec: dict[str, Any] = {"terminationGracePeriodSeconds": TERMINATION_GRACE_S}
    if job.claim is not None:
        pod_spec["volumes"] = [
            {"name": VOLUME_NAME, "persistentVolumeClaim": {"claimName": job.claim}}
        ]
        pod_spec["containers"] = [
            {"name": NODE, "volumeMounts": [{"name": VOLUME_NAME, "mountPath": job.mount}]}
        ]
    patch = {
        "manager": PATCH_MANAGER,
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {"name": NODE, "template": {"spec": {"template": {"spec": pod_spec}}}}
                    ]
                }
            }
        },
    }
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": {"runtimeRef": {"name": o.runtime}, "trainer": trainer, "runtimePatches": [patch]},
    }


def _comments(job: TrainJobPlan) -> dict[tuple[str, ...], list[str]]:
    """Comment lines written above a key (its path in the manifest)."""
    o = job.options
    volume = (
        f"the run directory {job.pod_run_dir} is on claim {job.claim}, shared by every pod"
        if job.claim
        else "no volume: each pod's run directory is its own and dies with the pod"
    )
    return {
        ("metadata", "name"): [
            f"mlaunch-<run id>, fitted to an RFC 1035 label (run id {job.run_id})"
        ],
        ("metadata", "labels"): (
            [f"{QUEUE_LABEL}: Kueue admits the job from LocalQueue {o.queue}"] if o.queue else []
        ),
        ("spec", "runtimeRef"): [
            f"The ClusterTrainingRuntime: it sets PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR,"
            f" PET_MASTER_PORT and PET_NPROC_PER_NODE in each pod ({o.runtime})"
        ],
        ("spec", "trainer", "command"): [
            "Every pod runs mlaunch train: node count, node rank and rendezvous from PET_*,",
            "never written here; SIGTERM (deletion, preemption, suspension) saves and stops.",
        ],
        ("spec", "trainer", "args"): ["Every setting, validated by mlaunch trainjob, frozen"]
        + [f"{note} (chosen by mlaunch trainjob)" for note in job.notes if note.startswith("--")],
        ("spec", "trainer", "env"): [
            "Telemetry settings and the run id (MEGATRON_OTEL_RUN_ID): the same run directory",
            "for every pod and every restart, so a restarted job resumes from its checkpoint",
        ],
        ("spec", "trainer", "numProcPerNode"): ["torchrun's workers per pod (PET_NPROC_PER_NODE)"],
        ("spec", "runtimePatches"): [
            f"The node container of the node job: {volume};",
            f"{TERMINATION_GRACE_S} s between SIGTERM and SIGKILL, for the save",
        ],
    }


def render_yaml(job: TrainJobPlan) -> str:
    """``trainjob.yaml``: the manifest as YAML (``kubectl apply -f``), commented."""
    o = job.options
    created = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(job.created))
    what = (
        "mlaunch's trainer"
        if job.plan.settings.uses_builtin_trainer
        else (job.plan.settings.launch.script or f"-m {job.plan.settings.launch.module}")
    )
    head = [
        f"# Written by mlaunch trainjob, {created}: {o.nodes} pod(s) x {job.workers_per_node}"
        f" worker(s) of {what},",
        f"# config {job.plan.config.name}. Kubeflow Trainer v2 ({API_VERSION}, v2.3.0).",
        "# Create it with: kubectl apply -f trainjob.yaml"
        + ("" if o.namespace else " (into the current namespace)"),
    ]
    head += [f"# note: {n}" for n in job.notes if not n.startswith("--")]
    return "\n".join(head) + "\n" + _yaml(manifest(job), _comments(job), (), 0) + "\n"


_PLAIN_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]*")


def _scalar(value: Any) -> str:
    """A YAML scalar: strings always quoted (JSON's double quotes are YAML's), so nothing
    reads as a number, a boolean or null."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return json.dumps(str(value))


def _key(key: str) -> str:
    return key if _PLAIN_KEY.fullmatch(key) else json.dumps(key)


def _yaml(
    value: Any, comments: Mapping[tuple[str, ...], list[str]], path: tuple[str, ...], indent: int
) -> str:
    """Block YAML for a mapping (at ``indent``), with each key's comments above it."""
    pad = " " * indent
    lines: list[str] = []
    for key, item in value.items():
        here = (*path, key)
        lines += [f"{pad}# {c}" for c in comments.get(here, [])]
        if isinstance(item, dict) and item:
            lines.append(f"{pad}{_key(key)}:")
            lines.append(_yaml(item, comments, here, indent + 2))
        elif isinstance(item, list) and item:
            lines.append(f"{pad}{_key(key)}:")
            for element in item:
                if isinstance(element, dict):
                    body = _yaml(element, comments, here, indent + 4)
                    lines.append(f"{pad}  - {body.lstrip()}")
                else:
                    lines.append(f"{pad}  - {_scalar(element)}")
        elif isinstance(item, dict | list):
            lines.append(f"{pad}{_key(key)}: {'{}' if isinstance(item, dict) else '[]'}")
        else:
            lines.append(f"{pad}{_key(key)}: {_scalar(item)}")
    return "\n".join(lines)
