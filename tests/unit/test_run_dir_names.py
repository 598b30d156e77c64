"""The run directory's file names: each spelled once in ``envcontract``, and its readers' globs
and parsers derived from that spelling agree with what the writers write."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

from mlaunch import envcontract as ec


@pytest.mark.parametrize("name", [ec.ERROR_FILE, ec.NODE_LOG_DIR, ec.RANK_SENDER])
def test_a_numbered_name_parses_back_and_matches_its_glob(name: ec.NumberedName) -> None:
    for n in (0, 7, 123):
        written = name.name(n)
        assert name.parse(written) == n
        assert fnmatch.fnmatchcase(written, name.glob)
    assert name.parse(name.glob) is None
    assert name.parse(name.name(3) + ".bak") is None


def test_the_error_file_template_is_the_numbered_name() -> None:
    assert ec.ERROR_FILE_TEMPLATE.format(rank=5) == ec.ERROR_FILE.name(5) == "error-rank5.json"


def test_every_telemetry_file_the_writers_write_parses_back(tmp_path: Path) -> None:
    written = {
        ec.traces_file(tmp_path, 3): ec.TelemetryFile("traces", rank=3),
        ec.metrics_file(tmp_path, 2): ec.TelemetryFile("metrics", rank=2),
        ec.launcher_traces_file(tmp_path, 1): ec.TelemetryFile("traces", launcher_node=1),
        ec.spool_file(tmp_path, 0, "metrics"): ec.TelemetryFile("metrics", True, rank=0),
        ec.spool_file(tmp_path, None, "logs"): ec.TelemetryFile("logs", True),
        ec.received_file(tmp_path, "logs", 4): ec.TelemetryFile("logs", rank=4),
        ec.spooled(ec.launcher_traces_file(tmp_path, 0)): ec.TelemetryFile(
            "traces", True, launcher_node=0
        ),
    }
    for path, what in written.items():
        assert path.parent == tmp_path / ec.TELEMETRY_DIR
        assert ec.parse_telemetry_file(path.name) == what, path.name
    assert fnmatch.fnmatchcase(ec.traces_file(tmp_path, 9).name, ec.TRACES_FILE_GLOB)


@pytest.mark.parametrize(
    "name",
    ["tee-traces-rank0.jsonl", "traces-rank.jsonl", "traces-rank3.json", "events-rank0.jsonl",
     "spool-traces.jsonl", "receiver-node0.json", "span-counts-rank0.json"],
)  # fmt: skip
def test_other_names_are_no_telemetry_file(name: str) -> None:
    assert ec.parse_telemetry_file(name) is None
