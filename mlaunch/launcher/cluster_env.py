"""What a cluster scheduler tells ``mlaunch train`` about the node it runs on, read from its
variables: one table of sources (SLURM, the Kubeflow Trainer torch runtime), one reader.

Each source names the variables that give the number of nodes, this node's rank, the rendezvous
host and port, the processes per node and a rendezvous id; :func:`cluster_launch` reads the one
source whose variables are set, as ``{setting path: (value, variable)}``, so the plan records
each value's variable as its source ("from PET_NODE_RANK"). Values are raw text: the settings
model validates them, and its errors are labelled with the variable.

Pure (no scheduler command runs, no torch) and below the launch plan, which reads it: the SLURM
commands and the batch script live in :mod:`mlaunch.slurm`, above the launcher.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlaunch.settings import flag_name

#: Rendezvous port when the source names none: torchrun's default, and the Kubeflow Trainer
#: torch runtime's ``PET_MASTER_PORT`` (its ``ContainerTrainerPort``).
DEFAULT_PORT = 29500
#: torchrun's own variable for ``--rdzv-conf`` (every torchrun option has a ``PET_`` one).
RDZV_CONF_VAR = "PET_RDZV_CONF"
#: Words torchrun takes for ``--nproc-per-node`` (``PET_NPROC_PER_NODE``) instead of a number.
NPROC_WORDS = ("auto", "gpu", "cpu")
#: Where the NVIDIA device files of the GPUs this container may use are (``/dev/nvidia0``...).
DEV_DIR = Path("/dev")
_NVIDIA_DEVICE = re.compile(r"nvidia[0-9]+")


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list such as ``node[01-04,07],gpu7`` (no ``scontrol`` needed).

    Ranges keep their zero padding; several bracket groups in one name expand as a product.
    """
    items: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    items.append(nodelist[start:])
    hosts: list[str] = []
    for item in (s.strip() for s in items):
        if item:
            hosts += _expand_one(item)
    return hosts


def _expand_one(name: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if not match:
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    values: list[str] = []
    for part in match.group(1).split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if sep and lo.isdigit() and hi.isdigit():
            width = len(lo)
            values += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
        elif part:
            values.append(part)
    return [head + v + rest for v in values for rest in _expand_one(tail)]


def _first_host(nodelist: str) -> str | None:
    hosts = expand_nodelist(nodelist)
    return hosts[0] if hosts else None


def _the_host(text: str) -> str | None:
    return text or None


@dataclass(frozen=True)
class ClusterSource:
    """One scheduler's variables for a node of a job. Each tuple lists the variables that may
    give a value, best first; the first one set gives it."""

    name: str
    """How the console names it ("SLURM", "the Kubeflow torch runtime")."""
    present: tuple[str, ...]
    """Any of these set: this node runs under this source."""
    nnodes: tuple[str, ...]
    node_rank: tuple[str, ...]
    host: tuple[str, ...]
    """The rendezvous host (node 0), read by ``host_of``."""
    port: tuple[str, ...]
    """The rendezvous port; unset: :data:`DEFAULT_PORT`."""
    nproc_per_node: tuple[str, ...] = ()
    """A number, or one of torchrun's words (:data:`NPROC_WORDS`, resolved by :func:`nproc_count`)."""
    rdzv_id: tuple[str, ...] = ()
    """The job's id: the rendezvous id and the run id (SLURM's job id)."""
    required: tuple[str, ...] = ()
    """Set on every node of such a job: one missing is a problem (a node rank nobody gave would
    make every pod node 0, writing into one another's files on the shared volume)."""
    host_is_pod_name: bool = False
    """The host is node 0's pod's DNS name (a headless Service's record): it appears only once
    that pod runs, so one that does not resolve yet is waited for by torchrun, not refused."""
    host_of: Callable[[str], str | None] = field(default=_the_host, repr=False)

    def variables(self) -> tuple[str, ...]:
        """Every variable this source reads, each once."""
        names = (*self.present, *self.nnodes, *self.node_rank, *self.host, *self.port)
        return tuple(dict.fromkeys((*names, *self.nproc_per_node, *self.rdzv_id)))


SLURM = ClusterSource(
    name="SLURM",
    present=("SLURM_JOB_ID",),
    nnodes=("SLURM_NNODES", "SLURM_JOB_NUM_NODES"),
    node_rank=("SLURM_NODEID",),
    host=("SLURM_JOB_NODELIST", "SLURM_NODELIST"),
    port=("MASTER_PORT",),
    rdzv_id=("SLURM_JOB_ID",),
    host_of=_first_host,
)
#: Kubeflow Trainer v2's torch runtime (``torch-distributed``, ``mlPolicy.torch``): it sets these
#: five in the trainer container of every node (``pkg/constants``, ``TorchEnv*``, v2.3.0), the
#: node rank from the Job's completion index, the master address the DNS name of node 0's pod.
KUBEFLOW_TORCH = ClusterSource(
    name="the Kubeflow torch runtime",
    present=("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"),
    nnodes=("PET_NNODES",),
    node_rank=("PET_NODE_RANK",),
    host=("PET_MASTER_ADDR",),
    port=("PET_MASTER_PORT",),
    nproc_per_node=("PET_NPROC_PER_NODE",),
    required=("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR"),
    host_is_pod_name=True,
)  # fmt: skip
#: Every source mlaunch reads, in the order the docs list them.
CLUSTER_SOURCES: tuple[ClusterSource, ...] = (SLURM, KUBEFLOW_TORCH)

#: Which setting each kind of variable gives.
_PATHS = {
    "nnodes": "launch.nnodes",
    "node_rank": "launch.node_rank",
    "nproc_per_node": "launch.nproc_per_node",
    "rdzv_id": "launch.rdzv_id",
}
ENDPOINT_PATH = "launch.rdzv_endpoint"


@dataclass(frozen=True)
class ClusterLaunch:
    """What the environment's cluster source determines (empty outside any)."""

    source: ClusterSource | None = None
    values: dict[str, tuple[Any, str]] = field(default_factory=dict)
    """``{setting path: (raw value, the variable that gave it)}``."""
    problems: dict[str, tuple[str, str]] = field(default_factory=dict)
    """``{setting path: (variable, what is wrong)}``: a problem only where no flag or config
    file gives that setting instead (the plan decides)."""
    conflict: tuple[str, str] | None = None
    """``(variable, what is wrong)`` when two sources are set at once: always a problem."""


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    return None


def _set(environ: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((n for n in names if environ.get(n, "").strip()), None)


def source_values(source: ClusterSource, environ: Mapping[str, str]) -> ClusterLaunch:
    """What ``source`` determines from ``environ`` (empty when none of its variables is set)."""
    if _set(environ, source.present) is None:
        return ClusterLaunch()
    values: dict[str, tuple[Any, str]] = {}
    problems: dict[str, tuple[str, str]] = {}
    for kind, path in _PATHS.items():
        names: tuple[str, ...] = getattr(source, kind)
        if (found := _first(environ, names)) is not None:
            values[path] = (found[1], found[0])
        elif names and names[0] in source.required:
            problems[path] = (names[0], _missing(source, path))
    host = _first(environ, source.host)
    hostname = source.host_of(host[1]) if host else None
    if host is not None and hostname is not None:
        port = _first(environ, source.port)
        if port is not None and not (port[1].isdigit() and 0 < int(port[1]) < 65536):
            problems[ENDPOINT_PATH] = (port[0], f"{port[1]!r} is not a port number (1-65535)")
        else:
            values[ENDPOINT_PATH] = (f"{hostname}:{port[1] if port else DEFAULT_PORT}", host[0])
    elif source.host and source.host[0] in source.required:
        problems[ENDPOINT_PATH] = (source.host[0], _missing(source, ENDPOINT_PATH))
    return ClusterLaunch(source, values, problems)


def _missing(source: ClusterSource, path: str) -> str:
    return (
        f"not set, while {source.name}'s other variables are (it sets"
        f" {', '.join(source.required)} on every node); set it, or give {flag_name(path)}"
    )


def cluster_launch(environ: Mapping[str, str]) -> ClusterLaunch:
    """The launch settings the one cluster source in ``environ`` determines. Two sources at
    once (a SLURM job's variables and the torch runtime's) is a conflict, never a guess: their
    node counts, ranks and hosts need not agree, and a node that picked the other one would
    join no rendezvous or write another node's files."""
    found = [(s, source_values(s, environ)) for s in CLUSTER_SOURCES]
    found = [(s, v) for s, v in found if v.source is not None]
    if not found:
        return ClusterLaunch()
    (first, launch), *others = found
    if others:
        other = others[0][0]
        var_a, var_b = _set(environ, first.present) or "", _set(environ, other.present) or ""
        return ClusterLaunch(
            first,
            conflict=(
                var_b,
                f"set together with {var_a}: this node is under {first.name} and"
                f" {other.name} at once, and mlaunch will not guess whose node count, rank and"
                f" rendezvous host to use; unset the variables of the one it is not under",
            ),
        )
    return launch


def source_of(variable: str) -> ClusterSource | None:
    """The cluster source that reads ``variable`` (a setting's recorded source), or None."""
    return next((s for s in CLUSTER_SOURCES if variable in s.variables()), None)


def visible_gpu_count(environ: Mapping[str, str], dev_dir: Path = DEV_DIR) -> int:
    """The GPUs a worker on this node would see, without importing torch: the entries of
    ``CUDA_VISIBLE_DEVICES`` when it is set (up to the first invalid one, as CUDA reads it),
    else the NVIDIA device files (``/dev/nvidiaN``: in a container, the GPUs it was given)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = 0
        for entry in visible.split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break
            count += 1
        return count
    try:
        return sum(1 for name in os.listdir(dev_dir) if _NVIDIA_DEVICE.fullmatch(name))
    except OSError:
        return 0


def nproc_count(
    word: str,
    variable: str,
    device: str,
    device_text: str,
    environ: Mapping[str, str],
    dev_dir: Path = DEV_DIR,
) -> tuple[int | None, str]:
    """``(processes per node, how it was counted)`` for one of torchrun's ``--nproc-per-node``
    words, counted as torchrun counts them (``gpu``: the GPUs; ``cpu``: ``os.cpu_count()``;
    ``auto``: the GPUs when there are any, else the CPUs) where ``device`` allows; ``(None, why
    not)`` when the word and the device disagree. ``device_text`` names the device and its
    source for the message."""
    gpus = visible_gpu_count(environ, dev_dir)
    cpus = os.cpu_count() or 1
    fix = "give a number of processes per node instead"
    none_visible = "no GPU is visible here (no /dev/nvidiaN device, or CUDA_VISIBLE_DEVICES empty)"
    if word == "cpu" and device == "cuda":
        return (
            None,
            f"'cpu' (a process per CPU) does not fit the {device_text}; {fix}, or --device cpu|auto",
        )
    if word == "gpu" and device == "cpu":
        return (
            None,
            f"'gpu' (a process per GPU) does not fit the {device_text}; {fix}, or --device cuda|auto",
        )
    if word == "gpu" or (word == "auto" and device != "cpu" and gpus):
        if not gpus:
            return None, f"'gpu' counts the GPUs, and {none_visible}; {fix}"
        return gpus, f"{variable}={word}: {gpus} visible GPU(s)"
    if word == "auto" and device == "cuda":
        return None, f"'auto' with the {device_text} counts the GPUs, and {none_visible}; {fix}"
    return cpus, f"{variable}={word}: {cpus} CPU(s)"
