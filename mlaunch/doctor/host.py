"""This host and its cluster: host name, rendezvous port, run directory and disk space, SLURM and
Kubernetes."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from mlaunch.doctor.results import NET_TIMEOUT_S, CheckResult, fail, ok, warn
from mlaunch.launcher.rendezvous import check_endpoint, split_endpoint
from mlaunch.model.gpt_shape import count_parameters, gpt_config
from mlaunch.model.spec import quoted
from mlaunch.rundir import layout as lay
from mlaunch.settings import Settings

if TYPE_CHECKING:
    from mlaunch.launcher.plan import DirectoryPlace

#: Bytes per parameter in a checkpoint: fp32 weights (4) + AdamW's two fp32 moments (8).
CHECKPOINT_BYTES_PER_PARAM = 12
#: Room for logs, traces and progress records besides checkpoints.
RUN_DIR_MARGIN_BYTES = 256 * 2**20


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_hostname(hostname: str | None = None) -> list[CheckResult]:
    """The local host name resolves (torchrun's rendezvous advertises it)."""
    name = hostname or socket.gethostname()
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        return [
            fail(
                "hostname",
                f"the host name {name!r} does not resolve ({exc})",
                f"add '{name}' to /etc/hosts or fix DNS",
            )
        ]
    addrs = sorted({str(info[4][0]) for info in infos})
    return [ok("hostname", f"{name} resolves to {', '.join(addrs[:4])}")]


def check_rendezvous(
    settings: Settings, timeout_s: float = NET_TIMEOUT_S, environ: Mapping[str, str] | None = None
) -> list[CheckResult]:
    """The rendezvous endpoint, judged as ``mlaunch train`` judges it before a launch (its host
    resolves; on the node that hosts the store, the port is free), then, on a node that only
    connects, whether it is reachable yet. Without an endpoint, any free local port will do;
    under a scheduler (SLURM, the Kubeflow torch runtime) the endpoint and node rank are the
    ones the launcher derives from its variables."""
    from mlaunch.launcher.cluster_env import cluster_launch

    launch = settings.launch
    endpoint, node_rank, rdzv_id = launch.rdzv_endpoint, launch.node_rank, launch.rdzv_id
    label = settings.label("launch.rdzv_endpoint")
    if settings.source("launch.rdzv_endpoint").kind == "default":
        derived = cluster_launch(os.environ if environ is None else environ).values
        if "launch.rdzv_endpoint" in derived:
            endpoint, label = derived["launch.rdzv_endpoint"]
            rank = str(derived.get("launch.node_rank", ("", ""))[0])
            if settings.source("launch.node_rank").kind == "default" and rank.isdigit():
                node_rank = int(rank)
            rdzv_id = rdzv_id or derived.get("launch.rdzv_id", (None, ""))[0]
    if not endpoint:
        port = free_loopback_port()
        return [
            ok("rendezvous port", f"free local port available (e.g. {port}); mlaunch picks one")
        ]
    verdict = check_endpoint(
        endpoint, node_rank=node_rank, nnodes=launch.nnodes, backend=launch.rdzv_backend,
        rdzv_id=rdzv_id, label=label,
    )  # fmt: skip
    if verdict.problem is not None:
        return [fail("rendezvous port", verdict.problem, verdict.fix)]
    if verdict.hosts_store:
        return [ok("rendezvous port", verdict.note)]
    host, port = split_endpoint(endpoint)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        return [
            warn(
                "rendezvous port",
                f"{endpoint} is not reachable yet ({exc}); node {node_rank} joins the"
                " rendezvous hosted there",
                f"start node 0 first, or check the host and port in {label}",
            )
        ]
    return [ok("rendezvous port", f"{endpoint} is reachable")]


def checkpoint_bytes(settings: Settings) -> tuple[int, int]:
    """``(parameters, bytes of the kept checkpoints)``: the trainer's exact parameter count,
    each with 4 bytes of weights and 8 of AdamW state, times ``keep_last``."""
    params = count_parameters(gpt_config(settings.model))
    return params, params * CHECKPOINT_BYTES_PER_PARAM * settings.training.keep_last


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def _anchor(place: DirectoryPlace) -> Path:
    """Where a directory would be created: the nearest existing ancestor (the root when nothing
    exists, so the write probe reports it)."""
    return place.anchor if place.anchor is not None else Path(place.path.anchor)


def check_run_dir(settings: Settings, cwd: Path | None = None) -> list[CheckResult]:
    """The run directory can be created and written, with room for the checkpoints (``~`` is
    expanded in the run directory and the checkpoint directory, as ``mlaunch train`` does)."""
    from mlaunch.launcher.configs import os_reason
    from mlaunch.launcher.plan import DirectoryPlace

    base = Path(cwd or os.getcwd())
    given = settings.launch.run_dir
    run_dir = (base / Path(given).expanduser()) if given else base / "runs"
    fix = "set launch.run_dir (--run-dir) to a writable directory"
    try:
        place = DirectoryPlace.of(run_dir)
    except OSError as exc:  # e.g. a 5,000-character name: ENAMETOOLONG from stat itself
        return [fail("run directory", f"cannot use {quoted(str(run_dir))}: {os_reason(exc)}", fix)]
    if place.blocker is not None:
        return [fail("run directory", f"cannot create {run_dir}: {place.blocker} is a file, not a"
                     " directory", fix)]  # fmt: skip
    anchor = _anchor(place)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".mlaunch-doctor-", dir=anchor)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        return [fail("run directory", f"{anchor} is not writable ({exc.strerror or exc})", fix)]
    where = str(run_dir) if anchor == run_dir else f"{run_dir} (to be created in {anchor})"
    results = [ok("run directory", f"{where} is writable")]
    t = settings.training
    checkpoints = bool(t.save) or t.save_interval > 0
    ckpt_dir = Path(t.save).expanduser() if t.save else run_dir / lay.CHECKPOINTS_DIR
    ckpt_anchor = anchor
    if checkpoints:
        try:
            ckpt_anchor = _anchor(DirectoryPlace.of(base / ckpt_dir))
        except OSError as exc:
            return [
                *results,
                fail(
                    "disk space",
                    f"cannot use {quoted(str(base / ckpt_dir))}: {os_reason(exc)}",
                    "set training.save (--save) to a usable directory",
                ),
            ]
    params, ckpt = checkpoint_bytes(settings) if checkpoints else (0, 0)
    need = int(ckpt * 1.2) + RUN_DIR_MARGIN_BYTES
    free = shutil.disk_usage(ckpt_anchor).free
    what = (
        f"{t.keep_last} checkpoint(s) of a {params / 1e6:.3g} M-parameter model need about"
        f" {_human(ckpt)}"
        if checkpoints
        else "no checkpoints configured"
    )
    if free < need:
        results.append(
            fail(
                "disk space",
                f"{_human(free)} free at {ckpt_anchor}; {what} (+ margin: {_human(need)})",
                "free space, lower training.keep_last, or put checkpoints elsewhere (--save)",
            )
        )
    else:
        results.append(ok("disk space", f"{_human(free)} free at {ckpt_anchor}; {what}"))
    return results


def check_slurm(environ: Mapping[str, str], settings: Settings) -> list[CheckResult]:
    """SLURM detection and the launch values mlaunch derives from it (the launcher's own
    derivation, so doctor shows what ``mlaunch train`` will use)."""
    from mlaunch.launcher.cluster_env import SLURM, source_values

    slurm = source_values(SLURM, environ)
    derived_values = slurm.values
    if "launch.rdzv_endpoint" in slurm.problems:  # a MASTER_PORT that is no port
        var, why = slurm.problems["launch.rdzv_endpoint"]
        return [fail("slurm", f"{var}: {why}", f"set {var} to a free port, or unset it")]
    if not derived_values:
        return [ok("slurm", "not under SLURM (no SLURM_JOB_ID)")]
    job = derived_values["launch.rdzv_id"][0]
    nnodes = derived_values.get("launch.nnodes", ("", ""))[0]
    node_rank = derived_values.get("launch.node_rank", ("", ""))[0]
    endpoint = derived_values.get("launch.rdzv_endpoint")
    if endpoint is None:  # no node list (or one that names no host)
        return [
            warn(
                "slurm",
                f"SLURM job {job} without SLURM_JOB_NODELIST: no rendezvous host to derive",
                "run inside the allocation (sbatch/srun), or pass --rdzv-endpoint",
            )
        ]
    host = endpoint[0].rpartition(":")[0]  # the endpoint is "first host:port"
    derived = (
        f"SLURM job {job}: nnodes={nnodes or '?'}, node rank={node_rank or '?'}, rendezvous"
        f" host={host}, rendezvous id={job}"
    )
    src = settings.source("launch.nnodes")
    if nnodes.isdigit() and src.kind != "default" and int(nnodes) != settings.launch.nnodes:
        return [
            warn(
                "slurm",
                f"{derived}; but {src} sets nnodes={settings.launch.nnodes}",
                f"remove {src} or match the allocation ({nnodes} nodes)",
            )
        ]
    missing = [v for v, val in (("SLURM_NNODES", nnodes), ("SLURM_NODEID", node_rank)) if not val]
    if missing:
        return [warn("slurm", derived, f"{' and '.join(missing)} unset: start mlaunch with srun")]
    return [ok("slurm", derived)]


K8S_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def check_kubernetes(
    environ: Mapping[str, str], namespace_file: Path = K8S_NAMESPACE_FILE
) -> list[CheckResult]:
    """Kubernetes detection and the pod, namespace and node names for resource attributes."""
    if not environ.get("KUBERNETES_SERVICE_HOST", "").strip():
        return [ok("kubernetes", "not in Kubernetes (no KUBERNETES_SERVICE_HOST)")]

    def first(*names: str) -> str:
        return next((environ[n].strip() for n in names if environ.get(n, "").strip()), "")

    pod = first("POD_NAME", "K8S_POD_NAME", "HOSTNAME")
    namespace = first("POD_NAMESPACE", "K8S_NAMESPACE")
    if not namespace:
        with contextlib.suppress(OSError):
            namespace = namespace_file.read_text(encoding="utf-8").strip()
    node = first("NODE_NAME", "K8S_NODE_NAME")
    derived = f"Kubernetes: pod={pod or '?'}, namespace={namespace or '?'}, node={node or '?'}"
    missing = [
        env
        for env, val in (("POD_NAME", pod), ("POD_NAMESPACE", namespace), ("NODE_NAME", node))
        if not val
    ]
    if missing:
        return [
            warn(
                "kubernetes",
                derived + f" ({', '.join(missing)} unknown: missing from the resource attributes)",
                f"expose {', '.join(missing)} with the downward API (env valueFrom fieldRef)",
            )
        ]
    return [ok("kubernetes", derived)]
