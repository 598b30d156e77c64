"""mlaunch's recorded-span C extension built for another CPython, for tests that run it there.

``mlaunch/telemetry/_cspan.c`` reads CPython's dict internals (a module dict's version, see its
header), which change between minor versions, so its equivalence tests run on every CPython the
project supports (:data:`PYTHONS`), not only the one mlaunch is installed for.

:func:`cspan_python` returns an interpreter of that version with the few packages the recorder's
imports need (a virtual environment, made once and cached as :mod:`support.nemo_lens` caches its
own, in ``$MLAUNCH_TEST_CACHE``; the running interpreter itself when it is that version) and a
``PYTHONPATH`` folder holding a fresh copy of this tree's ``mlaunch`` package with ``_cspan``
compiled for it from the current source (the build cached by the source's hash).
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

from support.nemo_lens import REPO, _cache_dir, _version, find_interpreter

#: The CPython versions the C extension is tested on (pyproject's classifiers; pyenv has each).
PYTHONS = ((3, 11), (3, 12), (3, 13))
#: What ``mlaunch.telemetry`` imports beyond the standard library (the recorder's tests' needs).
_PACKAGES = ("pydantic>=2.7,<3", "orjson>=3.8,<4")
SOURCE = REPO / "mlaunch" / "telemetry" / "_cspan.c"


class PythonUnavailable(RuntimeError):
    """No interpreter of that version, or no C compiler, on this machine (the tests skip, as
    the extension's own tests do where ``pip install`` could not build it)."""


def _python(version: tuple[int, int], cache: Path) -> str:
    """An interpreter of ``version`` that can import ``mlaunch.telemetry``."""
    if sys.version_info[:2] == version:
        return sys.executable
    base = find_interpreter(version, version)
    if base is None:
        raise PythonUnavailable(f"no Python {version[0]}.{version[1]} on PATH or under pyenv")
    venv = cache / f"cspan-py{version[0]}.{version[1]}"
    python = venv / "bin" / "python"
    marker = venv / ".complete"
    if not marker.exists() or _version(str(python)) != version:
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=300)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *_PACKAGES], check=True,
                       timeout=900)  # fmt: skip
        marker.write_text("\n".join(_PACKAGES) + "\n")
    return str(python)


def _compile(python: str, out_dir: Path) -> Path:
    """``_cspan`` compiled for ``python`` (its headers and suffix, ``-O2`` as setup.py has it)
    into ``out_dir``; the extension's path."""
    include, suffix = subprocess.run(
        [python, "-c", "import sysconfig as s; print(s.get_paths()['include']); "
         "print(s.get_config_var('EXT_SUFFIX'))"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.split()  # fmt: skip
    out = out_dir / f"_cspan{suffix}"
    out_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["cc", "-O2", "-fPIC", "-shared", "-Wall", "-Werror", f"-I{include}", str(SOURCE),
         "-o", str(out)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return out


def cspan_python(version: tuple[int, int], dest: Path) -> tuple[str, Path]:
    """``(python, pythonpath)``: an interpreter of ``version`` and ``dest`` holding a copy of
    this tree's ``mlaunch`` with ``_cspan`` built for it."""
    if shutil.which("cc") is None:
        raise PythonUnavailable("no C compiler (cc) to build the extension with")
    cache = _cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "cspan.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        python = _python(version, cache)
        digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
        built = cache / "cspan-builds" / f"{version[0]}.{version[1]}-{digest}"
        if not any(built.glob("_cspan*.so")):
            shutil.rmtree(built, ignore_errors=True)
            _compile(python, built)
    shutil.copytree(REPO / "mlaunch", dest / "mlaunch",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))  # fmt: skip
    for so in built.glob("_cspan*.so"):
        shutil.copy2(so, dest / "mlaunch" / "telemetry" / so.name)
    return python, dest
