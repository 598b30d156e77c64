"""``mlaunch trace`` through the real CLI app: output shape, ``--json``, and clear exit-2 errors
(file and line named, a fix given, no traceback) for every kind of bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.synthetic_traces import TraceBuilder
from support.trace_cli import invoke_trace as _invoke
from support.trace_cli import user_error as _user_error
from typer.testing import CliRunner

from mlaunch.model.spans import SpanName


def test_summary_prints_tables_and_stragglers(run_dir: Path) -> None:
    r = _invoke("summary", run_dir)
    assert r.exit_code == 0, r.output
    for text in (SpanName.ITERATION, SpanName.CHECKPOINT_SAVE_IO_WRITE, "stragglers: 1",
                 "nemo.run.id=synthrun0001", "error spans: 1", "truncated spans: 1"):  # fmt: skip
        assert text in r.output


def test_summary_json_is_machine_readable(run_dir: Path) -> None:
    r = _invoke("summary", run_dir, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    step = next(s for s in d["spans"] if s["name"] == SpanName.ITERATION)
    assert step["p95_ms"] == pytest.approx(175.5)
    assert d["step_skew"]["stragglers"] == [1]


def test_goodput_json_and_table(run_dir: Path) -> None:
    r = _invoke("goodput", run_dir, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["ranks"][0]["goodput"] == pytest.approx(0.4)
    r = _invoke("goodput", run_dir)
    assert r.exit_code == 0 and "40.0%" in r.output


def test_goodput_help_documents_the_definitions() -> None:
    r = _invoke("goodput", "--help")
    assert r.exit_code == 0
    for word in (
        "wall",
        "productive",
        "restart",
        "unaccounted",
        "mlaunch.job",
        "megatron.pretrain",
    ):
        assert word in r.output


def test_export_writes_chrome_json(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    r = _invoke("export", run_dir, "--format", "chrome", "-o", out)
    assert r.exit_code == 0, r.output
    assert "21 spans, 2 ranks" in r.output
    assert json.loads(out.read_text())["traceEvents"]


def test_missing_path(tmp_path: Path) -> None:
    _user_error(_invoke("summary", tmp_path / "nope"), "nope", "no such file", "fix:")


def test_empty_directory(tmp_path: Path) -> None:
    _user_error(_invoke("goodput", tmp_path), str(tmp_path), "no trace files", "fix:")


def test_unrelated_json_file_names_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "package.json"
    f.write_text('{"name": "left-pad", "version": "1.3.0"}\n')
    _user_error(_invoke("summary", f), f"{f}: is a JSON document, not an OTLP/JSON traces file")


def test_a_second_line_without_resource_spans_names_its_line(run_dir: Path) -> None:
    f = run_dir / "telemetry" / "traces-rank0.jsonl"
    f.write_text(f.read_text() + '{"name": "left-pad"}\n')
    _user_error(_invoke("summary", f), f"{f}:", "not an OTLP/JSON ExportTraceServiceRequest")


def test_resolved_json_is_named_and_the_run_directory_pointed_at(run_dir: Path) -> None:
    # resolved.json is valid (pretty-printed) JSON: calling it "not valid JSON" was wrong
    f = run_dir / "resolved.json"
    f.write_text(json.dumps({"run_id": "synthrun0001", "world": {"nodes": 1}}, indent=2) + "\n")
    for cmd in ("summary", "goodput"):
        text = _user_error(_invoke(cmd, f), f"{f}: is the run's resolved configuration",
                           "not an OTLP/JSON traces file", f"fix: pass the run directory "
                           f"instead: {run_dir}")  # fmt: skip
        assert "not valid JSON" not in text


def test_binary_file(tmp_path: Path) -> None:
    f = tmp_path / "model.pt"
    f.write_bytes(b"\x80\x02\xff\xfe\x00garbage\n")
    _user_error(_invoke("summary", f), f"{f}:1:", "not valid JSON")


def test_wrong_json_in_the_middle_names_its_line(run_dir: Path) -> None:
    f = run_dir / "telemetry" / "traces-rank1.jsonl"
    lines = f.read_text().splitlines()
    f.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    _user_error(_invoke("export", run_dir, "-o", run_dir / "t.json"), f"{f}:2:", "not valid JSON",
                "--skip-invalid")  # fmt: skip
    assert not (run_dir / "t.json").exists()


def test_truncated_last_line_is_skipped_with_a_warning(run_dir: Path) -> None:
    f = run_dir / "telemetry" / "traces-rank0.jsonl"
    text = f.read_text()
    f.write_text(text + text.splitlines()[0][:57])  # a writer killed mid-line
    n = len(text.splitlines()) + 1
    for extra in ((), ("--skip-invalid",)):
        r = _invoke("summary", run_dir, "--json", *extra)
        assert r.exit_code == 0, r.output
        assert f"skipped 1 torn last line(s) (a crashed or still-running writer): {f}:{n}" in (
            r.output
        )


def test_malformed_span_names_its_line(tmp_path: Path) -> None:
    b = TraceBuilder()
    b.span(0, SpanName.ITERATION, 0, 1)
    line = json.loads(b.lines(0)[0])
    del line["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["endTimeUnixNano"]
    f = tmp_path / "t.jsonl"
    f.write_text(b.lines(0)[0] + "\n" + json.dumps(line) + "\n")
    for cmd in ("summary", "goodput"):
        _user_error(_invoke(cmd, f), f"{f}:2:", "malformed span", "endTimeUnixNano")


def test_metrics_file_is_not_a_trace(tmp_path: Path) -> None:
    f = tmp_path / "metrics-rank0.jsonl"
    f.write_text(json.dumps({"resourceMetrics": []}) + "\n")
    _user_error(_invoke("summary", f), "no spans", "metrics only", "traces-rank")


def test_empty_trace_file(tmp_path: Path) -> None:
    tel = tmp_path / "telemetry"
    tel.mkdir()
    (tel / "traces-rank0.jsonl").write_text("")
    _user_error(_invoke("summary", tmp_path), "no spans", "MEGATRON_OTEL_ENABLED")


def test_export_without_output_says_what_is_missing(run_dir: Path) -> None:
    text = _user_error(_invoke("export", run_dir), "--output/-o: a required option is missing",
                       "mlaunch trace export --help")  # fmt: skip
    assert not text.rstrip().endswith("--output/-o:")


def test_export_to_dash_writes_standard_output(run_dir: Path, tmp_path: Path) -> None:
    # a real pipe: '-' is standard output, never a file named '-'
    r = subprocess.run(
        [sys.executable, "-m", "mlaunch", "trace", "export", str(run_dir), "-o", "-"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    trace = json.loads(r.stdout)
    assert trace["otherData"]["generator"] == "mlaunch trace export"
    assert "wrote standard output (chrome): 21 spans, 2 ranks" in r.stderr
    assert not (tmp_path / "-").exists() and not (run_dir / "-").exists()


def test_export_to_dot_slash_dash_is_a_file(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "-"
    r = _invoke("export", run_dir, "-o", out)
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["otherData"]["generator"] == "mlaunch trace export"


def test_export_to_a_directory(run_dir: Path) -> None:
    _user_error(_invoke("export", run_dir, "-o", run_dir), "is a directory")


def test_export_format_is_validated(run_dir: Path) -> None:
    r = _invoke("export", run_dir, "--format", "svg", "-o", run_dir / "x")
    assert r.exit_code == 2 and "Traceback" not in r.output


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_COLS = ["name", "count", "total", "mean", "p50", "p95", "max", "share", "err", "trunc"]


def _span_names(run_dir: Path) -> list[str]:
    r = _invoke("summary", run_dir, "--json")
    assert r.exit_code == 0, r.output
    return [s["name"] for s in json.loads(r.output)["spans"]]


def _ends(line: str) -> list[int]:
    """Where each whitespace-separated word of ``line`` ends: right-aligned columns end alike."""
    return [m.end() for m in re.finditer(r"\S+", line)]


def test_summary_piped_is_plain_one_row_a_line(run_dir: Path, tmp_path: Path) -> None:
    # a real pipe at 80 columns: rich used to fold names across lines here
    r = subprocess.run(
        [sys.executable, "-m", "mlaunch", "trace", "summary", str(run_dir)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "COLUMNS": "80", "TERM": "xterm-256color"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "\x1b[" not in r.stdout  # plain: no colours or styles in a file
    lines = r.stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split() == _COLS)
    names = _span_names(run_dir)
    rows = lines[head + 1 : head + 1 + len(names)]
    assert [ln.split()[0] for ln in rows] == names  # each name whole, on its row, in order
    for ln in rows:
        assert len(ln.split()) == len(_COLS)
        assert _ends(ln)[1:] == _ends(lines[head])[1:]  # numbers keep their columns
    # grep finds a span's numbers on the line of its name
    assert any(ln.startswith("megatron.checkpoint.save.io_write ") and ln.split()[8] == "1"
               for ln in rows)  # fmt: skip


def test_summary_at_80_columns_keeps_names_whole_and_numbers_in_columns(run_dir: Path) -> None:
    # the error/truncated columns leave no room for names at 80: each name gets its own line
    # instead of a 2-character column
    from mlaunch.cli import app

    r = CliRunner().invoke(
        app, ["trace", "summary", str(run_dir)], env={"COLUMNS": "80", "FORCE_COLOR": "1"}
    )
    assert r.exit_code == 0, r.output
    lines = _ANSI.sub("", r.output).splitlines()
    assert max(map(len, lines)) <= 80
    names = _span_names(run_dir)
    head = lines.index("name")
    header = lines[head + 1]
    assert header.split() == _COLS[1:]
    body = lines[head + 2 : head + 2 + 2 * len(names)]
    assert body[0::2] == names  # every name whole, on its own line
    for ln in body[1::2]:
        assert len(ln.split()) == len(_COLS) - 1
        assert _ends(ln) == _ends(header)


def test_summary_on_a_wide_terminal_has_one_row_a_line(run_dir: Path) -> None:
    from mlaunch.cli import app

    r = CliRunner().invoke(
        app, ["trace", "summary", str(run_dir)], env={"COLUMNS": "160", "FORCE_COLOR": "1"}
    )
    assert r.exit_code == 0, r.output
    lines = _ANSI.sub("", r.output).splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split() == _COLS)
    names = _span_names(run_dir)
    assert [ln.split()[0] for ln in lines[head + 1 : head + 1 + len(names)]] == names


def test_report_to_dash_writes_standard_output(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    r = _invoke("report", run_dir, "-o", "-")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("<!DOCTYPE html>") and "wrote standard output" in r.stderr
    assert not (tmp_path / "-").exists() and not (run_dir / "report.html").exists()
