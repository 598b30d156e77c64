"""The run directory's file names: each spelled once in ``envcontract``, and its readers' globs
and parsers derived from that spelling agree with what the writers write."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

from mlaunch.rundir import layout as lay


@pytest.mark.parametrize("name", [lay.ERROR_FILE, lay.NODE_LOG_DIR, lay.RANK_SENDER])
def test_a_numbered_name_parses_back_and_matches_its_glob(name: lay.NumberedName) -> None:
    for n in (0, 7, 123):
        written = name.name(n)
        assert name.parse(written) == n
        assert fnmatch.fnmatchcase(written, name.glob)
    assert name.parse(name.glob) is None
    assert name.parse(name.name(3) + ".bak") is None


def test_the_error_file_template_is_the_numbered_name() -> None:
    assert lay.ERROR_FILE_TEMPLATE.format(rank=5) == lay.ERROR_FILE.name(5) == "error-rank5.json"


def test_every_telemetry_file_the_writers_write_parses_back(tmp_path: Path) -> None:
    written = {
        lay.traces_file(tmp_path, 3): lay.TelemetryFile("traces", rank=3),
        lay.metrics_file(tmp_path, 2): lay.TelemetryFile("metrics", rank=2),
        lay.launcher_traces_file(tmp_path, 1): lay.TelemetryFile("traces", launcher_node=1),
        lay.spool_file(tmp_path, 0, "metrics"): lay.TelemetryFile("metrics", True, rank=0),
        lay.spool_file(tmp_path, None, "logs"): lay.TelemetryFile("logs", True),
        lay.received_file(tmp_path, "logs", 4): lay.TelemetryFile("logs", rank=4),
        lay.spooled(lay.launcher_traces_file(tmp_path, 0)): lay.TelemetryFile(
            "traces", True, launcher_node=0
        ),
    }
    for path, what in written.items():
        assert path.parent == tmp_path / lay.TELEMETRY_DIR
        assert lay.parse_telemetry_file(path.name) == what, path.name
    assert fnmatch.fnmatchcase(lay.traces_file(tmp_path, 9).name, lay.TRACES_FILE_GLOB)


@pytest.mark.parametrize(
    "name",
    ["tee-traces-rank0.jsonl", "traces-rank.jsonl", "traces-rank3.json", "events-rank0.jsonl",
     "spool-traces.jsonl", "receiver-node0.json", "span-counts-rank0.json"],
)  # fmt: skip
def test_other_names_are_no_telemetry_file(name: str) -> None:
    assert lay.parse_telemetry_file(name) is None
