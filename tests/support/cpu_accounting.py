"""Per-test CPU accounting: user+sys seconds of the test process and of the children it reaped.

The suite is CPU-bound on a small CI machine (most tests start real torchrun jobs, each process
importing torch), so wall-clock ``--durations`` mostly shows who sleeps; this shows who burns
the cores. Each test's cost is the ``getrusage`` delta around its setup, call and teardown
(``RUSAGE_SELF`` + ``RUSAGE_CHILDREN``: a launcher, its torchrun and the workers count once
they are waited for; daemons a fixture leaves running, a SLURM cluster's, do not). A module-
or session-scoped fixture's run is charged to the first test that builds it.

``--cpu-top=N`` prints the N costliest tests at the end (0: none); ``MLAUNCH_TEST_CPU_JSON=path``
also writes every test's numbers there: ``{nodeid: {"cpu_s", "start", "stop", "worker"}}``, the
wall-clock times (Unix seconds) from setup to teardown and the xdist worker that ran it, so
the cores' idle stretches (a worker waiting alone) can be found. Under pytest-xdist the numbers
travel to the controller in the teardown report's ``user_properties``.
"""

from __future__ import annotations

import json
import os
import resource
import time

import pytest

_KEY = "cpu_accounting"  # the user property: the test's row of the JSON file
#: Where every test's CPU seconds are also written as JSON (unset: nowhere).
CPU_JSON_ENV = "MLAUNCH_TEST_CPU_JSON"


def _cpu_now() -> float:
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--cpu-top", type=int, default=30, metavar="N",
        help="show the N tests that used the most CPU, their reaped children included (0: none)",
    )  # fmt: skip


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item._cpu_start = _cpu_now()
    item._wall_start = time.time()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield
    # Before the teardown report is made, which copies user_properties (and xdist ships it).
    start = getattr(item, "_cpu_start", None)
    if start is not None:
        row = {
            "cpu_s": round(_cpu_now() - start, 3),
            "start": round(item._wall_start, 3),
            "stop": round(time.time(), 3),
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        }
        item.user_properties.append((_KEY, row))


class _Collector:
    def __init__(self) -> None:
        self.rows: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report) -> None:
        if report.when != "teardown":
            return
        for key, value in report.user_properties:
            if key == _KEY:
                self.rows[report.nodeid] = value

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.rows:
            return
        path = os.environ.get(CPU_JSON_ENV)
        if path:
            with open(path, "w") as out:
                json.dump(self.rows, out, indent=1, sort_keys=True)
        top = terminalreporter.config.getoption("cpu_top")
        if top <= 0:
            return
        cpu = {nodeid: row["cpu_s"] for nodeid, row in self.rows.items()}
        total = sum(cpu.values())
        terminalreporter.write_sep("=", f"CPU per test (top {top}; {total:.0f} CPU-s in all)")
        ranked = sorted(cpu.items(), key=lambda kv: kv[1], reverse=True)
        for nodeid, seconds in ranked[:top]:
            terminalreporter.write_line(f"{seconds:8.2f}s cpu  {nodeid}")


def pytest_configure(config) -> None:
    # Only the process that reports (the xdist controller, or the only one) collects.
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Collector(), "cpu_accounting_collector")
