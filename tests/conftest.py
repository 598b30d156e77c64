"""Shared pytest setup: makes ``tests/support`` importable as ``support`` from every test folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))

# Each test's CPU, its reaped children's included (--cpu-top): the suite is CPU-bound.
pytest_plugins = ["support.cpu_accounting"]

# One intra-op thread in every process a test starts, as clean_env gives the processes it starts
# (torchrun sets it only with several workers per node): a job's workers and two "nodes" share
# the test machine's few cores, where each worker's OpenMP pool would spin-wait for the others'
# (a single-worker SLURM "node" spent 300 ms of CPU on an iteration that takes 20 with one).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The span stores `mlaunch trace` keeps in the cache directory (an input it cannot store beside,
# a --skip-invalid read) go to a directory of the suite's, never the user's ~/.cache; each xdist
# worker and every process a test starts inherits it.
if "MLAUNCH_TEST_CACHE" not in os.environ:
    import tempfile

    os.environ["MLAUNCH_TEST_CACHE"] = os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(
        prefix="mlaunch-test-cache-"
    )

# Bytecode is cached for the suite even where the machine's environment says not to
# (PYTHONDONTWRITEBYTECODE=1, as on the CI image): each of the hundreds of processes the suite
# starts (a launcher, torchrun's workers, a CLI call) would compile mlaunch's modules from source
# again, about 0.4 CPU-s a run, and each xdist worker rewrite every test module's asserts afresh.
# The caches go to __pycache__ beside the sources (git ignores them); the xdist workers, started
# after this file is read, inherit the environment without the variable.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False


#: Module- or session-scoped fixtures that start a real run (a torchrun job, a nemo-lens worker):
#: a pytest-xdist worker builds such a fixture for itself, so the tests sharing one are sent to
#: one worker (one xdist group per fixture) and the run is made once, not once per worker.
SHARED_RUN_FIXTURES = (
    "traced", "off_run", "baseline", "real_run", "run_dir", "lens_trace", "two_runs",
)  # fmt: skip


def _shared_run_group(item) -> str | None:
    """The xdist group of a test that uses a shared-run fixture (the first one it uses)."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for name in SHARED_RUN_FIXTURES:
        fixture = defs.get(name)
        if fixture and fixture[-1].scope in ("module", "session"):
            # One group per nemo-lens version: each version's shared run is its own fixture.
            version = getattr(item, "callspec", None) and item.callspec.params.get("lens_version")
            suffix = f"[lens{version}]" if version else ""
            return f"{fixture[-1].baseid or '.'}::{name}{suffix}"
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist names the groups in the node ids
def pytest_collection_modifyitems(config, items) -> None:
    """Tests sharing a real run go to one xdist worker; ``gpu`` tests need a CUDA device:
    skipped, with the reason, where there is none."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        group = _shared_run_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    _slow_modules_first(items)

    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch  # only when a gpu test was collected; the fast suites never pay for it

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in gpu_items:
        item.add_marker(skip)


def _slow_modules_first(items) -> None:
    """Modules with a ``slow`` test run first, each module's tests kept together and in order
    (module fixtures are made once). Longest first: the real runs, and the tests that mostly
    wait on one (SLURM's timers, a watchdog, a restart), start while the fast tests are still
    queued to fill the cores around them, instead of a long test starting last and running on
    alone. xdist hands out its groups (largest first), then the single tests in this order."""
    slow = {item.module for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module not in slow)  # stable


def _lens_python_or_skip(version: str):
    from support.nemo_lens import LensUnavailable, SharedMissing, lens_python

    try:
        return lens_python(version)
    except LensUnavailable as exc:
        pytest.skip(str(exc))
    except SharedMissing as exc:  # CI always has shared/: its absence is a broken checkout
        pytest.fail(str(exc), pytrace=False)


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "nemo_lens(*versions): runs a worker under the real nemo-lens (a cached venv per version);"
        " a test using lens_version/lens_python/lens_worker_script runs once per version (ids"
        " lens0.1.0, lens0.2.0), or only under the versions named",
    )


def pytest_generate_tests(metafunc) -> None:
    """Every test that takes ``lens_version`` (directly or through ``lens_python`` /
    ``lens_worker_script``) runs under each nemo-lens a Megatron-LM user can have: 0.1.0 (PyPI,
    Python 3.13) and 0.2.0 (what Megatron-LM pins, Python 3.12); ``@pytest.mark.nemo_lens("0.1.0")``
    narrows it. Session scope: one venv and one shim per version for the whole run."""
    if "lens_version" not in metafunc.fixturenames:
        return
    from support.nemo_lens import VERSIONS

    marker = metafunc.definition.get_closest_marker("nemo_lens")
    versions = list(marker.args) if marker is not None and marker.args else list(VERSIONS)
    unknown = [v for v in versions if v not in VERSIONS]
    if unknown:
        raise pytest.UsageError(f"nemo_lens marker names unknown versions {unknown}")
    metafunc.parametrize(
        "lens_version",
        versions,
        ids=[VERSIONS[v].test_id for v in versions],
        indirect=True,
        scope="session",
    )


@pytest.fixture(scope="session")
def lens_version(request) -> str:
    """The nemo-lens version this test runs under (parametrized by pytest_generate_tests)."""
    return request.param


@pytest.fixture(scope="session")
def lens_python(lens_version):
    """The python of a venv with the real nemo-lens ``lens_version`` and its SDK (built once,
    cached)."""
    return _lens_python_or_skip(lens_version)


@pytest.fixture(scope="session")
def lens_worker_script(lens_python, lens_version, tmp_path_factory):
    """A ``--script`` for ``mlaunch train`` that runs a Megatron-LM-like nemo-lens worker."""
    from support.nemo_lens import write_worker_shim

    return write_worker_shim(tmp_path_factory.mktemp(f"lens-shim-{lens_version}"), lens_python)
