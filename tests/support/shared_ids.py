"""Every ``mlaunch trace`` reader over a run whose ranks share span and trace ids (nemo-lens
0.1.0 on data-parallel ranks that seeded ``random`` alike), through both engines: the span store
(a run directory) and the JSON reader (``--skip-invalid`` reads the JSON). Shared by the
synthetic volume test and the real nemo-lens test."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from mlaunch.otlp.otlp_json import read_spans
from support.trace_cli import invoke_trace
from support.trace_compare import assert_same

#: The two engines: the store (a writable run directory) and the JSON reader.
ENGINES = {"store": (), "json": ("--skip-invalid",)}


def rank_spans(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """Each rank's spans as its traces file holds them."""
    out = {}
    for path in sorted((run_dir / "telemetry").glob("traces-rank*.jsonl")):
        out[int(re.search(r"rank(\d+)", path.name).group(1))] = read_spans(path)
    return out


def shared_ids(spans: dict[int, list[dict[str, Any]]]) -> set[tuple[str, str]]:
    """The (trace id, span id) pairs more than one rank emitted."""
    seen: Counter[tuple[str, str]] = Counter()
    for rank_spans_ in spans.values():
        seen.update({(s["trace_id"], s["span_id"]) for s in rank_spans_})
    return {k for k, n in seen.items() if n > 1}


def _ok(*args: Any) -> Any:
    r = invoke_trace(*args)
    assert r.exit_code == 0, r.output
    return r


def _flows(doc: dict[str, Any]) -> list[tuple[int, int]]:
    """Each flow arrow of a Chrome trace as (pid of its start, pid of its end)."""
    starts = {e["id"]: e["pid"] for e in doc["traceEvents"] if e.get("ph") == "s"}
    ends = {e["id"]: e["pid"] for e in doc["traceEvents"] if e.get("ph") == "f"}
    assert starts.keys() == ends.keys()
    return [(starts[i], ends[i]) for i in sorted(starts)]


def _report_links(page: Path) -> list[tuple[str, str]]:
    """Each link arrow of a report's timeline as (the lane of its sender, of its receiver)."""
    text = page.read_text()
    m = re.search(r'<script type="application/json" id="report-figures">(.*?)</script>', text, re.S)
    assert m
    timeline = json.loads(m.group(1).replace("<\\/", "</"))["timeline"]
    axis = timeline["layout"]["yaxis"]
    centres = list(zip(axis["tickvals"], axis["ticktext"], strict=True))

    def lane(y: float) -> str:  # the lanes are drawn alike: the nearest centre is the lane's
        return min(centres, key=lambda c: abs(c[0] - y))[1].split(" · ")[0]  # "rank R"

    arrows = [d for d in timeline["data"] if d.get("name", "").startswith("links")]
    out: list[tuple[str, str]] = []
    for d in arrows:
        ys = d["y"]
        for k in range(0, len(ys), 3):  # sender, receiver, gap
            out.append((lane(ys[k]), lane(ys[k + 1])))
    return out


def check_every_reader(run_dir: Path, tmp: Path, *, links_per_rank: int) -> dict[str, Any]:
    """Run summary, goodput, stragglers, export (Chrome and OTLP-JSON), report and sql through
    both engines and check that nothing of one rank is taken for another's: counts are the
    files' own, every link resolves on its own rank, parents are found on the span's rank.
    Returns the store engine's summary (JSON)."""
    spans = rank_spans(run_dir)
    ranks = sorted(spans)
    names: Counter[str] = Counter(s["name"] for r in ranks for s in spans[r])
    roots = {
        (s["trace_id"], s["span_id"]) for r in ranks for s in spans[r] if not s["parent_span_id"]
    }
    shared_roots = shared_ids(spans) & roots
    results: dict[str, dict[str, Any]] = {}
    for engine, extra in ENGINES.items():
        summary = json.loads(_ok("summary", run_dir, "--json", *extra).stdout)
        if engine == "store":  # the run directory was read through its span store
            assert (run_dir / "trace-store" / "manifest.json").is_file()
        counts = {s["name"]: s["count"] for s in summary["spans"]}
        assert {n: counts[n] for n in names} == dict(names), engine
        assert summary["shared_root_ids"] == len(shared_roots), engine
        text = _ok("summary", run_dir, *extra).output
        assert ("nemo-lens 0.2.0" in text) == bool(shared_roots), text

        goodput = json.loads(_ok("goodput", run_dir, "--json", *extra).stdout)
        assert [r["rank"] for r in goodput["ranks"]] == ranks, engine
        _ok("stragglers", run_dir, *extra)

        chrome = tmp / f"{engine}.chrome.json"
        _ok("export", run_dir, "-o", chrome, *extra)
        flows = _flows(json.loads(chrome.read_text()))
        # Every link (a train block to its rank's previous block or start-up) on its own rank.
        assert sorted(a for a, _ in flows) == sorted(
            r for r in ranks for _ in range(links_per_rank)
        )
        assert all(a == b for a, b in flows), flows

        otlp = tmp / f"{engine}.otlp.jsonl"
        _ok("export", run_dir, "--format", "otlp-json", "-o", otlp, *extra)
        back = Counter(s["name"] for s in read_spans(otlp) if "dl.rank" in s["resource"])
        assert back == names, engine

        page = tmp / f"{engine}.report.html"
        out = _ok("report", run_dir, "-o", page, *extra).output
        arrows = _report_links(page)
        # Each rank's links drawn in its own lane, sender and receiver.
        want = sorted(f"rank {r}" for r in ranks for _ in range(links_per_rank))
        assert sorted(b for _, b in arrows) == want, (out, arrows)
        assert all(a == b for a, b in arrows), arrows
        summary.pop("read")
        results[engine] = summary
    assert_same(results["store"], results["json"], "summary")

    # `trace sql`: a span's parent is the span of its id on the same rank (docs/trace.md).
    q = (
        "SELECT count(*) AS children, count(DISTINCT (c.rank, c.span_id)) AS distinct_children"
        " FROM spans c JOIN spans p ON p.rank = c.rank AND p.trace_id = c.trace_id"
        " AND p.span_id = c.parent_id WHERE c.rank >= 0"
    )
    (row,) = json.loads(_ok("sql", run_dir, q, "--json").stdout)
    with_parent = sum(1 for r in ranks for s in spans[r] if s["parent_span_id"])
    assert row == {"children": with_parent, "distinct_children": with_parent}
    return results["store"]
