"""The running Python and the installed distributions against the ranges mlaunch declares."""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

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
    for text in reqs:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.marker is not None:  # extras (tests) and environment markers are not runtime needs
            continue
        ranges[canonicalize_name(req.name)] = str(req.specifier)
    return python, ranges


def satisfies(version: str, specifier: str) -> bool:
    """Whether ``version`` meets ``specifier`` (``>=1.25,<2``), by PEP 440.

    Pre-releases count as their release (a torch nightly is judged by its version number), a
    version that is not PEP 440 meets nothing, and a specifier that cannot be parsed rules
    nothing out.
    """
    try:
        spec = SpecifierSet(specifier)
    except InvalidSpecifier:
        return True
    try:
        return spec.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


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
        spec = ranges.get(canonicalize_name(dist), "")
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
