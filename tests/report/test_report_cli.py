"""``mlaunch trace report`` without a browser: the window arithmetic, the command's errors, and
what the HTML holds (read back from its inline JSON)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.synthetic_traces import hand_example
from typer.testing import CliRunner

from mlaunch.trace.reader import TraceInputError
from mlaunch.trace.report import choose_iterations, parse_iterations, write_report

PROGRESS = [
    {"iteration": 1, "train_iters": 4, "loss": 4.0, "lr": 1e-3, "grad_norm": 1.5,
     "tokens_per_sec": 1000.0, "step_ms": 130.0, "skipped": False},
    {"iteration": 2, "train_iters": 4, "loss": 3.5, "lr": 2e-3, "grad_norm": 1.25,
     "tokens_per_sec": 1300.0, "step_ms": 100.0, "skipped": False},
    {"iteration": 2, "eval_loss": 3.75},
]  # fmt: skip


@pytest.fixture
def hand_run(tmp_path: Path) -> Path:
    """The trace tests' hand-computed two-rank run, with a progress file."""
    run = hand_example()[0].write_run_dir(tmp_path / "run")
    (run / "progress.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROGRESS))
    return run


def invoke(*args: str | Path):
    from mlaunch.cli import app

    return CliRunner().invoke(app, ["trace", "report", *map(str, args)])


def figures(page: Path) -> dict:
    """The figures a report hands to Plotly.newPlot (its inline JSON)."""
    m = re.search(r'<script type="application/json" id="report-figures">(.*?)</script>',
                  page.read_text(), re.S)  # fmt: skip
    assert m
    return json.loads(m.group(1).replace("<\\/", "</"))


@pytest.mark.parametrize(("text", "expected"), [("10:20", (10, 20)), ("7", (7, 7)),
                                                (" 3:3 ", (3, 3))])  # fmt: skip
def test_iterations_parse_as_inclusive_ranges(text: str, expected: tuple[int, int]) -> None:
    assert parse_iterations(text) == expected


@pytest.mark.parametrize("text", ["a:b", "1:2:3", "5:3", "-1:4", "", ":", "1.5:3"])
def test_invalid_iterations_are_refused_with_a_reason(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        parse_iterations(text)


def test_default_window_is_the_first_and_last_three_iterations() -> None:
    assert choose_iterations(range(1, 1001), None) == [(1, 3), (998, 1000)]
    assert choose_iterations([1, 2, 3, 4, 5, 6, 7], None) == [(1, 7)]  # short: everything
    assert choose_iterations([], None) == []  # no steps: the whole trace


def test_default_window_also_shows_captures_and_recorder_dumps() -> None:
    # A capture in the middle of a long run is shown, not hidden in the gap.
    got = choose_iterations(range(1, 1001), None, include=[(500, 504)])
    assert got == [(1, 3), (500, 504), (998, 1000)]
    # One next to an edge merges with it; one outside the trace adds nothing.
    assert choose_iterations(range(1, 1001), None, include=[(4, 6), (2000, 2001)]) == [
        (1, 6),
        (998, 1000),
    ]


def test_requested_window_is_clipped_to_the_trace_or_refused() -> None:
    assert choose_iterations(range(1, 11), (0, 2)) == [(1, 2)]
    assert choose_iterations(range(1, 11), (4, 400)) == [(4, 10)]
    with pytest.raises(TraceInputError, match=r"20:30.*iterations 1-10"):
        choose_iterations(range(1, 11), (20, 30))


@pytest.mark.parametrize("bad", ["x:y", "9:2", "1:2:3"])
def test_cli_rejects_bad_iterations_with_exit_2(hand_run: Path, tmp_path: Path, bad: str) -> None:
    out = tmp_path / "r.html"
    r = invoke(hand_run, "--iterations", bad, "-o", out)
    assert r.exit_code == 2, r.output
    assert "--iterations" in r.output and "Traceback" not in r.output
    assert not out.exists()


def test_cli_names_the_trace_range_when_the_window_misses_it(hand_run: Path) -> None:
    r = invoke(hand_run, "--iterations", "50:60")
    assert r.exit_code == 2
    assert "50:60" in r.output and "iterations 1-4" in r.output
    assert not (hand_run / "report.html").exists()


def test_cli_names_a_missing_run_directory(tmp_path: Path) -> None:
    r = invoke(tmp_path / "nope")
    assert r.exit_code == 2 and str(tmp_path / "nope") in r.output
    assert "Traceback" not in r.output


def test_cli_writes_run_dir_report_by_default(hand_run: Path) -> None:
    r = invoke(hand_run)
    assert r.exit_code == 0, r.output
    assert f"wrote {hand_run / 'report.html'}" in r.output
    assert "timeline iterations 1-4" in r.output and "on 2 lane(s)" in r.output


def test_write_report_returns_the_path_and_takes_a_window(hand_run: Path, tmp_path: Path) -> None:
    assert write_report(hand_run) == hand_run / "report.html"
    out = write_report(hand_run, tmp_path / "sub" / "w.html", iterations=(2, 3))
    assert out == tmp_path / "sub" / "w.html" and out.is_file()
    tl = figures(out)["timeline"]
    steps = [h for t in tl["data"] if t["type"] == "bar" for h in t["hovertext"]
             if "megatron.train.iteration" in h]  # fmt: skip
    # The window is a time range shared by all lanes: iterations 2-3 span 120-600 ms (rank 1's
    # step 2 starts at 120, rank 0's step 3 ends at 600), so rank 0's step 1 (260-390) and rank
    # 1's step 4 (370-570) overlap it and are drawn too, clipped to it.
    iters = sorted(int(re.search(r"megatron.iteration = (\d+)", h).group(1)) for h in steps)
    assert iters == [1, 2, 2, 3, 3, 4]
    bars = [t for t in tl["data"] if t["type"] == "bar"]
    assert max(b + x for t in bars for b, x in zip(t["base"], t["x"], strict=True)) == 480


def test_report_is_one_self_contained_file(hand_run: Path) -> None:
    from plotly.offline import get_plotlyjs

    text = write_report(hand_run).read_text()
    assert text.count(get_plotlyjs()[:300]) == 1  # embedded once for all figures
    markup = re.sub(r"<script\b[^>]*>.*?</script>", "<script></script>", text, flags=re.S)
    assert not re.search(r"<script\b[^>]*\bsrc\s*=", text)  # no script loaded from anywhere
    assert not re.search(r"<link\b", markup)  # no stylesheets or icons from anywhere
    assert not re.search(r"""\b(src|href)\s*=\s*["']?\s*(https?:)?//""", markup)
    assert not re.search(r"url\(\s*['\"]?(https?:)?//", markup)
    assert "@import" not in markup


def test_report_shows_the_summary_goodput_and_curves(hand_run: Path) -> None:
    page = write_report(hand_run)
    text = page.read_text()
    assert "synthrun0001" in text
    assert "61.8%" in text  # overall goodput of the hand example: 970 / 1570 ms
    row = re.search(r"<tr><td[^>]*>megatron.checkpoint.save.io_write</td>(.*?)</tr>", text)
    assert row and '<td data-v="1">1</td>' in row.group(1)  # its one ERROR span
    figs = figures(page)
    loss = {t["name"]: (t["x"], t["y"]) for t in figs["chart-loss"]["data"]}
    assert loss == {"train": ([1, 2], [4.0, 3.5]), "eval": ([2], [3.75])}
    assert figs["chart-lr"]["data"][0]["y"] == [1e-3, 2e-3]
    assert figs["chart-step-time"]["data"][0]["y"] == [130.0, 100.0]
    gp = {t["name"]: t["x"][0] for t in figs["chart-goodput"]["data"]}  # "all ranks" row
    assert round(sum(gp.values()), 6) == 100.0 and round(gp["productive"], 1) == 61.8


def test_curves_fall_back_to_step_span_attributes(tmp_path: Path) -> None:
    run = hand_example()[0].write_run_dir(tmp_path / "run")  # no progress.jsonl
    page = write_report(run)
    figs = figures(page)
    # only rank 0's first step carries megatron.loss (4.0); step times are the spans' durations
    assert figs["chart-loss"]["data"][0]["x"] == [1] and figs["chart-loss"]["data"][0]["y"] == [4.0]
    assert figs["chart-step-time"]["data"][0]["y"] == [130.0, 100.0, 100.0, 100.0]
    assert "span attributes of rank 0" in page.read_text()


def test_unreadable_progress_lines_are_skipped_and_noted(hand_run: Path) -> None:
    with open(hand_run / "progress.jsonl", "a") as f:
        # No iteration; an iteration that is no whole number; neither record's; a cut last line.
        f.write(
            '{"loss": 1.0}\n{"iteration": "3", "loss": 1.0}\n{"iteration": 3}\n{"iteration": 3, "loss"'
        )
    r = invoke(hand_run)
    assert r.exit_code == 0, r.output
    assert "4 unreadable line(s) of progress.jsonl skipped" in r.output


def test_a_traces_file_reports_its_whole_run_directory(hand_run: Path) -> None:
    trace_file = hand_run / "telemetry" / "traces-rank0.jsonl"
    r = invoke(trace_file)
    assert r.exit_code == 0, r.output
    page = hand_run / "report.html"  # next to progress.jsonl, not inside telemetry/
    assert f"wrote {page}" in r.output and "on 1 lane(s)" in r.output
    assert figures(page)["chart-loss"]["data"][0]["y"] == [4.0, 3.5]  # progress.jsonl was found


def test_a_window_too_large_to_draw_is_refused(hand_run: Path, monkeypatch) -> None:
    import mlaunch.trace.report.window as report

    monkeypatch.setattr(report, "MAX_TIMELINE_SPANS", 5)
    r = invoke(hand_run)
    assert r.exit_code == 2 and "more than 5 spans" in r.output and "--iterations" in r.output
    assert not (hand_run / "report.html").exists()


def test_an_unwritable_output_exits_2(hand_run: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = invoke(hand_run, "-o", blocker / "report.html")  # a file where a directory should be
    assert r.exit_code == 2 and "cannot write" in r.output and "Traceback" not in r.output


def test_without_step_spans_the_timeline_shows_the_whole_trace(tmp_path: Path) -> None:
    from support.synthetic_traces import TraceBuilder

    from mlaunch.model.spans import SpanName

    b = TraceBuilder(world_size=1)  # the `default` preset: no step group
    pre = b.span(0, SpanName.TRAIN, 0, 100)
    b.span(0, SpanName.CHECKPOINT_SAVE, 40, 60, parent=pre)
    page = write_report(b.write_run_dir(tmp_path / "run"))
    text = page.read_text()
    assert "the timeline shows the whole trace" in text
    assert "No training curves" in text and "No megatron.train.iteration spans" in text
    bars = [t for t in figures(page)["timeline"]["data"] if t["type"] == "bar"]
    assert sorted(len(t["x"]) for t in bars) == [1, 1]  # job and checkpoint, one span each


def test_the_report_package_imports_no_module_of_its_own_up_front() -> None:
    """The package's public names are imported on first use: importing it (as every submodule's
    import does first) loads none of its modules: importing one submodule does not load the
    whole report."""
    import subprocess
    import sys

    code = (
        "import sys, mlaunch.trace.report as r;"
        "assert not [m for m in sys.modules if m.startswith('mlaunch.trace.report.')], sys.modules;"
        "import mlaunch.trace.report.window;"
        "assert r.write_report.__module__ == 'mlaunch.trace.report.build'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
