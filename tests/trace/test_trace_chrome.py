"""``mlaunch trace export --format chrome``: the output is checked against the Chrome
trace-event format (required fields, proper nesting per thread, every span exactly once,
flows bound to slices)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support.synthetic_traces import (
    TraceBuilder,
    check_chrome_trace,
    hand_example,
    write_realistic_run,
)

from mlaunch.model.spans import SpanName
from mlaunch.trace.chrome import export_chrome
from mlaunch.trace.store import open_reader

S = SpanName


def _export(tmp_path: Path, b: TraceBuilder) -> dict[str, Any]:
    b.write_run_dir(tmp_path / "run")
    out = tmp_path / "trace.json"
    export_chrome(open_reader(tmp_path / "run"), out)
    return json.loads(out.read_text())


def _meta(doc: dict[str, Any], name: str) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"].get("name") for e in doc["traceEvents"]
            if e["ph"] == "M" and e["name"] == name}  # fmt: skip


def test_every_span_appears_once_with_its_attributes(tmp_path: Path) -> None:
    b, _ = hand_example()
    doc = _export(tmp_path, b)
    xs = check_chrome_trace(doc)
    expected = Counter(s["name"] for spans in b.spans.values() for s in spans)
    assert Counter(e["name"] for e in xs) == expected
    assert len({e["args"]["span_id"] for e in xs}) == len(xs)
    step2 = next(
        e for e in xs if e["name"] == S.ITERATION and e["args"].get("megatron.iteration") == 2
    )
    assert (step2["ts"], step2["dur"]) == (400_000, 100_000)  # µs from the earliest span
    assert step2["cat"] == "step"
    io_write = next(e for e in xs if e["name"] == S.CHECKPOINT_SAVE_IO_WRITE)
    assert io_write["args"]["status"] == "ERROR"
    assert io_write["args"]["status_message"] == "disk full"


def test_one_process_per_rank_named_by_rank_and_host(tmp_path: Path) -> None:
    doc = _export(tmp_path, hand_example()[0])
    assert _meta(doc, "process_name") == {(0, 0): "rank 0 (node0)", (1, 0): "rank 1 (node0)"}
    assert {e["pid"] for e in doc["traceEvents"] if e["ph"] == "X"} == {0, 1}
    assert int(doc["otherData"]["t0_unix_nano"]) > 0


def test_span_events_become_instant_events(tmp_path: Path) -> None:
    doc = _export(tmp_path, hand_example()[0])
    (inst,) = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    assert inst["name"] == "exception" and inst["ts"] == 820_000
    assert inst["args"] == {"exception.type": "ValueError"}
    host = next(e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"] == S.EVALUATE_STEP)
    assert (inst["pid"], inst["tid"]) == (host["pid"], host["tid"])


def test_overlapping_spans_that_do_not_nest_go_to_separate_lanes(tmp_path: Path) -> None:
    b = TraceBuilder()
    step = b.span(0, S.ITERATION, 0, 100)
    fb = b.span(0, S.FORWARD_BACKWARD, 5, 90, parent=step)
    b.span(0, S.P2P_SEND_FORWARD, 10, 50, parent=fb)  # async: send and recv overlap
    b.span(0, S.P2P_RECV_FORWARD, 30, 70, parent=fb)
    b.span(0, S.P2P_RECV_BACKWARD, 40, 60, parent=fb)  # nests inside recv_forward
    b.span(0, S.OPTIMIZER, 90, 100, parent=step)
    doc = _export(tmp_path, b)
    xs = check_chrome_trace(doc)
    tid = {e["name"]: e["tid"] for e in xs}
    assert (
        tid[S.ITERATION] == tid[S.FORWARD_BACKWARD] == tid[S.P2P_SEND_FORWARD] == tid[S.OPTIMIZER]
    )
    assert tid[S.P2P_RECV_FORWARD] != tid[S.P2P_SEND_FORWARD]
    assert tid[S.P2P_RECV_BACKWARD] == tid[S.P2P_RECV_FORWARD]
    assert _meta(doc, "thread_name") == {(0, 0): "main", (0, 1): "main lane 1"}


def test_thread_id_attribute_gives_one_thread_each(tmp_path: Path) -> None:
    b = TraceBuilder()
    b.span(0, S.ITERATION, 0, 100, thread=11)
    b.span(0, S.DATALOADER, 50, 150, thread=12)  # overlaps, but on another OS thread
    doc = _export(tmp_path, b)
    xs = check_chrome_trace(doc)
    assert len({e["tid"] for e in xs}) == 2
    assert sorted(_meta(doc, "thread_name").values()) == ["thread 11", "thread 12"]


def test_links_become_flow_events_bound_to_both_slices(tmp_path: Path) -> None:
    b = TraceBuilder()
    send = b.span(0, S.P2P_SEND_FORWARD, 10, 20)
    recv = b.span(1, S.PP_RECV_FORWARD_LINKED, 15, 30, links=[send])
    b.span(1, S.P2P_RECV_FORWARD, 40, 50, links=[b.span(0, S.ITERATION, 0, 5)])
    b.span(1, S.OPTIMIZER, 60, 70, links=[type(recv)("ff" * 16, "ee" * 8, 0)])  # not exported
    doc = _export(tmp_path, b)
    xs = check_chrome_trace(doc)
    flows = [e for e in doc["traceEvents"] if e["ph"] in "sf"]
    assert len(flows) == 4
    starts = {e["id"]: e for e in flows if e["ph"] == "s"}
    ends = {e["id"]: e for e in flows if e["ph"] == "f"}
    assert set(starts) == set(ends)
    x_of = {e["args"]["span_id"]: e for e in xs}
    by_pid_ts = {(e["pid"], e["tid"], e["ts"]): e["name"] for e in xs}
    pairs = {(by_pid_ts[(s["pid"], s["tid"], s["ts"])], by_pid_ts[(ends[i]["pid"], ends[i]["tid"], ends[i]["ts"])])
             for i, s in starts.items()}  # fmt: skip
    assert pairs == {
        (S.P2P_SEND_FORWARD, S.PP_RECV_FORWARD_LINKED),
        (S.ITERATION, S.P2P_RECV_FORWARD),
    }
    assert all(e["bp"] == "e" for e in ends.values())
    assert x_of[send.span_id]["pid"] == 0 and x_of[recv.span_id]["pid"] == 1


@pytest.mark.parametrize("pp", [1, 2])
def test_realistic_run_exports_valid_nested_trace(tmp_path: Path, pp: int) -> None:
    n = write_realistic_run(tmp_path / "run", ranks=2, steps=6, pp=pp, ckpt_every=3, eval_every=2)
    out = tmp_path / "t.json"
    stats = export_chrome(open_reader(tmp_path / "run"), out)
    xs = check_chrome_trace(json.loads(out.read_text()))
    assert len(xs) == stats.spans == n
    # The generated tree nests properly, so no extra lanes are needed.
    assert stats.lanes == stats.threads == 2


def test_assign_lanes_on_span_records_nests_each_lane() -> None:
    # The record form (used by `mlaunch trace report`): parent first, an async pair that
    # overlaps without nesting, and a child that nests in the second of the pair.
    from typing import NamedTuple

    from mlaunch.trace.chrome import assign_lanes

    class Rec(NamedTuple):
        start: int
        end: int
        key: tuple[str, str]
        parent: str

    recs = [
        Rec(0, 100, ("t", "01"), ""),
        Rec(10, 50, ("t", "02"), "01"),
        Rec(30, 70, ("t", "03"), "01"),
        Rec(40, 60, ("t", "04"), "03"),
        Rec(80, 90, ("t", "05"), "01"),
    ]
    assert assign_lanes(recs) == [0, 0, 1, 1, 0]
