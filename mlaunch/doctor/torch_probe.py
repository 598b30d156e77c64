"""torch, CUDA, NCCL and gloo, described by subprocesses with a timeout: doctor itself never imports
torch, so it answers in seconds even when importing torch is slow."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from mlaunch.doctor.host import free_loopback_port
from mlaunch.doctor.packages import install_command
from mlaunch.doctor.process import ProbeProcess, last_line
from mlaunch.doctor.results import CheckResult, fail, ok, warn

#: Seconds the torch subprocess may take to import torch and describe the devices.
TORCH_TIMEOUT_S = 20.0
#: Seconds the ``--deep`` all-reduce subprocesses may take, start-up included.
ALLREDUCE_TIMEOUT_S = 90.0


_TORCH_PROBE = r"""
import json, sys
try:
    import torch
except BaseException as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    sys.exit(0)
import torch.distributed as dist
out = {"version": torch.__version__, "cuda_build": torch.version.cuda}
out["distributed"] = bool(dist.is_available())
out["cuda"] = bool(torch.cuda.is_available())
out["devices"] = (
    [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if out["cuda"] else []
)
out["gloo"] = bool(out["distributed"] and dist.is_gloo_available())
out["nccl"] = bool(out["distributed"] and dist.is_nccl_available())
out["nccl_version"] = None
if out["nccl"] and out["cuda"]:
    try:
        v = torch.cuda.nccl.version()
        out["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as exc:
        out["nccl_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""

# argv: backend rank world_size port timeout_s. Prints OK or WRONG ... on its last line.
_ALLREDUCE_WORKER = r"""
import datetime, sys
import torch
import torch.distributed as dist
backend, rank, world, port, timeout = sys.argv[1], *map(int, sys.argv[2:5]), float(sys.argv[5])
device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
if backend == "nccl":
    torch.cuda.set_device(device)
dist.init_process_group(
    backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
    timeout=datetime.timedelta(seconds=timeout),
)
t = torch.full((4,), float(rank + 1), device=device)
dist.all_reduce(t)
if backend == "nccl":
    torch.cuda.synchronize()
expected = world * (world + 1) / 2
got = t.tolist()
dist.destroy_process_group()
print("OK" if all(x == expected for x in got) else f"WRONG {got} (expected {expected})")
"""


def _worker_env() -> dict[str, str]:
    """The environment of torch subprocesses: the caller's, with gloo kept on loopback for the
    local all-reduce when nothing says otherwise (``lo`` on Linux)."""
    env = dict(os.environ)
    with contextlib.suppress(OSError):
        if "GLOO_SOCKET_IFNAME" not in env and any(n == "lo" for _, n in socket.if_nameindex()):
            env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def cuda_missing(python: Sequence[str], env: Mapping[str, str]) -> str | None:
    """Why workers started with ``python`` in ``env`` would find no CUDA device (a few words),
    or None (CUDA is there, or the probe could not tell: the workers then report it). The same
    probe as doctor's ``cuda`` check, for ``mlaunch train --device cuda`` before it starts."""
    proc = ProbeProcess([*python, "-c", _TORCH_PROBE], env)
    rc, out, _ = proc.wait(TORCH_TIMEOUT_S)
    if rc is None:
        proc.kill()
        return None
    try:
        info = json.loads(last_line(out))
    except ValueError:
        return None
    if "error" in info or info.get("cuda"):
        return None
    if not info.get("cuda_build"):
        return "this torch is a CPU-only build"
    if env.get("CUDA_VISIBLE_DEVICES", None) == "":
        return "CUDA_VISIBLE_DEVICES is empty"
    return "torch sees no GPU (check `nvidia-smi`)"


class AllReduceProbe:
    """A real ``world``-process all-reduce over ``backend`` on 127.0.0.1, in subprocesses."""

    def __init__(self, backend: str, world: int, python: Sequence[str], timeout_s: float) -> None:
        self.backend, self.world, self.timeout_s = backend, world, timeout_s
        port, env = free_loopback_port(), _worker_env()
        self.procs = [
            ProbeProcess(
                [*python, "-c", _ALLREDUCE_WORKER, backend, str(r), str(world), str(port),
                 str(timeout_s)],
                env,
            )
            for r in range(world)
        ]  # fmt: skip

    def kill(self) -> None:
        """Kill every worker and what it started (no-op for those that exited)."""
        for p in self.procs:
            p.kill()

    def result(self) -> CheckResult:
        """Wait for the workers and judge the sum they computed."""
        name = f"{self.backend} all-reduce"
        outcomes = [p.wait(self.timeout_s) for p in self.procs]
        self.kill()
        where = f"{self.world}-process {self.backend} all-reduce on 127.0.0.1"
        if any(rc is None for rc, _, _ in outcomes):
            return fail(
                name,
                f"{where} did not finish within {self.timeout_s:g} s",
                "check that nothing blocks loopback connections"
                + (" and that NCCL sees the GPUs (NCCL_DEBUG=INFO)" if self.backend == "nccl" else
                   " (set GLOO_SOCKET_IFNAME to a working interface)"),
            )  # fmt: skip
        for rank, (rc, out, err) in enumerate(outcomes):
            line = last_line(out)
            if rc != 0 or line != "OK":
                why = line if line.startswith("WRONG") else last_line(err) or f"exit code {rc}"
                return fail(
                    name,
                    f"{where} failed on rank {rank}: {why}",
                    f"run the torch.distributed {self.backend} tests of your install;"
                    " reinstall torch if they fail",
                )
        return ok(name, f"{where} returned the right sum")


class TorchProbe:
    """torch described by a subprocess: started by :meth:`start`, judged by :meth:`results`."""

    def __init__(self, python: Sequence[str], timeout_s: float, deep: bool) -> None:
        self.python, self.timeout_s, self.deep = list(python), timeout_s, deep
        self.proc = ProbeProcess([*self.python, "-c", _TORCH_PROBE], _worker_env())
        # The gloo all-reduce needs no device facts, so it runs alongside everything else.
        self.gloo = AllReduceProbe("gloo", 2, self.python, ALLREDUCE_TIMEOUT_S) if deep else None

    def kill(self) -> None:
        """Kill the probe and the gloo all-reduce workers (no-op for those that exited)."""
        self.proc.kill()
        if self.gloo:
            self.gloo.kill()

    def results(self, device: str = "auto") -> list[CheckResult]:
        """The torch, CUDA, NCCL and gloo checks (and the all-reduces with ``deep``)."""
        rc, out, err = self.proc.wait(self.timeout_s)
        if rc is None:
            if self.gloo:
                self.gloo.kill()
            # Not a failure: torch may be fine on a slow file system; it just went unchecked.
            return [
                warn(
                    "torch import",
                    f"importing torch did not finish within {self.timeout_s:g} s; torch, CUDA,"
                    " NCCL and gloo were not checked",
                    "check the file system holding site-packages (slow NFS?) and run"
                    " `python -c 'import torch'` to see what hangs",
                )
            ]
        try:
            info = json.loads(last_line(out))
        except ValueError:
            info = {"error": last_line(err) or f"the probe exited with code {rc}"}
        if "error" in info:
            if self.gloo:
                self.gloo.kill()
            return [
                fail(
                    "torch import",
                    f"torch cannot be imported: {info['error']}",
                    install_command("torch", ""),
                )
            ]
        return self._judge(info, device)

    def _judge(self, info: Mapping[str, Any], device: str) -> list[CheckResult]:
        results = [ok("torch import", f"torch {info['version']} imports in a subprocess")]
        devices: list[str] = info.get("devices") or []
        if info.get("cuda"):
            names = ", ".join(f"{i}: {n}" for i, n in enumerate(devices))
            results.append(ok("cuda", f"CUDA available, {len(devices)} device(s): {names}"))
        elif device == "cuda":
            results.append(
                fail(
                    "cuda",
                    "launch.device is cuda but CUDA is not available"
                    + ("" if info.get("cuda_build") else " (this torch is a CPU-only build)"),
                    "install a CUDA build of torch and check `nvidia-smi`, or use --device cpu",
                )
            )
        else:
            results.append(ok("cuda", "CUDA not available: workers run on CPU with gloo"))
        if info.get("cuda"):
            if info.get("nccl_version"):
                results.append(ok("nccl", f"NCCL {info['nccl_version']}"))
            else:
                results.append(
                    fail(
                        "nccl",
                        "CUDA is available but NCCL is not"
                        + (f" ({info['nccl_error']})" if info.get("nccl_error") else ""),
                        "install a torch build with NCCL (the standard CUDA wheels have it)",
                    )
                )
        else:
            results.append(ok("nccl", "not needed on CPU (no CUDA devices)"))
        if info.get("gloo"):
            results.append(ok("gloo", "gloo backend available"))
        else:
            results.append(
                fail(
                    "gloo",
                    "torch.distributed's gloo backend is not available",
                    install_command("torch", "") + " (a build with distributed support)",
                )
            )
        if self.gloo:
            results.append(self.gloo.result())
        if self.deep and info.get("cuda") and devices:
            world = min(2, len(devices))
            results.append(AllReduceProbe("nccl", world, self.python, ALLREDUCE_TIMEOUT_S).result())
        return results
