"""The report in a real headless browser with the network cut off: it loads without errors,
draws one lane per exporting rank, every span of the chosen window exactly once, an arrow per
resolvable link, and every progress point; a screenshot lands in test-artifacts/.

What was drawn is read from the DOM (the page's self-test counts plotly's SVG elements per
trace and lists the span ids behind the bars); what should be drawn is computed here from the
raw trace files, independently of the report code.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from report_browser import ARTIFACTS, Rendered, console_problems, render

from mlaunch.model.spans import Attr, SpanName
from mlaunch.trace.report import write_report

pytestmark = pytest.mark.slow


def raw_spans(run_dir: Path) -> list[dict[str, Any]]:
    """Every span of the run's trace files, with ``rank`` and decoded int times and iteration."""
    out = []
    for path in sorted((run_dir / "telemetry").glob("traces-rank*.jsonl")):
        rank = int(path.stem.removeprefix("traces-rank"))
        for line in path.read_text().splitlines():
            for rs in json.loads(line)["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    for s in ss["spans"]:
                        it = next((int(a["value"]["intValue"]) for a in s.get("attributes", [])
                                   if a["key"] == Attr.ITERATION), None)  # fmt: skip
                        out.append({**s, "rank": rank, "start": int(s["startTimeUnixNano"]),
                                    "end": int(s["endTimeUnixNano"]), "iteration": it})  # fmt: skip
    return out


def expected_window(spans: list[dict[str, Any]], ranges: list[tuple[int, int]]) -> list[dict]:
    """The spans a window must draw: those overlapping the time range of each iteration range's
    steps on all ranks (stretched to the run's start/end at the run's first/last iteration)."""
    steps = [s for s in spans if s["name"] == SpanName.ITERATION and s["iteration"] is not None]
    first = min(s["iteration"] for s in steps)
    last = max(s["iteration"] for s in steps)
    segs = []
    for a, b in ranges:
        chosen = [s for s in steps if a <= s["iteration"] <= b]
        lo = min(s["start"] for s in (spans if a == first else chosen))
        hi = max(s["end"] for s in (spans if b == last else chosen))
        segs.append((lo, hi))
    return [s for s in spans if any(s["start"] < hi and s["end"] > lo for lo, hi in segs)]


def check_timeline(seen: Rendered, spans: list[dict[str, Any]], ranges: list[tuple[int, int]],
                   ranks: list[int], stages: list[int]) -> list[dict[str, Any]]:  # fmt: skip
    """The timeline drew one lane per rank and each window span once; returns the window."""
    assert seen.verdict["errors"] == [], seen.verdict["errors"]
    assert console_problems(seen.stderr) == []
    assert seen.fetches == [] and seen.verdict["resources"] == []  # offline: nothing requested
    assert seen.verdict["lanes"] == [
        f"rank {r} · PP {p}" for r, p in zip(ranks, stages, strict=True)
    ]
    window = expected_window(spans, ranges)
    bars = [t for t in seen.figure("timeline") if t["type"] == "bar"]
    drawn = Counter(i for t in bars for i in t["ids"])
    assert all(n == 1 for n in drawn.values()), [i for i, n in drawn.items() if n > 1][:5]
    assert set(drawn) == {s["spanId"] for s in window}
    assert sum(t["points"] for t in bars) == len(window)  # SVG bars, one per span
    in_window = {s["spanId"] for s in window}
    links = [lk for s in window for lk in s.get("links", ()) if lk["spanId"] in in_window]
    arrows = [t for t in seen.figure("timeline") if t["type"] == "scatter"]
    # Both ends of every link's arrow are drawn (a marker each). The line paths are plotly's to
    # count: it draws none for a segment under a pixel (a block's link to the start-up on its own
    # lane, 0.25 ms long at about 5 ms a pixel, made this test fail now and then).
    assert sum(t["points"] for t in arrows) == 2 * len(links) > 0
    assert 0 < sum(t["lines"] for t in arrows) <= len(links)
    return window


def check_curves(seen: Rendered, progress: list[dict[str, Any]]) -> None:
    """Each chart drew one marker per progress record that has its value."""
    train = [r for r in progress if "eval_loss" not in r]
    evals = [r for r in progress if "eval_loss" in r]
    assert seen.trace("chart-loss", "train")["points"] == len(train)
    if evals:
        assert seen.trace("chart-loss", "eval")["points"] == len(evals)
    for div, name in (("chart-lr", "lr"), ("chart-grad-norm", "grad norm"),
                      ("chart-tokens", "tokens/s"), ("chart-step-time", "step time")):  # fmt: skip
        assert seen.trace(div, name)["points"] == len(train), div


def progress_of(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "progress.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()]


@pytest.mark.distributed
def test_real_run_report_renders_offline(real_run: Path, chromium: str, tmp_path: Path) -> None:
    page = write_report(real_run, tmp_path / "real.html")
    seen = render(chromium, page, tmp_path / "profile", ARTIFACTS / "report-real-run.png")
    spans = raw_spans(real_run)
    iterations = sorted({s["iteration"] for s in spans if s["name"] == SpanName.ITERATION})
    assert iterations == [1, 2, 3, 4, 5, 6]
    window = check_timeline(seen, spans, [(1, 6)], ranks=[0, 1], stages=[0, 1])
    assert len(window) == len(spans)  # a 6-iteration run is shown whole
    assert {s["name"] for s in window} >= {SpanName.PP_RECV_FORWARD_LINKED, SpanName.EVALUATE}
    progress = progress_of(real_run)
    assert len([r for r in progress if "eval_loss" in r]) == 2  # evaluations at 3 and 6
    check_curves(seen, progress)
    assert seen.verdict["figures"]["chart-skew"][0]["points"] == 2  # a bar per rank
    assert [t["points"] for t in seen.figure("chart-goodput")] == [3] * 5  # all + 2 ranks


def test_thousand_iteration_per_step_report(synth_run: Path, chromium: str, tmp_path: Path) -> None:
    page = write_report(synth_run, tmp_path / "synth.html")
    assert page.stat().st_size < 10 * 2**20  # the goal for a 1,000-iteration per_step run
    seen = render(chromium, page, tmp_path / "profile", ARTIFACTS / "report-1000-iterations.png")
    spans = raw_spans(synth_run)
    window = check_timeline(seen, spans, [(1, 3), (998, 1000)], ranks=[0, 1, 2, 3],
                            stages=[0, 1, 0, 1])  # fmt: skip
    shown = {s["iteration"] for s in window if s["name"] == SpanName.ITERATION}
    assert shown == {1, 2, 3, 998, 999, 1000}
    check_curves(seen, progress_of(synth_run))
    assert seen.verdict["tables"]["span-table"] == len({s["name"] for s in spans})
    straggler = seen.figure("chart-skew")[0]
    assert straggler["points"] == 4


def test_explicit_window_in_the_middle(synth_run: Path, chromium: str, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mlaunch.cli import app

    out = tmp_path / "mid.html"
    r = CliRunner().invoke(app, ["trace", "report", str(synth_run), "-o", str(out),
                                 "--iterations", "500:502"])  # fmt: skip
    assert r.exit_code == 0, r.output
    seen = render(chromium, out, tmp_path / "profile")
    window = check_timeline(seen, raw_spans(synth_run), [(500, 502)], ranks=[0, 1, 2, 3],
                            stages=[0, 1, 0, 1])  # fmt: skip
    assert {s["iteration"] for s in window if s["name"] == SpanName.ITERATION} == {500, 501, 502}
    assert SpanName.MODEL_INIT not in {s["name"] for s in window}  # set-up is not in this window
