"""The real nemo-lens, for tests that must behave as a Megatron-LM worker does.

A Megatron-LM user has one of two nemo-lens versions, and the tests run each:

- **0.1.0**, the ``nemo-lens`` package on PyPI; it needs Python >= 3.13;
- **0.2.0**, what Megatron-LM's ``pyproject.toml`` pins (NVIDIA-NeMo/Lens git tag v0.2.0, not on
  PyPI; Python >= 3.12). Its source is in the project's ``shared/`` folder beside the repository
  (``<repo>/../shared/nemo-lens-0.2.0``; CI clones the repository next to it).

mlaunch runs on 3.11. :func:`lens_python` makes (once per version, cached across runs) a virtual
environment with an interpreter found on this machine and that version installed, and returns its
``python``. :func:`write_worker_shim` writes a script that ``mlaunch train --script`` can start:
torchrun runs scripts with the launcher's own interpreter, so the shim ``os.execv``s the nemo-lens
interpreter on ``lens_worker.py`` with the same arguments.

The cache lives in ``$MLAUNCH_TEST_CACHE`` (default ``~/.cache/mlaunch-tests``); a lock file keeps
parallel test processes from building it twice.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

#: The repository this file is in (tests/support/ is two levels below its root).
REPO = Path(__file__).resolve().parents[2]
#: The Megatron-like worker this module's shim starts.
WORKER = Path(__file__).resolve().parent / "lens_worker.py"


@dataclass(frozen=True)
class LensVersion:
    """One nemo-lens a Megatron-LM user can have, and how the tests install it."""

    version: str
    #: The interpreters it is installed for: (lowest, highest) major.minor, both inclusive.
    pythons: tuple[tuple[int, int], tuple[int, int]]
    #: ``pip install`` argument, or None for the source copy in ``shared/`` (see _requirement).
    requirement: str | None
    #: The folder under ``shared/`` holding its source, when not from the package index.
    shared_source: str | None = None

    @property
    def test_id(self) -> str:
        return f"lens{self.version}"


#: 0.1.0 from PyPI on 3.13 (its own Requires-Python asks for 3.13, not 3.12); 0.2.0 from the
#: shared source on 3.12, the oldest it allows and what a Megatron-LM container often has.
VERSIONS: dict[str, LensVersion] = {
    "0.1.0": LensVersion("0.1.0", ((3, 13), (3, 14)), "nemo-lens[sdk]==0.1.0"),
    "0.2.0": LensVersion("0.2.0", ((3, 12), (3, 12)), None, "nemo-lens-0.2.0"),
}
#: Kept for callers that name the PyPI version's requirement.
LENS_REQUIREMENT = VERSIONS["0.1.0"].requirement


class LensUnavailable(RuntimeError):
    """No interpreter the version supports exists on this machine (the tests skip)."""


class SharedMissing(RuntimeError):
    """The project's ``shared/`` folder, or the source in it, is not where it must be (the tests
    fail: CI always has it)."""


def _cache_dir() -> Path:
    root = os.environ.get("MLAUNCH_TEST_CACHE") or Path.home() / ".cache" / "mlaunch-tests"
    return Path(root)


def shared_dir() -> Path:
    """``<repo>/../shared``. In a git worktree of the repository (a second checkout beside the
    main one) it is the main checkout's neighbour, found through the common git directory."""
    candidates = [REPO.parent / "shared"]
    try:
        common = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--path-format=absolute", "--git-common-dir"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        common = ""
    if common:
        candidates.append(Path(common).parent.parent / "shared")
    for path in candidates:
        if path.is_dir():
            return path
    raise SharedMissing(
        f"the project's shared/ folder is not beside the repository (looked for"
        f" {', '.join(map(str, dict.fromkeys(candidates)))}); nemo-lens 0.2.0's source lives there:"
        " clone the repository next to it"
    )


def _version(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print(*sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    major, minor = out.stdout.split()
    return int(major), int(minor)


def find_interpreter(
    lowest: tuple[int, int] = (3, 13), highest: tuple[int, int] = (3, 14)
) -> str | None:
    """A Python between ``lowest`` and ``highest`` on this machine: on PATH, or under pyenv."""
    candidates: list[str] = []
    for minor in range(lowest[1], highest[1] + 1):
        if found := shutil.which(f"python{lowest[0]}.{minor}"):
            candidates.append(found)
    pyenv_root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    versions = Path(pyenv_root) / "versions"
    if versions.is_dir():
        for d in sorted(versions.iterdir(), reverse=True):
            py = d / "bin" / "python"
            if py.exists() and d.name[:1].isdigit():
                candidates.append(str(py))
    for python in candidates:
        # pyenv shims may point at a version that is not installed: ask the interpreter itself.
        if (v := _version(python)) is not None and lowest <= v <= highest:
            return python
    return None


def _requirement(spec: LensVersion, cache: Path) -> str:
    """What pip installs: the index requirement, or ``COPY[sdk]`` of the shared source. pip
    writes ``build/`` into a source tree, and ``shared/`` is read-only to the tests."""
    if spec.requirement is not None:
        return spec.requirement
    assert spec.shared_source is not None  # one of the two is always set (VERSIONS)
    source = shared_dir() / spec.shared_source
    if not (source / "pyproject.toml").is_file():
        raise SharedMissing(f"{source} holds no nemo-lens source (no pyproject.toml)")
    copy = cache / f"{spec.shared_source}-src"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    return f"{copy}[sdk]"


def lens_python(version: str = "0.1.0") -> Path:
    """The ``python`` of a venv with nemo-lens ``version`` and its SDK (built on first use, then
    cached)."""
    spec = VERSIONS[version]
    lowest, highest = spec.pythons
    base = find_interpreter(lowest, highest)
    if base is None:
        raise LensUnavailable(
            f"nemo-lens {version} is tested on Python {'.'.join(map(str, lowest))}"
            f"-{'.'.join(map(str, highest))}; none found on PATH or under pyenv"
        )
    cache = _cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    venv = cache / f"nemo-lens-{version}"
    python = venv / "bin" / "python"
    marker = venv / ".complete"
    with open(cache / "nemo-lens.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not marker.exists():
            shutil.rmtree(venv, ignore_errors=True)
            requirement = _requirement(spec, cache)
            subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=300)
            subprocess.run(
                [str(python), "-m", "pip", "install", "-q", requirement],
                check=True,
                timeout=900,
            )
            check = "import nemo.lens, opentelemetry.sdk; print(nemo.lens.__version__)"
            found = subprocess.run(
                [str(python), "-c", check], check=True, timeout=120, capture_output=True, text=True
            ).stdout.strip()
            if found != version:
                raise RuntimeError(f"{requirement} installed nemo-lens {found}, not {version}")
            marker.write_text(requirement + "\n")
    return python


def write_worker_shim(
    directory: Path, python: Path | None = None, name: str = "pretrain_gpt.py"
) -> Path:
    """A script that runs :data:`WORKER` under the nemo-lens interpreter, for ``--script``.

    The shim is itself started by the launcher's Python (torchrun does that); it replaces itself
    with the nemo-lens interpreter, so the worker's pid, environment and signals are the shim's.
    """
    python = python or lens_python()
    directory.mkdir(parents=True, exist_ok=True)
    shim = directory / name
    shim.write_text(
        "import os, sys\n"
        f"os.execv({str(python)!r}, [{str(python)!r}, {str(WORKER)!r}, *sys.argv[1:]])\n"
    )
    return shim


def run_worker_directly(
    args: list[str],
    env: dict[str, str],
    cwd: Path,
    timeout: float = 120,
    python: Path | None = None,
):
    """Run the worker as one rank without torchrun (RANK/WORLD_SIZE from ``env``), under
    ``python`` (a :func:`lens_python`; 0.1.0's by default)."""
    full = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", **env}
    return subprocess.run(
        [str(python or lens_python()), str(WORKER), *args],
        env=full,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


if __name__ == "__main__":  # `python tests/support/nemo_lens.py [VERSION...]` builds the cache
    for name in sys.argv[1:] or VERSIONS:
        print(lens_python(name), file=sys.stdout)
