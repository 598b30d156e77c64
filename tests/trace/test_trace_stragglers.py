"""``mlaunch trace stragglers`` on hand-placed spans with answers computed on paper: a DP=2 x
PP=2 layout (rank = pp_rank * dp + dp_rank, as the trainer lays ranks out) where one rank is late
in one phase, and the charges that follow from the schedule."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.synthetic_traces import TraceBuilder, resource_attributes
from support.trace_cli import invoke_trace, user_error
from support.trace_compare import stragglers_unwindowed

from mlaunch.model.spans import Attr, ResourceAttr, SpanName
from mlaunch.trace.reader import TraceInputError
from mlaunch.trace.store import Store, open_reader, open_store
from mlaunch.trace.stragglers import stragglers_store

S = SpanName
DP, PP = 2, 2
WORLD = DP * PP


def layout(b: TraceBuilder, ranks: range = range(WORLD)) -> None:
    """Resources with the trainer's layout: pipeline and data-parallel ranks of each rank."""
    for r in ranks:
        b.resources[r] = resource_attributes(
            r, world_size=WORLD, pp=PP,
            extra={ResourceAttr.PP_RANK: r // DP, ResourceAttr.DP_RANK: r % DP,
                   ResourceAttr.DP_SIZE: DP},
        )  # fmt: skip


def iteration(
    b: TraceBuilder, it: int, t0: float, late: dict[int, tuple[str, float]] | None = None
) -> float:
    """One iteration of one microbatch on every rank (stage 0 sends forward, stage 1 sends the
    gradient back, then each stage's all-reduce), ``late[rank] = (phase, ms)`` stretching that
    rank's forward or data loading. Returns where the next iteration starts."""
    late = late or {}

    def extra(rank: int, phase: str) -> float:
        p, d = late.get(rank, ("", 0.0))
        return d if p == phase else 0.0

    steps = {r: b.span(r, S.ITERATION, t0, t0, attrs={Attr.ITERATION: it}) for r in range(WORLD)}
    arrive: dict[int, float] = {}
    sync = {}
    for dp in range(DP):
        r0, r1 = dp, DP + dp  # stage 0 and stage 1 of this pipeline
        # Stage 0: batch, forward, send the activation.
        t = t0 + 10 + extra(r0, "data")
        b.span(r0, S.GET_BATCH, t0, t, parent=steps[r0])
        fb0 = t
        f_end = t + 20 + extra(r0, "forward")
        b.span(r0, S.MICROBATCH_FORWARD, t, f_end, attrs={Attr.MICROBATCH_ID: 0})
        send_f = b.span(r0, S.P2P_SEND_FORWARD, f_end, f_end + 1)
        # Stage 1: batch, wait for the activation (linked to the send), forward, backward, send.
        t1 = t0 + 10 + extra(r1, "data")
        b.span(r1, S.GET_BATCH, t0, t1, parent=steps[r1])
        recv_end = max(t1, f_end) + 1
        b.span(r1, S.P2P_RECV_FORWARD, t1, recv_end)
        b.span(r1, S.PP_RECV_FORWARD_LINKED, recv_end, recv_end, links=[send_f],
               attrs={Attr.PP_RANK: 1, Attr.DL_MICROBATCH_ID: 0})  # fmt: skip
        fw1 = recv_end + 20 + extra(r1, "forward")
        b.span(r1, S.MICROBATCH_FORWARD, recv_end, fw1)
        b.span(r1, S.MICROBATCH_BACKWARD, fw1, fw1 + 40)
        b.span(r1, S.P2P_SEND_BACKWARD, fw1 + 40, fw1 + 41)
        b.span(r1, S.FORWARD_BACKWARD, t1, fw1 + 41)
        arrive[r1] = fw1 + 41
        # Stage 0: wait for the gradient, backward.
        rb_end = max(f_end + 1, fw1 + 40) + 1
        b.span(r0, S.P2P_RECV_BACKWARD, f_end + 1, rb_end)
        b.span(r0, S.MICROBATCH_BACKWARD, rb_end, rb_end + 40)
        b.span(r0, S.FORWARD_BACKWARD, fb0, rb_end + 40)
        arrive[r0] = rb_end + 40
    for stage in range(PP):
        members = [stage * DP + d for d in range(DP)]
        done = max(arrive[r] for r in members) + 1
        for r in members:
            b.span(r, S.GRAD_SYNC_FINISH, arrive[r], done)
            sync[r] = done
    opt = max(sync.values())  # the step's all-ranks reduce lines everyone up
    for r in range(WORLD):
        b.span(r, S.OPTIMIZER, opt, opt + 10)
        step = next(s for s in b.spans[r] if s["spanId"] == steps[r].span_id)
        step["endTimeUnixNano"] = str(int(step["startTimeUnixNano"]) + round((opt + 10 - t0) * 1e6))
    return opt + 20


def run(tmp_path: Path, late_at: dict[int, dict[int, tuple[str, float]]], n: int = 4) -> Path:
    b = TraceBuilder(world_size=WORLD)
    layout(b)
    t = 0.0
    for it in range(1, n + 1):
        t = iteration(b, it, t, late_at.get(it))
    return b.write_run_dir(tmp_path / "run")


def test_a_rank_slow_in_forward_is_charged_every_wait_it_caused(tmp_path: Path) -> None:
    # Rank 1 (stage 0) is 500 ms late in its forward at iterations 2 and 4: its data-parallel
    # peer (rank 0) waits 500 ms in the all-reduce, its pipeline successor (rank 3) 500 ms more
    # than its replica for the activation, and rank 3's all-reduce peer (rank 2) 500 ms for
    # rank 3, which was late only because it waited for rank 1.
    run_dir = run(tmp_path, {2: {1: ("forward", 500.0)}, 4: {1: ("forward", 500.0)}})
    result = stragglers_store(open_reader(run_dir).store)
    top = result.ranks[0]
    assert (top.rank, top.phase, top.iterations) == (1, "forward", [2, 4])
    assert top.caused_wait_s == pytest.approx(2 * 1.5, abs=1e-6)
    assert top.waits == 2 * 3
    assert [(c.rank, c.phase) for c in result.ranks] == [(1, "forward")]
    assert result.sync_points == {"collectives": 2 * 4, "p2p_waits": 2}
    assert result.missing_ranks == []


def test_the_phase_is_where_the_late_rank_lost_its_time(tmp_path: Path) -> None:
    # Rank 2 (stage 1) is 300 ms late fetching its batch: its receive then never waits (its
    # usual 20 ms bubble is absorbed), the gradient it sends back comes 280 ms late to rank 0,
    # its all-reduce peer (rank 3) waits 280 ms for it, and so does rank 0's peer (rank 1), for
    # rank 0 waited for rank 2's gradient. Nobody is charged for the receive rank 2 skipped.
    run_dir = run(tmp_path, {3: {2: ("data", 300.0)}})
    rows = stragglers_store(open_reader(run_dir).store).ranks
    assert [(c.rank, c.phase, c.iterations) for c in rows] == [(2, "data_loading", [3])]
    assert rows[0].caused_wait_s == pytest.approx(3 * 0.28, abs=1e-6)
    assert rows[0].waits == 3


def test_balanced_run_charges_nobody(tmp_path: Path) -> None:
    # Pipeline bubbles are the schedule's: every replica waits the same, so nobody is charged.
    result = stragglers_store(open_reader(run(tmp_path, {})).store)
    assert result.ranks == []
    assert result.total_wait_s == 0


def test_one_exporting_rank_says_how_to_get_every_rank(tmp_path: Path) -> None:
    b = TraceBuilder(world_size=WORLD)
    layout(b)
    iteration(b, 1, 0.0, {1: ("forward", 100.0)})
    for r in (0, 1, 2):  # what single_rank (the last rank) exports
        del b.spans[r]
    run_dir = b.write_run_dir(tmp_path / "run")
    with pytest.raises(TraceInputError, match="only rank 3 of 4 exported spans"):
        stragglers_store(open_reader(run_dir).store)
    user_error(invoke_trace("stragglers", run_dir), "only rank 3 of 4", "all_ranks", "--recorded")


def test_cli_json_sorted_by_caused_wait(tmp_path: Path) -> None:
    run_dir = run(
        tmp_path, {2: {1: ("forward", 400.0)}, 3: {2: ("data", 100.0)}, 4: {1: ("forward", 400.0)}}
    )
    res = invoke_trace("stragglers", run_dir, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    rows = doc["ranks"]
    assert {"rank", "caused_wait_s", "phase", "iterations"} <= set(rows[0])
    assert [(r["rank"], r["phase"]) for r in rows] == [(1, "forward"), (2, "data_loading")]
    waits = [r["caused_wait_s"] for r in rows]
    assert waits == sorted(waits, reverse=True)
    text = invoke_trace("stragglers", run_dir)
    assert text.exit_code == 0
    assert "rank 1 made the others wait most" in text.output


def test_some_ranks_missing_runs_and_names_them(tmp_path: Path) -> None:
    b = TraceBuilder(world_size=WORLD)
    layout(b)
    iteration(b, 1, 0.0)
    iteration(b, 2, 1000.0, {1: ("forward", 300.0)})
    del b.spans[2]  # e.g. the sampled strategy left rank 2 out
    run_dir = b.write_run_dir(tmp_path / "run")
    result = stragglers_store(open_reader(run_dir).store)
    assert result.missing_ranks == [2] and result.ranks_seen == [0, 1, 3]
    assert (result.ranks[0].rank, result.ranks[0].phase) == (1, "forward")
    text = invoke_trace("stragglers", run_dir)
    assert text.exit_code == 0 and "no spans from ranks 2" in text.output


def test_a_trace_without_synchronising_spans_exits_2_naming_the_group(tmp_path: Path) -> None:
    b = TraceBuilder(world_size=2)
    for r in range(2):
        b.span(r, S.ITERATION, 0, 100, attrs={Attr.ITERATION: 1})
    run_dir = b.write_run_dir(tmp_path / "run")
    user_error(invoke_trace("stragglers", run_dir), "no synchronising spans", "per_step")


# --------------------------------------------------------------------------------------------
# The text view of a long run: a straggler late in every other iteration


def scattered(tmp_path: Path) -> Path:
    """400 iterations: rank 1 late in forward at every odd one, rank 2 late fetching its batch
    at every sixth: as runs, their iterations are thousands of characters."""
    b = TraceBuilder(world_size=WORLD)
    layout(b)
    t = 0.0
    for it in range(1, 401):
        late = {1: ("forward", 50.0)} if it % 2 else {2: ("data", 30.0)} if it % 3 == 0 else None
        t = iteration(b, it, t, late)
    return b.write_run_dir(tmp_path / "run")


def _rows(text: str, rows: list[dict]) -> list[str]:
    """The lines of ``text`` that are the table's rows, one per row of ``rows``, in order."""
    found = []
    for r in rows:
        row = re.compile(
            rf"^\s*{r['rank']}\s+{r['host']}\s+{r['phase']}\s+[\d.]+ s\s+{r['waits']}\s"
        )
        found += [ln for ln in text.splitlines() if row.match(ln)]
    return found


def test_a_scattered_straggler_piped_is_one_short_row_a_line(tmp_path: Path) -> None:
    # A real pipe, as `| less` or `| grep` gives: each row on its line, its iterations summed
    # up as a count and the first runs (every odd iteration listed made a 2,108-character row).
    run_dir = scattered(tmp_path)
    rows = json.loads(invoke_trace("stragglers", run_dir, "--json").output)["ranks"]
    assert len(rows[0]["iterations"]) == 180  # --json keeps every one
    r = subprocess.run(
        [sys.executable, "-m", "mlaunch", "trace", "stragglers", str(run_dir)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "COLUMNS": "80", "TERM": "xterm-256color"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "\x1b[" not in r.stdout and "─" not in r.stdout  # plain: no styles, no box lines
    lines = _rows(r.stdout, rows)
    assert len(lines) == len(rows) == 2, r.stdout
    assert "180 in 1-359: 1, 3, 5, " in lines[0] and lines[0].endswith(", ...")
    assert "60 in 6-360: 6, 12, 18, " in lines[1]
    assert max(map(len, r.stdout.splitlines())) <= 120, r.stdout


@pytest.fixture(scope="module")
def tmux() -> str:
    """tmux, installed with apt-get when missing (skips only where it cannot be)."""
    from support.terminal import find_or_install_tmux

    path, why = find_or_install_tmux()
    if path is None:
        pytest.skip(why)
    return path


def test_a_scattered_straggler_keeps_each_row_on_one_line_of_a_100_column_terminal(
    tmp_path: Path, tmux: str
) -> None:
    # A real terminal 100 columns wide: each row used to wrap to 16 lines or more.
    from support.terminal import Pane

    run_dir = scattered(tmp_path)
    rows = json.loads(invoke_trace("stragglers", run_dir, "--json").output)["ranks"]
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    pane = Pane(tmux, f"{sys.executable} -m mlaunch trace stragglers {run_dir}", tmp_path, env,
                width=100)  # fmt: skip
    try:
        screen = pane.wait_for(lambda s: "[exit " in s, 120, "the command ending")
    finally:
        pane.close()
    assert "[exit 0]" in screen, screen
    lines = _rows(screen, rows)
    assert len(lines) == 2, screen
    # One line a row: a wrapped row would push the next one down a line or more.
    at = screen.splitlines().index(lines[0])
    assert screen.splitlines()[at + 1] == lines[1], screen
    assert "180 in 1-359: 1, 3, 5, " in lines[0] and lines[0].rstrip().endswith(", ...")
    assert max(len(ln.rstrip()) for ln in screen.splitlines()) <= 100
    assert "rank 1 made the others wait most" in screen


# --------------------------------------------------------------------------------------------
# The store's windowed analysis against the whole trace in memory


def restarted(tmp_path: Path) -> Path:
    """Iterations 1-4, then a restart that resumes at 3 (its iterations 3 and 4 repeat, later),
    rank 3 late in forward in the first run's 2 and the second's 5."""
    first = TraceBuilder(world_size=WORLD)
    layout(first)
    t = 0.0
    for it in range(1, 5):
        t = iteration(first, it, t, {3: ("forward", 150.0)} if it == 2 else None)
    run_dir = first.write_run_dir(tmp_path / "run")
    again = TraceBuilder(world_size=WORLD)
    again._next_id = 10_000  # its span ids differ from the first run's
    layout(again)
    for r in range(WORLD):
        again.resources[r][ResourceAttr.RESTART_COUNT] = 1
    t += 5000.0
    for it in range(3, 7):
        t = iteration(again, it, t, {0: ("data", 80.0)} if it == 5 else None)
    for r in range(WORLD):
        with open(run_dir / "telemetry" / f"traces-rank{r}.jsonl", "a") as f:
            f.writelines(line + "\n" for line in again.lines(r))
    return run_dir


def recorded(tmp_path: Path) -> Path:
    """A slow rank, and every rank's flight-recorder dump repeating its last iterations' spans
    (the ids the exporter wrote: each span counts once)."""
    b = TraceBuilder(world_size=WORLD)
    layout(b)
    t = 0.0
    for it in range(1, 7):
        t = iteration(b, it, t, {1: ("forward", 250.0)} if it in (2, 5) else None)
    run_dir = b.write_run_dir(tmp_path / "run")
    for r in range(WORLD):
        lines = b.lines(r)
        (run_dir / "telemetry" / f"recorder-rank{r}.jsonl").write_text(
            "".join(line + "\n" for line in lines[len(lines) // 2 :])
        )
    return run_dir


def realistic(tmp_path: Path) -> Path:
    from support.synthetic_traces import write_realistic_run

    run_dir = tmp_path / "run"
    write_realistic_run(run_dir, ranks=4, steps=30, pp=2, ckpt_every=10, eval_every=7)
    # Rank 0 waits 0.2 ms longer in every third all-reduce: its stage peer, rank 2, is late.
    path = run_dir / "telemetry" / "traces-rank0.jsonl"
    lines, n = [], 0
    for line in path.read_text().splitlines():
        req = json.loads(line)
        for s in req["resourceSpans"][0]["scopeSpans"][0]["spans"]:
            if s["name"] == S.GRAD_SYNC_FINISH:
                n += 1
                if n % 3 == 0:
                    s["startTimeUnixNano"] = str(int(s["startTimeUnixNano"]) - 200_000)
        lines.append(json.dumps(req) + "\n")
    path.write_text("".join(lines))
    return run_dir


TRACES = {
    "pipeline_links_slow_rank": lambda p: run(p, {2: {1: ("forward", 400.0)},
                                                 3: {2: ("data", 100.0)}, 4: {1: ("forward", 400.0)}}),
    "late_stage_passes_the_charge": lambda p: run(p, {3: {2: ("data", 300.0)}}, n=6),
    "balanced": lambda p: run(p, {}),
    "restarted": restarted,
    "recorder_dumps": recorded,
    "realistic_ordered_p2p_ckpt_eval": realistic,
}  # fmt: skip


def _whole_in_memory(tmp_path: Path, trace: str) -> tuple[Path, Store, dict]:
    """One of TRACES written, its store, and the answer of the whole trace analysed at once."""
    from mlaunch.trace.store import StoreReader

    run_dir = TRACES[trace](tmp_path)
    store = open_store(run_dir)
    assert store is not None
    return run_dir, store, stragglers_unwindowed(StoreReader(store)).to_json()


@pytest.mark.parametrize("trace", sorted(TRACES))
@pytest.mark.parametrize("window_spans", [1, 40, 1_000_000])
def test_the_windowed_analysis_equals_the_whole_trace_in_memory(
    tmp_path: Path, trace: str, window_spans: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One iteration a window (every halo and widening rule at work), a few, and one window.
    from mlaunch.trace import stragglers

    run_dir, store, whole = _whole_in_memory(tmp_path, trace)
    assert whole == stragglers_unwindowed(open_reader(run_dir)).to_json()
    monkeypatch.setattr(stragglers, "WINDOW_SPANS", window_spans)
    monkeypatch.setattr(stragglers, "CACHE_ROWS", 50)
    loads: list[bool] = []
    real_load = stragglers._load
    monkeypatch.setattr(stragglers, "_load", lambda *a: loads.append(a[-1]) or real_load(*a))
    assert stragglers_store(store).to_json() == whole
    if window_spans == 1:  # a window per iteration, none of them the whole trace
        assert len(loads) > 4 and not any(loads)
    if trace != "balanced":
        assert whole["ranks"], whole


def test_a_window_holds_a_run_of_the_steps_and_widens_past_its_edges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A window per iteration on a trace whose late rank's steps straddle every window border:
    # each window's ranks hold only a few steps (not the whole trace's), the answer is the
    # whole trace's, and a lookup past the run's edge widens instead of answering.
    from array import array

    from mlaunch.trace import store_steps, stragglers
    from mlaunch.trace.store import StoreReader
    from mlaunch.trace.store_steps import Widen

    run_dir = realistic(tmp_path)
    store = open_store(run_dir)
    assert store is not None
    whole = stragglers_unwindowed(StoreReader(store)).to_json()
    assert whole["ranks"], whole
    monkeypatch.setattr(stragglers, "WINDOW_SPANS", 1)
    held: list[tuple[int, int]] = []
    real_load = stragglers._load

    def load(*a: object) -> object:
        ranks = real_load(*a)
        held.extend((len(r.steps), r.steps.total) for r in ranks.values())
        return ranks

    monkeypatch.setattr(stragglers, "_load", load)
    assert stragglers_store(store).to_json() == whole
    assert held and all(n <= total for n, total in held)
    assert any(n < total // 4 for n, total in held), held

    steps = store_steps.Steps(array("q", [0, 10, 20, 30]), array("q", [5, 15, 25, 35]),
                                    array("q", [1, 2, 3, 4]))  # fmt: skip
    # Iterations 2 and 3 held: a time in step 2 answers; one before it, or from step 3's
    # start on (the step there may be 3's or 4's: the run cannot tell), widens.
    run = store_steps.WindowSteps(steps, 1, 3)
    assert run[run.bisect(12) - 1] == (10, 15, 2) and run[run.bisect(19) - 1] == (10, 15, 2)
    for t in (9, 20, 29, 40):
        with pytest.raises(Widen):
            run.bisect(t)
    tail = store_steps.WindowSteps(steps, 1, 4)  # the run ends where the trace does
    assert tail[tail.bisect(29) - 1] == (20, 25, 3) and tail[tail.bisect(99) - 1] == (30, 35, 4)
    every = store_steps.WindowSteps(steps, 0, 4)
    assert every.bisect(-1) == 0


@pytest.mark.parametrize("trace", sorted(TRACES))
@pytest.mark.parametrize("window_spans", [1, 1_000_000])
def test_steps_kept_on_disk_give_the_answer_kept_in_memory(
    tmp_path: Path, trace: str, window_spans: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Past STEPS_IN_MEMORY the steps and collective ends live in scratch files, read back a
    # window's run at a time: tiny blocks and spool writes put every edge of them at work, and
    # the files are gone afterwards.
    from mlaunch.trace import store_steps, stragglers

    _, store, whole = _whole_in_memory(tmp_path, trace)
    monkeypatch.setattr(stragglers, "WINDOW_SPANS", window_spans)
    monkeypatch.setattr(stragglers, "STEPS_IN_MEMORY", 0)
    monkeypatch.setattr(store_steps, "BLOCK", 2)
    monkeypatch.setattr(store_steps, "SPOOL_ROWS", 7)
    files: list[Path] = []
    real_blob = store_steps.Blob.__init__

    def blob(self: object, path: Path | None) -> None:
        files.append(path)  # type: ignore[arg-type]
        real_blob(self, path)  # type: ignore[arg-type]

    monkeypatch.setattr(store_steps.Blob, "__init__", blob)
    assert stragglers_store(store).to_json() == whole
    assert files and all(f is not None and not f.exists() for f in files), files
    assert not files[0].parent.exists()  # the scratch directory too


@pytest.mark.parametrize("on_disk", [False, True])
def test_sorted_steps_and_ends_answer_as_the_whole_arrays(
    tmp_path: Path, on_disk: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The searches through the per-block index answer as bisect on every row would, ties
    # across block edges included; a window's run of ends widens past its edges.
    import random
    from bisect import bisect_left, bisect_right

    import numpy as np

    from mlaunch.trace import store_steps as ss
    from mlaunch.trace.store_steps import Widen

    monkeypatch.setattr(ss, "BLOCK", 3)
    rng = random.Random(5)
    steps = sorted((s, s + rng.randrange(0, 40), rng.randrange(9)) for s in
                   (rng.randrange(0, 200, 5) for _ in range(50)))  # fmt: skip
    ends = sorted(rng.randrange(0, 250, 3) for _ in range(40))
    blob = ss.Blob(tmp_path / "blob" if on_disk else None)
    rows = np.array(steps, dtype=ss.step_rows().dtype)
    sorted_steps, sorted_ends = ss.SortedSteps(blob, rows), ss.SortedEnds(blob, np.array(ends))
    starts = [s for s, _, _ in steps]
    for t in range(-5, 260):
        assert sorted_steps.lower(t) == bisect_left(starts, t)
        assert sorted_steps.upper(t) == bisect_right(starts, t)
        assert sorted_steps.bisect(t) == bisect_right(steps, (t, 1 << 62, 0))
        assert sorted_ends.upper(t) == bisect_right(ends, t)
        for hi in (t, t + 7, t + 60):
            assert sorted_steps.overlapping(t, hi) == [s for s in steps if s[0] <= hi and s[1] >= t]
    assert sorted_steps.run(4, 9)[:] == steps[4:9] and list(sorted_ends.run(2, 6)) == ends[2:6]
    run = ss.WindowEnds(sorted_ends, 5, 12)
    for t in range(ends[5], ends[11]):
        assert run.before(t) == ends[bisect_right(ends, t) - 1]
    for t in (ends[5] - 1, ends[11], 999):
        with pytest.raises(Widen):
            run.before(t)
    assert ss.WindowEnds(sorted_ends, 0, 3).before(ends[0] - 1) is None
    blob.close()
