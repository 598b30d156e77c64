"""The streaming OTLP/JSON reader: discovery, deduplication against the spool, mixed lines,
and the value encodings the OTLP/JSON spec allows."""

from __future__ import annotations

import json
from pathlib import Path

from support.synthetic_traces import TraceBuilder, encode_attributes, ms, request_line

from mlaunch.model.spans import SpanName
from mlaunch.otlp.otlp_json import attributes
from mlaunch.trace.reader import TraceReader, discover
from mlaunch.trace.store import open_reader


def _all_spans(path: Path) -> list[tuple[int, str]]:
    return [(res.rank, s["spanId"]) for res, spans, _ in TraceReader.open(path) for s in spans]


def _three_spans() -> TraceBuilder:
    b = TraceBuilder()
    for i in range(3):
        b.span(0, SpanName.ITERATION, 10 * i, 10 * i + 5)
    return b


def test_spool_duplicates_are_dropped_once(tmp_path: Path) -> None:
    b = _three_spans()
    lines = b.lines(0, batch=1)
    tel = tmp_path / "telemetry"
    tel.mkdir()
    (tel / "traces-rank0.jsonl").write_text(lines[0] + "\n" + lines[1] + "\n")
    (tel / "spool-traces-rank0.jsonl").write_text(lines[1] + "\n" + lines[2] + "\n")
    reader = TraceReader.open(tmp_path)
    ids = sorted(s["spanId"] for _, spans, _ in reader for s in spans)
    assert ids == sorted(s["spanId"] for s in b.spans[0])
    assert reader.stats.duplicate_spans == 1
    assert reader.stats.spans == 3


def test_spool_of_one_rank_does_not_hide_spans_of_another(tmp_path: Path) -> None:
    b = _three_spans()
    line = b.lines(0, batch=3)[0]
    tel = tmp_path / "telemetry"
    tel.mkdir()
    (tel / "spool-traces-rank0.jsonl").write_text(line + "\n")
    (tel / "traces-rank1.jsonl").write_text(line + "\n")  # same ids, another rank's file
    assert len(_all_spans(tmp_path)) == 6


def test_metric_lines_and_blank_lines_are_skipped(tmp_path: Path) -> None:
    b = _three_spans()
    f = tmp_path / "collector.jsonl"
    metrics = json.dumps({"resourceMetrics": [{"resource": {}, "scopeMetrics": []}]})
    f.write_text(metrics + "\n\n" + "\n".join(b.lines(0)) + "\n")
    reader = TraceReader.open(f)
    assert sum(len(spans) for _, spans, _ in reader) == 3
    assert reader.stats.metric_lines == 1


def test_one_line_may_hold_several_resources(tmp_path: Path) -> None:
    # A collector batches spans of many ranks into one request: the rank comes from each
    # resource, not from the file name.
    b = TraceBuilder()
    b.span(0, SpanName.ITERATION, 0, 1)
    b.span(3, SpanName.ITERATION, 0, 1)
    reqs = [json.loads(b.lines(r)[0]) for r in (0, 3)]
    merged = {"resourceSpans": reqs[0]["resourceSpans"] + reqs[1]["resourceSpans"]}
    f = tmp_path / "otel-traces.json"
    f.write_text(json.dumps(merged) + "\n")
    assert sorted(r for r, _ in _all_spans(f)) == [0, 3]


def test_rank_falls_back_to_file_name_without_dl_rank(tmp_path: Path) -> None:
    span = {"traceId": "a" * 32, "spanId": "b" * 16, "name": "x",
            "startTimeUnixNano": ms(0), "endTimeUnixNano": ms(1)}  # fmt: skip
    tel = tmp_path / "telemetry"
    tel.mkdir()
    (tel / "traces-rank5.jsonl").write_text(request_line({"service.name": "s"}, [span]) + "\n")
    assert _all_spans(tmp_path) == [(5, "b" * 16)]


def test_numbers_are_accepted_where_strings_are_usual(tmp_path: Path) -> None:
    # int64 fields may be JSON numbers; the summary must read them the same.
    from mlaunch.trace.summary import summarize_store

    span = {"traceId": "a" * 32, "spanId": "b" * 16, "name": SpanName.ITERATION,
            "startTimeUnixNano": ms(0), "endTimeUnixNano": ms(2), "status": {"code": 2}}  # fmt: skip
    f = tmp_path / "t.jsonl"
    f.write_text(request_line({"dl.rank": 0}, [span]) + "\n")
    s = summarize_store(open_reader(f).store)
    assert s.spans[0].total_ms == 2 and s.errors == 1


def test_telemetry_dir_and_single_file_are_accepted(tmp_path: Path) -> None:
    _three_spans().write_run_dir(tmp_path)
    assert len(_all_spans(tmp_path / "telemetry")) == 3
    assert len(_all_spans(tmp_path / "telemetry" / "traces-rank0.jsonl")) == 3
    assert [f.rank for f in discover(tmp_path)] == [0]


def test_attribute_values_decode_every_otlp_kind() -> None:
    kvs = encode_attributes({"s": "x", "i": 7, "d": 0.5, "b": True, "a": [1, "y"],
                             "kv": {"k": 2}, "raw": b"\x00\x01"})  # fmt: skip
    kvs.append({"key": "n", "value": {"intValue": 9}})  # a number, not a string
    assert attributes(kvs) == {"s": "x", "i": 7, "d": 0.5, "b": True, "a": [1, "y"],
                               "kv": {"k": 2}, "raw": b"\x00\x01", "n": 9}  # fmt: skip


def test_processes_without_rank_attributes_get_one_rank_each(tmp_path: Path) -> None:
    # A foreign trainer's spans in a collector file: no dl.rank, no rank in the file name.
    def span(i: int) -> dict:
        return {"traceId": "a" * 32, "spanId": f"{i:016x}", "name": "x",
                "startTimeUnixNano": ms(0), "endTimeUnixNano": ms(1)}  # fmt: skip

    lines = [
        request_line({"service.instance.id": "job-a"}, [span(1)]),
        request_line({"service.instance.id": "job-b"}, [span(2)]),
        request_line({"service.instance.id": "job-a"}, [span(3)]),
        request_line({"host.name": "n1", "process.pid": 7}, [span(4)]),
    ]
    f = tmp_path / "otel-traces.json"
    f.write_text("\n".join(lines) + "\n")
    assert _all_spans(f) == [(0, f"{1:016x}"), (1, f"{2:016x}"), (0, f"{3:016x}"), (2, f"{4:016x}")]


def test_non_finite_floats_written_by_python_json_are_read(tmp_path: Path) -> None:
    # json.dumps writes a NaN loss as a bare NaN literal (not strict JSON): still readable.
    span = {"traceId": "a" * 32, "spanId": "b" * 16, "name": SpanName.ITERATION,
            "startTimeUnixNano": ms(0), "endTimeUnixNano": ms(1),
            "attributes": [{"key": "megatron.loss", "value": {"doubleValue": float("nan")}}]}  # fmt: skip
    f = tmp_path / "t.jsonl"
    f.write_text(request_line({"dl.rank": 0}, [span]) + "\n")
    assert "NaN" in f.read_text()
    assert _all_spans(f) == [(0, "b" * 16)]
