"""The running Python and the installed distributions against the ranges mlaunch declares."""

from __future__ import annotations

import importlib.metadata
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from mlaunch.doctor.results import CheckResult, fail, ok

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


def _requirements() -> tuple[str | None, dict[str, str]]:
    """mlaunch's Requires-Python and ``{distribution: specifier}`` from its metadata, falling
    back to the source tree's pyproject.toml when mlaunch is not installed."""
    try:
        meta = importlib.metadata.metadata("mlaunch")
        python = meta.get("Requires-Python")
        reqs = importlib.metadata.requires("mlaunch") or []
    except importlib.metadata.PackageNotFoundError:
        import tomllib

        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
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


def install_command(dist: str, specifier: str) -> str:
    """The command that installs ``dist`` within ``specifier`` (mlaunch: from its checkout)."""
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
            results.append(fail(dist, f"{dist} is not installed", install_command(dist, spec)))
            continue
        if spec and not satisfies(version, spec):
            results.append(
                fail(
                    dist,
                    f"{dist} {version} is outside the supported range {spec}",
                    install_command(dist, spec),
                )
            )
        else:
            results.append(ok(dist, f"{version}" + (f" (supported: {spec})" if spec else "")))
    return results
