"""``mlaunch doctor``: checks of the machine and the configuration before a run.

Every check is a function returning :class:`CheckResult` values (pass / warn / fail, a message
and a one-line fix); :func:`run_doctor` runs them all and never raises. The CLI only renders.

The configuration is validated by :func:`mlaunch.settings.collect_problems`, the same sources
and model as ``mlaunch train``. torch is never imported here: it is probed in a subprocess with a
timeout (started first, collected last), so the command answers in seconds even when importing
torch is slow. grpc and the OTLP protobufs are imported only by the OTLP probe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.metadata
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from mlaunch.endpoints import bracket
from mlaunch.endpoints import redact as redact_url
from mlaunch.envcontract import FALLBACK_PREFIX, PRIMARY_PREFIX
from mlaunch.model.groups import ALL_GROUPS as ALL_SPAN_GROUPS
from mlaunch.model.strategies import exporting_ranks, format_ranks
from mlaunch.settings import (
    ALIAS_KEYS,
    OTEL_ENV,
    RATIO_SAMPLERS,
    SECRET_ENV,
    TELEMETRY_KEYS,
    TRACE_SAMPLERS,
    Settings,
    collect_problems,
    load_settings,
    parse_bool,
    redact_shown,
)

Status = Literal["pass", "warn", "fail"]
STATUSES: tuple[Status, ...] = ("pass", "warn", "fail")

#: Seconds a network probe (TCP connect, OTLP export, peer identification) may take.
NET_TIMEOUT_S = 2.0
#: Seconds the torch subprocess may take to import torch and describe the devices.
TORCH_TIMEOUT_S = 20.0
#: Seconds the ``--deep`` all-reduce subprocesses may take, start-up included.
ALLREDUCE_TIMEOUT_S = 90.0

#: The distributions doctor reports, in order (their ranges come from mlaunch's metadata).
PACKAGES: tuple[str, ...] = (
    "mlaunch",
    "torch",
    "numpy",
    "opentelemetry-api",
    "opentelemetry-sdk",
    "opentelemetry-exporter-otlp-proto-grpc",
    "opentelemetry-exporter-otlp-proto-http",
    "opentelemetry-proto",
)
#: The tested version to install when a range alone would be a poor fix (torch: the CPU build
#: mlaunch is tested with; see README).
TESTED_PINS: dict[str, str] = {"torch": "2.13.0"}

#: The OTLP/gRPC trace export method.
GRPC_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
#: Bytes per parameter in a checkpoint: fp32 weights (4) + AdamW's two fp32 moments (8).
CHECKPOINT_BYTES_PER_PARAM = 12
#: Byte-level tokenizer vocabulary of mlaunch's trainer.
VOCAB_SIZE = 256
#: Room for logs, traces and progress records besides checkpoints.
RUN_DIR_MARGIN_BYTES = 256 * 2**20


@dataclasses.dataclass(frozen=True, slots=True)
class CheckResult:
    """One check's verdict: ``fix`` is a one-line remedy ("" when there is nothing to do)."""

    name: str
    status: Status
    message: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        """The JSON form: ``{"name", "status", "message", "fix"}``."""
        return {"name": self.name, "status": self.status, "message": self.message, "fix": self.fix}


def ok(name: str, message: str, fix: str = "") -> CheckResult:
    """A passing result."""
    return CheckResult(name, "pass", message, fix)


def warn(name: str, message: str, fix: str) -> CheckResult:
    """A warning: the run may start, but something is likely wrong."""
    return CheckResult(name, "warn", message, fix)


def fail(name: str, message: str, fix: str) -> CheckResult:
    """A failure: fix this before running."""
    return CheckResult(name, "fail", message, fix)


def summarize(results: Iterable[CheckResult]) -> dict[str, int]:
    """``{"pass": n, "warn": n, "fail": n}``."""
    counts = dict.fromkeys(STATUSES, 0)
    for r in results:
        counts[r.status] += 1
    return counts


def to_json(results: Sequence[CheckResult]) -> dict[str, Any]:
    """The pinned ``--json`` shape: ``{"checks": [...], "summary": {...}}``."""
    return {"checks": [r.to_dict() for r in results], "summary": summarize(results)}


def exit_code(results: Iterable[CheckResult]) -> int:
    """0 when nothing fails, 1 otherwise."""
    return 1 if any(r.status == "fail" for r in results) else 0


def _guard(name: str, fn: Callable[[], list[CheckResult]]) -> list[CheckResult]:
    """Run one check; a bug in it becomes a failed result, never a traceback."""
    try:
        return fn()
    except Exception as exc:  # doctor must always answer
        return [
            fail(
                name,
                f"the check itself crashed: {type(exc).__name__}: {exc}",
                "report this as an mlaunch bug",
            )
        ]


# --------------------------------------------------------------------------------------------
# Python and packages


def _requirements() -> tuple[str | None, dict[str, str]]:
    """mlaunch's Requires-Python and ``{distribution: specifier}`` from its metadata, falling
    back to the source tree's pyproject.toml when mlaunch is not installed."""
    try:
        meta = importlib.metadata.metadata("mlaunch")
        python = meta.get("Requires-Python")
        reqs = importlib.metadata.requires("mlaunch") or []
    except importlib.metadata.PackageNotFoundError:
        import tomllib

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        try:
            project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
        except (OSError, KeyError, ValueError):
            return None, {}
        python, reqs = project.get("requires-python"), project.get("dependencies", [])
    ranges: dict[str, str] = {}
    for req in reqs:
        if ";" in req:  # extras (tests) and environment markers are not runtime needs
            continue
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)", req)
        if m:
            ranges[_canonical(m.group(1))] = m.group(3).strip()
    return python, ranges


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version (``2.13.0+cpu`` -> (2, 13, 0))."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def satisfies(version: str, specifier: str) -> bool:
    """Whether ``version`` meets ``specifier`` (``>=1.25,<2``; release numbers only, which is
    all mlaunch's ranges use)."""
    have = _release(version)
    for part in filter(None, (p.strip() for p in specifier.split(","))):
        m = re.match(r"(~=|==|!=|<=|>=|<|>)\s*(\S+)", part)
        if not m:
            continue
        op, want_s = m.groups()
        want = _release(want_s.rstrip(".*"))
        width = max(len(have), len(want))
        a, b = have + (0,) * (width - len(have)), want + (0,) * (width - len(want))
        if op == "~=":
            prefix = want[:-1] if len(want) > 1 else want
            good = a >= b and have[: len(prefix)] == prefix
        else:
            good = {
                "==": a == b,
                "!=": a != b,
                "<=": a <= b,
                ">=": a >= b,
                "<": a < b,
                ">": a > b,
            }[op]
        if not good:
            return False
    return True


def _install_command(dist: str, specifier: str) -> str:
    if dist == "mlaunch":
        return "pip install -e .  (from the mlaunch checkout)"
    if dist in TESTED_PINS:
        return f"pip install '{dist}=={TESTED_PINS[dist]}'"
    return f"pip install '{dist}{specifier}'" if specifier else f"pip install {dist}"


def check_python(version_info: Sequence[int] | None = None) -> list[CheckResult]:
    """The running Python against mlaunch's ``requires-python``."""
    have = tuple(version_info or sys.version_info[:3])
    shown = ".".join(map(str, have[:3]))
    required, _ = _requirements()
    required = required or ">=3.11"
    if satisfies(shown, required):
        return [ok("python", f"Python {shown} ({sys.executable}) meets {required}")]
    return [
        fail(
            "python",
            f"Python {shown} does not meet mlaunch's requirement {required}",
            "create a virtual environment with Python 3.11 or newer and reinstall mlaunch there",
        )
    ]


def check_packages(
    packages: Sequence[str] = PACKAGES, ranges: Mapping[str, str] | None = None
) -> list[CheckResult]:
    """Each distribution is installed and within the range mlaunch declares."""
    if ranges is None:
        ranges = _requirements()[1]
    results = []
    for dist in packages:
        spec = ranges.get(_canonical(dist), "")
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            results.append(fail(dist, f"{dist} is not installed", _install_command(dist, spec)))
            continue
        if spec and not satisfies(version, spec):
            results.append(
                fail(
                    dist,
                    f"{dist} {version} is outside the supported range {spec}",
                    _install_command(dist, spec),
                )
            )
        else:
            results.append(ok(dist, f"{version}" + (f" (supported: {spec})" if spec else "")))
    return results


# --------------------------------------------------------------------------------------------
# torch, in subprocesses

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


class _Proc:
    """A subprocess in its own session, so a timeout kills it and everything it started."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        self.argv = list(argv)
        self.error: str | None = None
        self.popen: subprocess.Popen[str] | None = None
        self.started = time.monotonic()
        try:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=dict(env) if env is not None else None,
                start_new_session=True,
            )
        except OSError as exc:
            self.error = f"cannot start {self.argv[0]}: {exc}"

    def wait(self, timeout_s: float) -> tuple[int | None, str, str]:
        """``(returncode, stdout, stderr)``; returncode None when it ran past ``timeout_s``
        (measured from the start) and was killed."""
        if self.popen is None:
            return -1, "", self.error or ""
        remaining = max(0.0, timeout_s - (time.monotonic() - self.started))
        try:
            out, err = self.popen.communicate(timeout=remaining)
            return self.popen.returncode, out, err
        except subprocess.TimeoutExpired:
            self.kill()
            out, err = self.popen.communicate()
            return None, out, err

    def kill(self) -> None:
        """Kill the process group (no-op once it exited)."""
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.popen.pid, signal.SIGKILL)


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env() -> dict[str, str]:
    """The environment of torch subprocesses: the caller's, with gloo kept on loopback for the
    local all-reduce when nothing says otherwise (``lo`` on Linux)."""
    env = dict(os.environ)
    with contextlib.suppress(OSError):
        if "GLOO_SOCKET_IFNAME" not in env and any(n == "lo" for _, n in socket.if_nameindex()):
            env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


class AllReduceProbe:
    """A real ``world``-process all-reduce over ``backend`` on 127.0.0.1, in subprocesses."""

    def __init__(self, backend: str, world: int, python: Sequence[str], timeout_s: float) -> None:
        self.backend, self.world, self.timeout_s = backend, world, timeout_s
        port, env = _free_loopback_port(), _worker_env()
        self.procs = [
            _Proc(
                [*python, "-c", _ALLREDUCE_WORKER, backend, str(r), str(world), str(port),
                 str(timeout_s)],
                env,
            )
            for r in range(world)
        ]  # fmt: skip

    def result(self) -> CheckResult:
        """Wait for the workers and judge the sum they computed."""
        name = f"{self.backend} all-reduce"
        outcomes = [p.wait(self.timeout_s) for p in self.procs]
        for p in self.procs:
            p.kill()
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
            line = _last_line(out)
            if rc != 0 or line != "OK":
                why = line if line.startswith("WRONG") else _last_line(err) or f"exit code {rc}"
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
        self.proc = _Proc([*self.python, "-c", _TORCH_PROBE], _worker_env())
        # The gloo all-reduce needs no device facts, so it runs alongside everything else.
        self.gloo = AllReduceProbe("gloo", 2, self.python, ALLREDUCE_TIMEOUT_S) if deep else None

    def results(self, device: str = "auto") -> list[CheckResult]:
        """The torch, CUDA, NCCL and gloo checks (and the all-reduces with ``deep``)."""
        rc, out, err = self.proc.wait(self.timeout_s)
        if rc is None:
            if self.gloo:
                for p in self.gloo.procs:
                    p.kill()
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
            info = json.loads(_last_line(out))
        except ValueError:
            info = {"error": _last_line(err) or f"the probe exited with code {rc}"}
        if "error" in info:
            if self.gloo:
                for p in self.gloo.procs:
                    p.kill()
            return [
                fail(
                    "torch import",
                    f"torch cannot be imported: {info['error']}",
                    _install_command("torch", ""),
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
                    _install_command("torch", "") + " (a build with distributed support)",
                )
            )
        if self.gloo:
            results.append(self.gloo.result())
        if self.deep and info.get("cuda") and devices:
            world = min(2, len(devices))
            results.append(AllReduceProbe("nccl", world, self.python, ALLREDUCE_TIMEOUT_S).result())
        return results


# --------------------------------------------------------------------------------------------
# Configuration


def _telemetry_vars(environ: Mapping[str, str]) -> list[str]:
    names = [n for n in environ if n.startswith((PRIMARY_PREFIX, FALLBACK_PREFIX))]
    names += [n for n in OTEL_ENV if n in environ]
    names += [n for n in SECRET_ENV if n in environ and n not in OTEL_ENV]
    return sorted(set(names))


_BOOL_KEYS = frozenset(k for k, f in TELEMETRY_KEYS.items() if f.endswith("enabled")) | {
    "SAMPLING_STRATEGY"
}


def _normalized(key: str, value: str) -> str:
    v = value.strip()
    if key == "SAMPLING_STRATEGY":
        return "true" if v.lower() == "rank_aware" else "false"
    if key in _BOOL_KEYS:
        try:
            return str(parse_bool(v)).lower()
        except ValueError:
            return v.lower()
    return v.lower() if key in ("EXPORT_STRATEGY", "RANK_STRATEGY", "EXPORTER") else v


def _effective(environ: Mapping[str, str], prefix: str, key: str) -> tuple[str, str] | None:
    """The variable (key or alias) a prefix contributes for ``key``, as EnvSource reads it."""
    aliases = [a for a, target in ALIAS_KEYS.items() if target == key]
    for k in (key, *aliases):
        value = environ.get(prefix + k, "").strip()
        if value:
            return prefix + k, value
    return None


def _problem_result(field: str, message: str) -> CheckResult:
    """A settings problem as a failed check with a concrete fix."""
    sampler_vars = ("OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG")
    m = re.search(r"did you mean (\S+?)\?", message)
    if message.startswith("unknown variable"):
        short = f"{field} is not a telemetry variable" + (
            f" (did you mean {m.group(1)}?)" if m else ""
        )
        fix = f"rename {field} to {m.group(1)}" if m else f"unset {field}"
        if not m:
            short += f"; {message.partition('; ')[2]}"
        return fail("unknown variable", short, fix)
    if field in sampler_vars:
        fix = (
            f"set {field} to a ratio in [0, 1], e.g. 0.1"
            if field.endswith("_ARG")
            else f"set {field} to one of: {', '.join(TRACE_SAMPLERS)}"
        )
        return fail("sampler", f"{field}: {message}", fix)
    if field.isupper() and "_" in field:  # an environment variable
        return fail("config", f"{field}: {message}", f"fix or unset {field}")
    if field.startswith("--"):
        return fail("config", f"{field}: {message}", f"fix the value of {field}")
    if " [" in field:  # "FILE [section] key"
        return fail("config", f"{field}: {message}", "fix this key in the config file")
    section, _, key = field.partition(".")
    return fail(
        "config", f"{field}: {message}", f"set {key or field} in [{section}] of --config FILE"
    )


def _best_effort_settings(
    environ: Mapping[str, str], config: Path | None, problems: list[tuple[str, str]]
) -> Settings:
    """Settings for the checks that need them when the configuration has problems: without the
    offending variables, then without the config file, then the defaults."""
    bad = {field for field, _ in problems}
    cleaned = {k: v for k, v in environ.items() if k not in bad}
    for cfg in (config, None):
        settings, _ = collect_problems(environ=cleaned, config=cfg)
        if settings is not None:
            return settings
    return load_settings(environ={}, check_cross_fields=False)


def _train_default_note(environ: Mapping[str, str], enabled: bool, exporter: str | None) -> str:
    """What plain ``mlaunch train`` (its default config) does with telemetry, when that differs
    from what doctor checked without a config ('' when the same or unknown)."""
    from mlaunch.launcher.configs import DEFAULT_CONFIG, resolve_config

    try:
        path = resolve_config(None, Path.cwd())
    except Exception:  # noqa: BLE001 - a note only; the configuration check reports problems
        return ""
    train_settings, _ = collect_problems(environ=environ, config=path)
    if train_settings is None:
        return ""
    tt = train_settings.telemetry
    if (tt.enabled, tt.exporter) == (enabled, exporter):
        return ""
    return (
        f"plain `mlaunch train` uses config {DEFAULT_CONFIG!r}: telemetry"
        f" {'enabled' if tt.enabled else 'disabled'}, exporter {tt.exporter};"
        f" check that with `mlaunch doctor --config {DEFAULT_CONFIG}`"
    )


def check_configuration(
    environ: Mapping[str, str], config: Path | None = None
) -> tuple[list[CheckResult], Settings]:
    """Every telemetry variable through mlaunch's settings, plus what the settings accept but a
    user probably did not mean. Returns the results and the (best-effort) settings."""
    settings, problems = collect_problems(environ=environ, config=config)
    results = [_problem_result(field, message) for field, message in problems]
    if settings is None:
        settings = _best_effort_settings(environ, config, problems)
    names = _telemetry_vars(environ)
    shown = ", ".join(f"{n}={redact_shown(n, environ[n])}" for n in names)
    where = f" and {config}" if config else ""
    if not problems:
        results.insert(
            0,
            ok(
                "configuration",
                f"valid (the checks of mlaunch train): {len(names)} variable(s){where}"
                + (f": {shown}" if shown else "; defaults apply"),
            ),
        )
    results += _otel_typos(environ)
    results += _prefix_conflicts(environ)
    results += _alias_notes(environ)
    t = settings.telemetry
    checked = (
        f"with {config.name}" if config else "environment over the built-in defaults, no config"
    )
    note = "" if t.enabled else f"set {PRIMARY_PREFIX}ENABLED=true to export telemetry"
    if config is None:
        # Plain `mlaunch train` reads its default config (tiny: telemetry on), so a plain
        # doctor must not let "disabled" stand for what train will do.
        note = _train_default_note(environ, t.enabled, t.exporter) or note
    results.append(
        ok(
            "telemetry",
            f"{'enabled' if t.enabled else 'disabled'} ({checked}); exporter {t.exporter}; span"
            f" groups {t.span_groups!r} ({len(t.groups)} groups); strategy {t.export_strategy}",
            note,
        )
    )
    if t.enabled and t.otel.sdk_disabled:
        results.append(
            warn(
                "sdk disabled",
                "OTEL_SDK_DISABLED=true while telemetry is enabled: every OTel signal is a no-op",
                f"unset OTEL_SDK_DISABLED (or set {PRIMARY_PREFIX}ENABLED=false)",
            )
        )
    if not any(f in ("OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG") for f, _ in problems):
        results.append(_sampler_result(settings))
    results += _timeout_results(environ)
    results.append(_exporting_ranks_result(settings))
    return results, settings


_OTLP_SIGNAL_OPTIONS = (
    "ENDPOINT", "PROTOCOL", "HEADERS", "TIMEOUT", "CERTIFICATE", "COMPRESSION", "INSECURE",
    "CLIENT_KEY", "CLIENT_CERTIFICATE",
)  # fmt: skip
#: Standard OTel variables besides the ones mlaunch validates (OTEL_ENV), for typo detection.
KNOWN_OTEL_ENV: frozenset[str] = frozenset(
    {*OTEL_ENV, *SECRET_ENV}
    | {f"OTEL_EXPORTER_OTLP_{o}" for o in _OTLP_SIGNAL_OPTIONS}
    | {
        f"OTEL_EXPORTER_OTLP_{signal}_{o}"
        for signal in ("TRACES", "METRICS", "LOGS")
        for o in _OTLP_SIGNAL_OPTIONS
    }
    | {
        "OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_LOGS_EXPORTER",
        "OTEL_PROPAGATORS", "OTEL_LOG_LEVEL", "OTEL_METRIC_EXPORT_TIMEOUT",
        "OTEL_BSP_SCHEDULE_DELAY", "OTEL_BSP_EXPORT_TIMEOUT", "OTEL_BSP_MAX_QUEUE_SIZE",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT",
        "OTEL_ATTRIBUTE_COUNT_LIMIT", "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT",
        "OTEL_SPAN_EVENT_COUNT_LIMIT", "OTEL_SPAN_LINK_COUNT_LIMIT",
        "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE",
    }
)  # fmt: skip


def _otel_typos(environ: Mapping[str, str]) -> list[CheckResult]:
    """``OTEL_*`` names that are not standard but are one typo away from one mlaunch reads.

    A warning, not a failure: OTel has more variables than this list, so only near-misses of
    known names are reported (the SDK would silently ignore the typo).
    """
    out = []
    for name in sorted(environ):
        if not name.startswith("OTEL_") or name in KNOWN_OTEL_ENV:
            continue
        close = difflib.get_close_matches(name, sorted(KNOWN_OTEL_ENV), n=1, cutoff=0.85)
        if close:
            out.append(
                warn(
                    "unknown variable",
                    f"{name} is not an OpenTelemetry variable (did you mean {close[0]}?);"
                    " the SDK ignores it",
                    f"rename {name} to {close[0]}",
                )
            )
    return out


def _prefix_conflicts(environ: Mapping[str, str]) -> list[CheckResult]:
    out = []
    for key in TELEMETRY_KEYS:
        primary = _effective(environ, PRIMARY_PREFIX, key)
        fallback = _effective(environ, FALLBACK_PREFIX, key)
        if not primary or not fallback:
            continue
        (pv, pval), (fv, fval) = primary, fallback
        if _normalized(pv.removeprefix(PRIMARY_PREFIX), pval) != _normalized(
            fv.removeprefix(FALLBACK_PREFIX), fval
        ):
            out.append(
                warn(
                    "prefix conflict",
                    f"{pv}={pval!r} and {fv}={fval!r} differ; {pv} wins",
                    f"unset {fv} (or give both the same value)",
                )
            )
    return out


def _alias_notes(environ: Mapping[str, str]) -> list[CheckResult]:
    out = []
    for prefix in (PRIMARY_PREFIX, FALLBACK_PREFIX):
        for alias, target in ALIAS_KEYS.items():
            value = environ.get(prefix + alias, "").strip()
            if value:
                out.append(
                    ok(
                        "alias",
                        f"{prefix}{alias}={value} is honoured as {prefix}{target}; Megatron-LM's"
                        f" reference (nemo-lens) ignores {alias}",
                        f"for runs outside mlaunch, set {prefix}{target} instead",
                    )
                )
    return out


def _sampler_result(settings: Settings) -> CheckResult:
    t, o = settings.telemetry, settings.telemetry.otel
    sampler = o.traces_sampler or "parentbased_always_on (SDK default)"
    rank = (
        f"rank-aware sampler keeps ranks under {t.export_sample_rate:g}"
        if t.sampler_enabled
        else "rank-aware sampler off"
    )
    if o.traces_sampler_arg is not None and o.traces_sampler not in RATIO_SAMPLERS:
        return warn(
            "sampler",
            f"OTEL_TRACES_SAMPLER_ARG={o.traces_sampler_arg:g} is ignored by sampler {sampler}",
            "set OTEL_TRACES_SAMPLER=parentbased_traceidratio, or unset OTEL_TRACES_SAMPLER_ARG",
        )
    if o.traces_sampler in RATIO_SAMPLERS:
        ratio = 1.0 if o.traces_sampler_arg is None else o.traces_sampler_arg
        kept = ratio * (t.export_sample_rate if t.sampler_enabled else 1.0)
        return ok(
            "sampler",
            f"{o.traces_sampler} ratio {ratio:g}; {rank}; about {kept:.3g} of traces kept",
            "" if o.traces_sampler_arg is not None else "OTEL_TRACES_SAMPLER_ARG unset: ratio 1.0",
        )
    return ok("sampler", f"{sampler}; {rank}")


def _timeout_results(environ: Mapping[str, str]) -> list[CheckResult]:
    out = []
    for var in ("OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"):
        raw = environ.get(var, "").strip()
        try:
            value = float(raw)
        except ValueError:
            continue  # unset, or already reported by the settings
        if value >= 1000:
            out.append(
                warn(
                    "otlp timeout",
                    f"{var}={raw} looks like milliseconds, but the Python SDK reads seconds"
                    f" ({value / 3600:.1f} h)",
                    f"set {var}={value / 1000:g} (seconds)",
                )
            )
        else:
            out.append(ok("otlp timeout", f"{var}={raw} s"))
    return out


def _exporting_ranks_result(settings: Settings) -> CheckResult:
    t, launch = settings.telemetry, settings.launch
    world = settings.world_size
    layout = f"world size {world} ({launch.nnodes} node(s) x {launch.nproc_per_node})"
    if not t.enabled:
        return ok("exporting ranks", f"telemetry disabled: no rank exports ({layout})")
    ranks = exporting_ranks(
        t.export_strategy,
        world,
        nproc_per_node=launch.nproc_per_node,
        export_rank=t.export_rank,
        sample_rate=t.export_sample_rate,
    )
    if not ranks:
        return warn(
            "exporting ranks",
            f"no rank exports: {t.export_strategy} at rate {t.export_sample_rate:g}, {layout}",
            f"raise {PRIMARY_PREFIX}EXPORT_SAMPLE_RATE or use {PRIMARY_PREFIX}EXPORT_STRATEGY="
            "single_rank",
        )
    return ok(
        "exporting ranks",
        f"{t.export_strategy}: rank(s) {format_ranks(ranks)} of {layout} export",
    )


# --------------------------------------------------------------------------------------------
# The OTLP endpoint


@dataclasses.dataclass(frozen=True, slots=True)
class _Answer:
    """What one OTLP export attempt got back."""

    kind: Literal["otlp", "status", "grpc", "cert", "timeout", "refused", "broken"]
    detail: str = ""
    status: int = 0


def _host_port(url: str) -> tuple[str, int]:
    from mlaunch.endpoints import EndpointError, parse_endpoint

    try:
        ep = parse_endpoint(url, default_port=443 if url.strip().startswith("https") else 80)
    except EndpointError:
        return "localhost", 80
    return ep.host, ep.port


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _grpc_target(host: str, port: int) -> str:
    return f"{bracket(host)}:{port}"


def grpc_export(
    url: str, headers: Mapping[str, str], timeout_s: float, certificate: str | None = None
) -> _Answer:
    """An empty ExportTraceServiceRequest as a gRPC unary call (TLS for https URLs)."""
    if "grpc" not in sys.modules:
        # gRPC's C core logs failed handshakes to stderr; doctor reports them itself.
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    import grpc
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    host, port = _host_port(url)
    target = _grpc_target(host, port)
    options = [("grpc.enable_retries", 0)]
    if _is_loopback(host):
        options.append(("grpc.enable_http_proxy", 0))
    if urllib.parse.urlparse(url).scheme == "https":
        roots = Path(certificate).read_bytes() if certificate else None
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(roots), options)
    else:
        channel = grpc.insecure_channel(target, options)
    try:
        export = channel.unary_unary(
            GRPC_EXPORT_METHOD,
            request_serializer=ExportTraceServiceRequest.SerializeToString,
            response_deserializer=ExportTraceServiceResponse.FromString,
        )
        export(
            ExportTraceServiceRequest(),
            timeout=timeout_s,
            metadata=[(k.lower(), v) for k, v in headers.items()],
        )
        return _Answer("otlp")
    except grpc.RpcError as err:
        code = err.code() if hasattr(err, "code") else None
        details = (err.details() if hasattr(err, "details") else "") or ""
        if "CERTIFICATE_VERIFY_FAILED" in details or "certificate verify failed" in details:
            return _Answer("cert", details)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return _Answer("timeout", details)
        if code == grpc.StatusCode.UNAVAILABLE:
            return _Answer("broken", details)
        return _Answer("grpc", f"{code.name if code else 'UNKNOWN'}: {details}".strip())
    finally:
        channel.close()


def http_export(
    url: str, headers: Mapping[str, str], timeout_s: float, certificate: str | None = None
) -> _Answer:
    """An empty ExportTraceServiceRequest POSTed as ``application/x-protobuf``."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    host, _ = _host_port(url)
    body = ExportTraceServiceRequest().SerializeToString()
    request = urllib.request.Request(
        url,
        data=body,
        method="POST",
        headers={**headers, "Content-Type": "application/x-protobuf"},
    )
    context = ssl.create_default_context(cafile=certificate) if url.startswith("https") else None
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({} if _is_loopback(host) else None),
        urllib.request.HTTPSHandler(context=context),
    )
    try:
        with opener.open(request, timeout=timeout_s) as resp:
            status, ctype, data = resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as err:
        return _Answer(
            "status", err.headers.get("Content-Type", "") if err.headers else "", err.code
        )
    except urllib.error.URLError as err:
        return _classify_socket_error(err.reason)
    except Exception as exc:  # http.client.BadStatusLine and friends: not an HTTP/1 answer
        return _classify_socket_error(exc)
    if ctype.split(";")[0].strip() in ("application/x-protobuf", "application/protobuf") or (
        not ctype and not data
    ):
        try:
            ExportTraceServiceResponse.FromString(data)
            return _Answer("otlp", status=status)
        except Exception:
            pass
    return _Answer("status", ctype or "no Content-Type", status)


def _classify_socket_error(reason: object) -> _Answer:
    if isinstance(reason, ssl.SSLCertVerificationError):
        return _Answer("cert", str(reason.verify_message or reason))
    if isinstance(reason, TimeoutError | socket.timeout):
        return _Answer("timeout", str(reason))
    if isinstance(reason, ConnectionRefusedError):
        return _Answer("refused", str(reason))
    return _Answer("broken", f"{type(reason).__name__}: {reason}")


PeerKind = Literal["http1", "http2", "tls", "silent", "closes", "refused", "unreachable"]

_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def identify_peer(host: str, port: int, timeout_s: float) -> PeerKind:
    """What the server at ``host:port`` speaks, in plaintext first: the HTTP/2 connection
    preface draws a SETTINGS frame from a gRPC server and an ``HTTP/1.x`` error from an HTTP/1
    server; a peer that answers neither is tried with a TLS handshake."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "unreachable"
    data = b""
    with sock:
        try:
            sock.sendall(_H2_PREFACE)
            deadline = time.monotonic() + timeout_s
            while len(data) < 9:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = sock.recv(64)
                if not chunk:
                    break
                data += chunk
        except TimeoutError:
            if not data:
                return "silent"
        except OSError:
            pass
    if len(data) >= 9 and data[:3] < b"\x00\x40\x00" and data[3] == 0x04:
        return "http2"  # a SETTINGS frame (a small length, type 4) answers the preface
    if data.startswith(b"HTTP/") or (
        data and all(32 <= b < 127 or b in b"\r\n\t" for b in data[:64])
    ):
        # An HTTP/1 error page; some servers (Python's http.server) answer an unsupported
        # version HTTP/0.9-style, with the body only.
        return "http1"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as raw,
            context.wrap_socket(raw, server_hostname=host),
        ):
            return "tls"
    except (OSError, ssl.SSLError):
        return "closes"


def _describe_peer(kind: PeerKind) -> str:
    return {
        "http1": "a plaintext HTTP/1.1 server",
        "http2": "a plaintext HTTP/2 (gRPC) server",
        "tls": "a TLS server",
    }.get(kind, "a server")


def check_otlp(settings: Settings, timeout_s: float = NET_TIMEOUT_S) -> list[CheckResult]:
    """The OTLP endpoint: configured URL, TCP connect, then a real OTLP export probe."""
    t, o = settings.telemetry, settings.telemetry.otel
    if t.exporter != "otlp":
        what = {"file": "file exporter: no collector needed (traces go to the run directory)"}
        return [
            ok(
                "otlp endpoint",
                what.get(t.exporter or "", f"{t.exporter} exporter: no collector needed"),
            )
        ]
    url, protocol = o.endpoint, o.protocol
    src = settings.source("telemetry.otel.traces_endpoint")
    if src.kind == "default":
        src = settings.source("telemetry.otel.base_endpoint")
    var = src.name if src.kind == "env" else "OTEL_EXPORTER_OTLP_ENDPOINT"
    origin = f"from {src}" if src.kind != "default" else "the default"
    host, port = _host_port(url)
    results = [ok("otlp endpoint", f"{redact_url(url)} over {protocol} ({origin})")]
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except socket.gaierror as exc:
        return [*results, fail("otlp connect", f"cannot resolve {host!r} ({exc})",
                               f"fix the host name in {var}")]  # fmt: skip
    except ConnectionRefusedError:
        default = 4317 if protocol == "grpc" else 4318
        return [
            *results,
            fail(
                "otlp connect",
                f"connection refused at {host}:{port}: nothing listens there",
                f"start the collector, or point {var} at it (OTLP {protocol} usually listens"
                f" on port {default})",
            ),
        ]
    except TimeoutError:
        return [*results, fail("otlp connect", f"no TCP answer from {host}:{port} within"
                               f" {timeout_s:g} s", f"check the host in {var} and firewalls")]  # fmt: skip
    except OSError as exc:
        return [*results, fail("otlp connect", f"cannot connect to {host}:{port} ({exc})",
                               f"check {var}")]  # fmt: skip
    results.append(ok("otlp connect", f"TCP connect to {host}:{port} succeeded"))
    if o.certificate and not Path(o.certificate).is_file():
        return [
            *results,
            fail(
                "otlp probe",
                f"OTEL_EXPORTER_OTLP_CERTIFICATE={o.certificate} is not a file",
                "point OTEL_EXPORTER_OTLP_CERTIFICATE at the collector's CA certificate (PEM)",
            ),
        ]
    results.append(probe_otlp(url, protocol, dict(o.headers), timeout_s, o.certificate, var))
    return results


def _export(
    url: str, protocol: str, headers: Mapping[str, str], timeout_s: float, cert: str | None
) -> _Answer:
    if protocol == "grpc":
        return grpc_export(url, headers, timeout_s, cert)
    return http_export(url, headers, timeout_s, cert)


def probe_otlp(
    url: str,
    protocol: str,
    headers: Mapping[str, str],
    timeout_s: float = NET_TIMEOUT_S,
    certificate: str | None = None,
    var: str = "OTEL_EXPORTER_OTLP_ENDPOINT",
) -> CheckResult:
    """Whether ``url`` answers an empty trace export as an OTLP receiver over ``protocol``; on
    failure, a specific diagnosis (wrong protocol, TLS on one side only, wrong path, hang).
    ``headers`` are sent but never shown."""
    name = "otlp probe"
    answer = _export(url, protocol, headers, timeout_s, certificate)
    parsed = urllib.parse.urlparse(url)
    host, port = _host_port(url)
    hostport = f"{_grpc_target(host, port)}"
    if answer.kind == "otlp":
        return ok(name, f"{redact_url(url)} answers an empty trace export as an OTLP/{_proto_label(protocol)}"
                  " receiver")  # fmt: skip
    if answer.kind == "cert":
        return fail(
            name,
            f"the TLS certificate of {hostport} is not trusted ({answer.detail})",
            "set OTEL_EXPORTER_OTLP_CERTIFICATE to the collector's CA certificate (PEM)",
        )
    if answer.kind == "refused":
        return _refused(hostport, protocol, var)
    if answer.kind == "status":
        return _http_status_result(url, answer, var, headers)
    if answer.kind == "grpc":
        if answer.detail.startswith("UNIMPLEMENTED"):
            return fail(
                name,
                f"a gRPC server answers at {hostport}, but without the OTLP trace service"
                " (UNIMPLEMENTED)",
                f"point {var} at the collector's OTLP gRPC receiver (usually port 4317)",
            )
        if answer.detail.startswith(("UNAUTHENTICATED", "PERMISSION_DENIED")):
            return fail(
                name,
                f"the OTLP receiver at {hostport} rejected the credentials ({answer.detail.split(':')[0]})",
                "check OTEL_EXPORTER_OTLP_HEADERS (e.g. authorization=Bearer%20TOKEN)",
            )
        return fail(name, f"the gRPC peer at {hostport} answered {answer.detail}",
                    "check the collector's logs")  # fmt: skip
    # No usable answer: find out what the peer speaks.
    peer = identify_peer(host, port, timeout_s)
    if peer == "refused":
        return _refused(hostport, protocol, var)
    if peer == "unreachable":
        return fail(name, f"cannot connect to {hostport}", f"check the host and port in {var}")
    if peer == "silent":
        return fail(
            name,
            f"{hostport} accepts connections but never answers (no reply within {timeout_s:g} s)",
            "check the collector is healthy and that this port is its OTLP receiver",
        )
    if parsed.scheme == "https" and peer in ("http1", "http2"):
        return fail(
            name,
            f"TLS on one side only: the URL is https:// but {hostport} is {_describe_peer(peer)}",
            f"use http://{hostport} in {var}, or enable TLS on the collector",
        )
    if parsed.scheme == "http" and peer == "tls":
        return fail(
            name,
            f"TLS on one side only: the URL is http:// but {hostport} expects TLS",
            f"use https://{hostport} in {var} (with OTEL_EXPORTER_OTLP_CERTIFICATE for a private"
            " CA)",
        )
    if protocol == "grpc" and peer == "http1":
        other = http_export(
            f"{parsed.scheme}://{hostport}/v1/traces", headers, timeout_s, certificate
        )
        if other.kind == "otlp":
            return fail(
                name,
                f"an OTLP/HTTP receiver answers at {hostport}, but the protocol is grpc",
                "set OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf",
            )
        return fail(
            name,
            f"an HTTP/1.1 server (not OTLP/gRPC) answers on the gRPC endpoint {hostport}",
            f"point {var} at the collector's OTLP gRPC port (usually 4317)",
        )
    if protocol != "grpc" and peer == "http2":
        other = grpc_export(f"{parsed.scheme}://{hostport}", headers, timeout_s, certificate)
        if other.kind == "otlp":
            return fail(
                name,
                f"an OTLP/gRPC receiver answers at {hostport}, but the protocol is http/protobuf",
                "set OTEL_EXPORTER_OTLP_PROTOCOL=grpc",
            )
        return fail(
            name,
            f"a gRPC (HTTP/2) server, not an OTLP/HTTP receiver, answers on the HTTP endpoint"
            f" {hostport}",
            f"point {var} at the collector's OTLP HTTP port (usually 4318)",
        )
    if answer.kind == "timeout":
        return fail(
            name,
            f"{hostport} did not answer the OTLP export within {timeout_s:g} s",
            "check the collector is healthy and that this port is its OTLP receiver",
        )
    return fail(
        name,
        f"{hostport} is {_describe_peer(peer)} but did not answer as an OTLP/"
        f"{_proto_label(protocol)} receiver ({answer.detail})",
        f"point {var} at the collector's OTLP receiver",
    )


def _refused(hostport: str, protocol: str, var: str) -> CheckResult:
    default = 4317 if protocol == "grpc" else 4318
    return fail(
        "otlp probe",
        f"connection refused at {hostport}: nothing listens there",
        f"start the collector, or point {var} at it (OTLP {protocol} usually listens on port"
        f" {default})",
    )


def _proto_label(protocol: str) -> str:
    return "gRPC" if protocol == "grpc" else "HTTP"


def _http_status_result(
    url: str, answer: _Answer, var: str, headers: Mapping[str, str]
) -> CheckResult:
    name = "otlp probe"
    path = urllib.parse.urlparse(url).path
    code = answer.status
    if code == 404:
        if path.endswith("/v1/traces/v1/traces"):
            return fail(
                name,
                f"404 at {redact_url(url)}: the endpoint already ended with /v1/traces and mlaunch appends it",
                f"set {var} to the base URL, without /v1/traces",
            )
        if not path.endswith("/v1/traces"):
            return fail(
                name,
                f"404 at {redact_url(url)}: OTLP/HTTP receivers serve traces at /v1/traces, not {path or '/'}",
                "end OTEL_EXPORTER_OTLP_TRACES_ENDPOINT with /v1/traces (or set only the base"
                " OTEL_EXPORTER_OTLP_ENDPOINT)",
            )
        return fail(
            name,
            f"404 at {redact_url(url)}: an HTTP server answers, but has no OTLP receiver at /v1/traces",
            f"point {var} at the collector's OTLP HTTP port (usually 4318)",
        )
    if code in (401, 403):
        sent = "with the configured headers" if headers else "without OTEL_EXPORTER_OTLP_HEADERS"
        return fail(
            name,
            f"{code} from {redact_url(url)}: the receiver rejected the request {sent}",
            "set OTEL_EXPORTER_OTLP_HEADERS to the collector's credentials"
            " (e.g. authorization=Bearer%20TOKEN)",
        )
    if code in (429, 502, 503, 504):
        return warn(
            name,
            f"{code} from {redact_url(url)}: the receiver is busy or unavailable right now",
            "check the collector's health; exporters retry these codes",
        )
    if 200 <= code < 300:
        return fail(
            name,
            f"{redact_url(url)} answered {code} with {answer.detail}, not an OTLP protobuf response",
            f"point {var} at the collector's OTLP HTTP receiver (usually port 4318)",
        )
    return fail(
        name,
        f"{code} from {redact_url(url)}: an HTTP server that is not an OTLP/HTTP protobuf receiver",
        f"point {var} at the collector's OTLP HTTP receiver (usually port 4318)",
    )


# --------------------------------------------------------------------------------------------
# Rendezvous, run directory, cluster


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


def _bindable(host: str, port: int) -> OSError | None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return exc
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # Like torchrun's TCPStore: a port only in TIME_WAIT counts as free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            return exc
    return None


def check_rendezvous(settings: Settings, timeout_s: float = NET_TIMEOUT_S) -> list[CheckResult]:
    """A free rendezvous port: the configured ``rdzv_endpoint`` must be free on the node that
    hosts it (node 0, local address) and reachable from the others; else any free port."""
    launch = settings.launch
    if not launch.rdzv_endpoint:
        port = _free_loopback_port()
        return [
            ok("rendezvous port", f"free local port available (e.g. {port}); mlaunch picks one")
        ]
    host, _, port_s = launch.rdzv_endpoint.rpartition(":")
    host, port = host.strip("[]"), int(port_s)
    src = settings.source("launch.rdzv_endpoint")
    var = src.name if src.kind != "default" else "--rdzv-endpoint"
    err = _bindable(host, 0)
    if isinstance(err, socket.gaierror):
        return [
            fail(
                "rendezvous port",
                f"the rendezvous host {host!r} does not resolve ({err})",
                f"fix the host in {var} (node 0's address)",
            )
        ]
    local = err is None  # we can bind its address: the host is this machine
    if local and launch.node_rank == 0:
        busy = _bindable(host, port)
        if busy is not None:
            return [
                fail(
                    "rendezvous port",
                    f"{launch.rdzv_endpoint} is in use on this host ({busy.strerror or busy})",
                    f"stop what listens there or choose another port in {var}",
                )
            ]
        return [ok("rendezvous port", f"{launch.rdzv_endpoint} is free on this host (node 0)")]
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        return [
            warn(
                "rendezvous port",
                f"{launch.rdzv_endpoint} is not reachable yet ({exc}); node {launch.node_rank}"
                " joins the rendezvous hosted there",
                "start node 0 first, or check the host and port in " + var,
            )
        ]
    return [ok("rendezvous port", f"{launch.rdzv_endpoint} is reachable")]


def checkpoint_bytes(settings: Settings) -> tuple[int, int]:
    """``(parameters, bytes of the kept checkpoints)``: params = 12·L·h² + (V + seq)·h, each
    with 4 bytes of weights and 8 of AdamW state, times ``keep_last``."""
    m = settings.model
    params = 12 * m.num_layers * m.hidden_size**2 + (VOCAB_SIZE + m.seq_length) * m.hidden_size
    if m.untie_embeddings:
        params += VOCAB_SIZE * m.hidden_size
    return params, params * CHECKPOINT_BYTES_PER_PARAM * settings.training.keep_last


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def _existing_ancestor(path: Path) -> tuple[Path, Path | None]:
    """The nearest existing ancestor of ``path`` (or itself), and the first existing component
    that is not a directory (None when every existing component is one)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.is_dir():
        return probe, None
    return probe, probe


def check_run_dir(settings: Settings, cwd: Path | None = None) -> list[CheckResult]:
    """The run directory can be created and written, with room for the checkpoints."""
    base = Path(cwd or os.getcwd())
    given = settings.launch.run_dir
    run_dir = (base / given) if given else base / "runs"
    fix = "set launch.run_dir (--run-dir) to a writable directory"
    anchor, blocker = _existing_ancestor(run_dir)
    if blocker is not None:
        return [fail("run directory", f"cannot create {run_dir}: {blocker} is a file, not a"
                     " directory", fix)]  # fmt: skip
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
    ckpt_dir = Path(t.save) if t.save else run_dir / "checkpoints"
    ckpt_anchor = _existing_ancestor(base / ckpt_dir)[0] if checkpoints else anchor
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


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[01-04,07],gpu1`` -> ``node01``."""
    depth, first = 0, ""
    for ch in nodelist.strip():
        if ch == "," and depth == 0:
            break
        depth += {"[": 1, "]": -1}.get(ch, 0)
        first += ch
    # Each bracket group contributes its first value (zero padding kept).
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], first)


def check_slurm(environ: Mapping[str, str], settings: Settings) -> list[CheckResult]:
    """SLURM detection and the launch values mlaunch derives from it."""
    job = environ.get("SLURM_JOB_ID", "").strip()
    if not job:
        return [ok("slurm", "not under SLURM (no SLURM_JOB_ID)")]
    nodelist = (environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or "").strip()
    nnodes = (environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES") or "").strip()
    node_rank = environ.get("SLURM_NODEID", "").strip()
    if not nodelist:
        return [
            warn(
                "slurm",
                f"SLURM job {job} without SLURM_JOB_NODELIST: no rendezvous host to derive",
                "run inside the allocation (sbatch/srun), or pass --rdzv-endpoint",
            )
        ]
    host = first_slurm_host(nodelist)
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


# --------------------------------------------------------------------------------------------
# The worker side: nemo-lens's own configuration loader on what the workers would get

#: Seconds the worker interpreter may take to import nemo-lens and resolve its configuration.
WORKER_TIMEOUT_S = 20.0
#: Ranks the probe asks the export strategy about (a larger world is compared on these).
WORKER_PROBE_RANKS = 4096

#: Runs under the WORKER's interpreter (not mlaunch's: it may be another Python, without mlaunch),
#: in the environment mlaunch would hand the workers, with Megatron-LM's --otel-* arguments. It
#: does what Megatron-LM's ``_set_telemetry`` and nemo-lens's ``setup_telemetry`` do up to the
#: point of exporting, and prints one JSON object: what nemo-lens resolved, or what it raised.
_LENS_PROBE = r"""
import json, os, sys
spec = json.loads(sys.argv[1])
out = {"python": sys.version.split()[0]}
try:
    import nemo.lens
    from nemo.lens import NemoLensConfig
    from nemo.lens.groups import SpanGroup
    from nemo.lens.strategies import get_export_strategy
except ImportError as exc:
    out.update(importable=False, error=f"{type(exc).__name__}: {exc}")
    print(json.dumps(out))
    sys.exit(0)
out.update(importable=True, version=getattr(nemo.lens, "__version__", "?"))
try:
    from megatron.core.telemetry.span_groups import MegatronSpanGroup as groups_cls
    out["span_group_class"] = "Megatron-LM's MegatronSpanGroup"
except Exception:
    groups_cls = type("MegatronSpanGroup", (SpanGroup,), {
        "ALL_GROUPS": frozenset(spec["groups"]),
        "_PRESETS": {k: frozenset(v) for k, v in spec["presets"].items()},
    })
    out["span_group_class"] = "an equivalent of Megatron-LM's MegatronSpanGroup"
args = spec["args"]
def flag(name):
    for i, a in enumerate(args):
        if a == name:
            return True if name == spec["enabled_arg"] else (args[i + 1] if i + 1 < len(args) else None)
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None
stage = "NemoLensConfig.from_env"
try:
    config = NemoLensConfig.from_env(
        prefix=spec["prefix"], fallback_prefix=spec["fallback_prefix"], span_group_cls=groups_cls
    )
    if not os.environ.get("OTEL_SERVICE_NAME", "").strip():
        config.service_name = spec["default_service_name"]
    if flag(spec["enabled_arg"]):
        config.enabled = True
    if flag(spec["service_name_arg"]):
        config.service_name = flag(spec["service_name_arg"])
    if flag(spec["span_groups_arg"]):
        config.span_groups = flag(spec["span_groups_arg"])
    out.update(enabled=config.enabled, service_name=config.service_name,
               exporter=config.exporter, export_strategy=config.export_strategy,
               span_spec=config.span_groups, sampler_enabled=config.sampler_enabled,
               export_sample_rate=config.export_sample_rate, span_groups=[],
               exporting_ranks=[])
    stage = "export strategy lookup"
    strategy = get_export_strategy(config.export_strategy)
    ranks = []
    for rank in range(spec["ranks"]):
        os.environ["LOCAL_RANK"] = str(rank % spec["nproc_per_node"])
        if strategy(config, rank, spec["world"]):
            ranks.append(rank)
    if config.enabled:
        out["exporting_ranks"] = ranks
    if config.enabled and ranks:
        from nemo.lens import providers
        stage = "exporter"
        if config.traces_enabled:
            providers._build_span_exporter(config).shutdown()
        if config.metrics_enabled:
            providers._build_metric_exporter(config).shutdown()
        out["protocol"] = providers._resolve_otlp_protocol("traces")
        stage = "span groups"
        out["span_groups"] = sorted(config.resolved_span_groups)
        if config.sampler_enabled and config.traces_enabled:
            from nemo.lens.sampling import RankAwareSampler
            out["sampled_ranks"] = [
                r for r in ranks
                if RankAwareSampler(r, spec["world"], config.export_sample_rate)._should_sample
            ]
except Exception as exc:
    out.update(error=f"{type(exc).__name__}: {exc}", stage=stage)
print(json.dumps(out))
"""


def worker_probe(
    python: str, env: Mapping[str, str], args: Sequence[str], settings: Settings, timeout_s: float
) -> dict[str, Any]:
    """Run :data:`_LENS_PROBE` under ``python`` in ``env``; its JSON, or ``{"failed": why}``."""
    from mlaunch.launcher import reference
    from mlaunch.model.groups import PRESETS, REFERENCE_PRESETS
    from mlaunch.settings import TelemetrySettings

    spec = {
        "args": list(args),
        # What Megatron-LM's _set_telemetry passes and overrides (MEGATRON.md section 1).
        "prefix": PRIMARY_PREFIX.rstrip("_"),
        "fallback_prefix": FALLBACK_PREFIX.rstrip("_"),
        "default_service_name": TelemetrySettings.model_fields["service_name"].default,
        "enabled_arg": reference.OTEL_ENABLED_ARG,
        "service_name_arg": reference.OTEL_SERVICE_NAME_ARG,
        "span_groups_arg": reference.OTEL_SPAN_GROUPS_ARG,
        "world": settings.world_size,
        "ranks": min(settings.world_size, WORKER_PROBE_RANKS),
        "nproc_per_node": settings.launch.nproc_per_node,
        # Megatron-LM's group class, for a worker Python without Megatron-LM installed: its
        # groups and reference presets are mlaunch's (pinned equal by the model's tests).
        "groups": sorted(g.value for g in ALL_SPAN_GROUPS),
        "presets": {k: sorted(g.value for g in PRESETS[k]) for k in sorted(REFERENCE_PRESETS)},
    }
    proc = _Proc([python, "-c", _LENS_PROBE, json.dumps(spec)], env)
    code, out, err = proc.wait(timeout_s)
    if code is None:
        return {"failed": f"{python} did not answer within {timeout_s:g} s"}
    try:
        return dict(json.loads(_last_line(out)))
    except (ValueError, TypeError):
        return {"failed": f"{python} exited {code}: {_last_line(err) or _last_line(out) or '?'}"}


def _compare(found: Mapping[str, Any], plan: Mapping[str, Any]) -> list[str]:
    """``key: worker X, mlaunch Y`` for every value the worker resolves differently."""
    return [
        f"{key}: worker {found.get(key)!r}, mlaunch {want!r}"
        for key, want in plan.items()
        if found.get(key) != want
    ]


def check_worker_side(
    settings: Settings,
    environ: Mapping[str, str],
    *,
    worker_python: str | None = None,
    timeout_s: float = WORKER_TIMEOUT_S,
) -> list[CheckResult]:
    """What a ``--script``/``--module`` worker (Megatron-LM through nemo-lens) would resolve from
    the environment and arguments mlaunch hands it, side by side with mlaunch's plan.

    Runs nemo-lens's real configuration loader under the worker interpreter (``worker_python``,
    default this one) in a subprocess with a timeout. A run of mlaunch's own trainer needs no
    nemo-lens: then an interpreter without it is a note, not a warning.
    """
    from mlaunch.launcher import reference
    from mlaunch.launcher import worker_args as lp_args
    from mlaunch.launcher import worker_env as lp_env

    name = "worker telemetry"
    external = not settings.uses_builtin_trainer or worker_python is not None
    python = worker_python or sys.executable
    results: list[CheckResult] = []
    if external:
        for field, message in reference.refusals(settings):
            results.append(
                fail("script worker", f"{field}: {message}", f"change {field} as the message says")
            )
    t = settings.telemetry
    run_id = t.run_id or "doctor"
    env, removed, _ = lp_env.worker_environment(
        settings, run_id, Path.cwd() / "runs" / run_id, environ, external=True
    )
    child = {k: v for k, v in environ.items() if k not in removed}
    child.update(env)
    args = (
        lp_args.otel_flags(settings)
        if lp_args.resolve_megatron_args(settings, Path.cwd())[0]
        else []
    )
    found = worker_probe(python, child, args, settings, timeout_s)
    if "failed" in found:
        return [*results, warn(name, f"could not run the worker probe: {found['failed']}",
                               "check --worker-python (a Python that can import nemo.lens)")]  # fmt: skip
    if not found.get("importable"):
        message = (
            f"{python} (Python {found.get('python')}) cannot import nemo.lens: a Megatron-LM"
            " worker run by it would silently run with telemetry off"
        )
        fix = (
            "install nemo-lens[sdk]==0.1.0 (Python >= 3.13) for the workers, or name their"
            " interpreter with --worker-python PATH"
        )
        return [*results, warn(name, message, fix) if external else ok(name, message, fix)]
    who = f"nemo-lens {found.get('version')} under {python} ({found.get('span_group_class')})"
    if "error" in found:
        return [
            *results,
            fail(
                name,
                f"{who} raises at {found.get('stage')}: {found['error']} -- a Megatron-LM worker"
                " would stop at start-up",
                "fix the setting it names (see the configuration checks above)",
            ),
        ]
    try:
        ranks = exporting_ranks(
            t.export_strategy,
            min(settings.world_size, WORKER_PROBE_RANKS),
            nproc_per_node=settings.launch.nproc_per_node,
            export_rank=t.export_rank,
            sample_rate=t.export_sample_rate,
        )
    except Exception:  # a custom strategy: refused above, nothing to compare
        ranks = []
    ranks = [r for r in ranks if r < settings.world_size] if t.enabled else []
    view = reference.reference_view(settings)
    plan = {
        "enabled": t.enabled,
        "exporter": view["exporter"],
        "export_strategy": t.export_strategy,
        "service_name": t.service_name,
        "sampler_enabled": t.sampler_enabled,
        "exporting_ranks": ranks,
        "span_groups": view["span_groups"] if t.enabled and ranks else [],
    }
    resolved = (
        f"enabled {found.get('enabled')}, groups {','.join(found.get('span_groups') or []) or '-'},"
        f" exporter {found.get('exporter')}"
        + (f" ({found['protocol']})" if found.get("protocol") else "")
        + f", strategy {found.get('export_strategy')}, exporting ranks"
        f" {format_ranks(found.get('exporting_ranks') or []) or 'none'}"
        + (
            f", rank-aware sampler keeps ranks {format_ranks(found['sampled_ranks']) or 'none'}"
            if "sampled_ranks" in found
            else ""
        )
    )
    diffs = _compare(found, plan)
    if diffs:
        return [
            *results,
            fail(
                name,
                f"{who} resolves {resolved}; it differs from mlaunch's plan: {'; '.join(diffs)}",
                "report this as an mlaunch bug (the translation table is wrong for this setting)",
            ),
        ]
    receiver = " (endpoint: the launcher's embedded receiver)" if view["embedded_receiver"] else ""
    return [*results, ok(name, f"{who} resolves {resolved}{receiver}; matches mlaunch's plan")]


# --------------------------------------------------------------------------------------------
# Everything


def run_doctor(
    *,
    config: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    deep: bool = False,
    cwd: Path | None = None,
    net_timeout_s: float = NET_TIMEOUT_S,
    torch_timeout_s: float = TORCH_TIMEOUT_S,
    python: Sequence[str] = (sys.executable,),
    worker_python: str | None = None,
    worker_timeout_s: float = WORKER_TIMEOUT_S,
) -> list[CheckResult]:
    """Run every check, in a stable order; never raises.

    ``environ`` is the environment the configuration is read from (default: this process's);
    ``python`` is the interpreter command the torch probes run with; ``worker_python`` the one
    a ``--script`` worker runs with (default: this one), for the worker-side check.
    """
    environ = os.environ if environ is None else environ
    config_path = Path(config) if config is not None else None
    probe: TorchProbe | None = None
    try:
        probe = TorchProbe(python, torch_timeout_s, deep)  # runs while the other checks do
        results = _guard("python", check_python)
        results += _guard("packages", check_packages)
        torch_at = len(results)
        state: dict[str, Settings] = {}

        def config_checks() -> list[CheckResult]:
            found, state["settings"] = check_configuration(environ, config_path)
            return found

        results += _guard("configuration", config_checks)
        settings = state.get("settings") or load_settings(environ={}, check_cross_fields=False)
        results += _guard(
            "worker telemetry",
            lambda: check_worker_side(
                settings, environ, worker_python=worker_python, timeout_s=worker_timeout_s
            ),
        )
        results += _guard("otlp endpoint", lambda: check_otlp(settings, net_timeout_s))
        results += _guard("hostname", check_hostname)
        results += _guard("rendezvous port", lambda: check_rendezvous(settings, net_timeout_s))
        results += _guard("run directory", lambda: check_run_dir(settings, cwd))
        results += _guard("slurm", lambda: check_slurm(environ, settings))
        results += _guard("kubernetes", lambda: check_kubernetes(environ))
        device = settings.launch.device
        results[torch_at:torch_at] = _guard("torch import", lambda: probe.results(device))  # type: ignore[union-attr]
        return results
    finally:
        if probe is not None:
            probe.proc.kill()
            if probe.gloo:
                for p in probe.gloo.procs:
                    p.kill()
