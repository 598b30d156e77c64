"""The follower behind ``--tee`` (:mod:`mlaunch.launcher.worker_output`) on real files laid out
as torchrun lays them out (``<log-dir>/<id>/attempt_<N>/<local rank>/stdout.log``), written while
it follows them: whole lines only, each prefixed with its global rank, a partial line held until
its newline, an endless line cut with a marker, a restart's new attempt followed, nothing lost
behind a slow console; and which ranks the settings show (``--tee``, ``--local-ranks-filter``).
The real torchrun runs are ``tests/integration/test_console_tee.py``."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from mlaunch.launcher.plan import build_plan
from mlaunch.launcher.worker_output import CONTINUED, MAX_LINE, RankMap, WorkerOutput

#: Node 0 of a one-node run: global rank = local rank.
ONE_NODE = RankMap(0, 2, 1)


class Console:
    """What the follower writes to: every batch, in order (``delay``: a slow terminal)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.batches: list[str] = []
        self.delay = delay
        self.lock = threading.Lock()

    def write(self, text: str) -> None:
        time.sleep(self.delay)
        with self.lock:
            self.batches.append(text)

    @property
    def text(self) -> str:
        with self.lock:
            return "".join(self.batches)


def rank_file(log_dir: Path, attempt: int, local: int, stream: str = "stdout.log") -> Path:
    folder = log_dir / "run_abc" / f"attempt_{attempt}" / str(local)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / stream


def wait_until(predicate, what: str, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def test_whole_prefixed_lines_and_a_partial_line_held_until_its_newline(tmp_path: Path) -> None:
    """Node 1 of a 2 x 2 world whose rendezvous gave it ranks 0 and 1: the prefix is the rank
    each worker's wrapper wrote into its log folder, not node_rank * nproc + local; a folder's
    lines wait, unread, until that file is there."""
    console = Console()
    out = WorkerOutput(tmp_path, time.time(), 2, None, RankMap(1, 2, 2), console.write).start()
    try:
        a, b = rank_file(tmp_path, 0, 0), rank_file(tmp_path, 0, 1, "stderr.log")
        with a.open("ab", buffering=0) as fa, b.open("ab", buffering=0) as fb:
            fa.write(b"hello from 0\nhalf of a li")
            fb.write(b"err of 1\n")
            time.sleep(0.3)  # several polls: no rank written yet, nothing shown
            assert console.text == ""
            for local in (0, 1):
                (a.parent.parent / str(local) / "rank").write_text(str(local))
            wait_until(lambda: "err of 1" in console.text and "hello" in console.text, "lines")
            time.sleep(0.3)  # several polls: the half line must still wait
            assert "half" not in console.text
            fa.write(b"ne\n")
            wait_until(lambda: "half" in console.text, "the completed line")
    finally:
        out.close()
    lines = console.text.splitlines()
    assert sorted(lines[:2]) == ["[rank 0] hello from 0", "[rank 1] err of 1"]
    assert lines[2:] == ["[rank 0] half of a line"]
    for batch in console.batches:
        assert batch.endswith("\n")  # every write ends on a line's end: never half a line


def test_a_worker_gone_before_its_rank_was_written_gets_the_static_numbering(
    tmp_path: Path,
) -> None:
    console = Console()
    out = WorkerOutput(tmp_path, time.time(), 2, None, RankMap(1, 2, 2), console.write)
    out.start()
    rank_file(tmp_path, 0, 1).write_text("a short life\n")
    time.sleep(0.3)
    assert console.text == ""  # multi-node: held, unread, until the rank is known
    out.close()
    assert console.text == "[rank 3] a short life\n"  # node 1's local rank 1


def test_a_line_that_never_ends_is_cut_with_a_marker_and_a_last_line_without_newline_is_shown(
    tmp_path: Path,
) -> None:
    console = Console()
    out = WorkerOutput(tmp_path, time.time(), 1, None, ONE_NODE, console.write).start()
    endless = b"y" * (MAX_LINE * 2 + 10)
    rank_file(tmp_path, 0, 0).write_bytes(endless + b"\nlast words")
    wait_until(lambda: console.text.count(CONTINUED) == 2, "two cut pieces")
    out.close()  # the run ended: "last words" (no newline) is complete now
    lines = console.text.splitlines()
    assert lines[0] == "[rank 0] " + "y" * MAX_LINE + CONTINUED
    assert lines[1] == "[rank 0] " + "y" * MAX_LINE + CONTINUED
    assert lines[2] == "[rank 0] " + "y" * 10
    assert lines[3] == "[rank 0] last words"
    assert len(lines) == 4


def test_the_filter_shows_only_its_ranks(tmp_path: Path) -> None:
    console = Console()
    out = WorkerOutput(tmp_path, time.time(), 2, frozenset({1}), ONE_NODE, console.write).start()
    rank_file(tmp_path, 0, 0).write_text("from zero\n")
    rank_file(tmp_path, 0, 1).write_text("from one\n")
    out.close()
    assert console.text == "[rank 1] from one\n"


def test_a_restart_is_followed_and_the_old_attempts_last_line_comes_first(tmp_path: Path) -> None:
    console = Console()
    out = WorkerOutput(tmp_path, time.time(), 1, None, ONE_NODE, console.write).start()
    rank_file(tmp_path, 0, 0).write_text("attempt 0 line\nkilled mid-li")
    wait_until(lambda: "attempt 0 line" in console.text, "attempt 0")
    rank_file(tmp_path, 1, 0).write_text("attempt 1 line\n")
    wait_until(lambda: "attempt 1 line" in console.text, "attempt 1")
    out.close()
    assert console.text.splitlines() == [
        "[rank 0] attempt 0 line",
        "[rank 0] killed mid-li",
        "[rank 0] attempt 1 line",
    ]


def test_an_earlier_launchs_attempt_folders_are_not_shown(tmp_path: Path) -> None:
    old = rank_file(tmp_path, 0, 0)
    old.write_text("an earlier launch\n")
    past = time.time() - 3600
    os.utime(old.parent.parent, (past, past))
    console = Console()
    out = WorkerOutput(tmp_path, time.time(), 1, None, ONE_NODE, console.write).start()
    time.sleep(0.3)
    out.close()
    assert console.text == ""


def test_a_slow_console_loses_nothing_and_memory_stays_bounded(tmp_path: Path) -> None:
    """A console that takes 20 ms per write while a rank writes 4 MB at once: the lines wait in
    the file (each batch at most a chunk per file, not the whole backlog) and all arrive."""
    console = Console(delay=0.02)
    out = WorkerOutput(tmp_path, time.time(), 2, None, ONE_NODE, console.write).start()
    lines = [f"line {i:07d} " + "z" * (i % 80) for i in range(60_000)]
    rank_file(tmp_path, 0, 0).write_text("\n".join(lines) + "\n")
    rank_file(tmp_path, 0, 1).write_text("one line of rank 1\n")
    out.close()
    shown = console.text.splitlines()
    assert [s.removeprefix("[rank 0] ") for s in shown if s.startswith("[rank 0] ")] == lines
    assert "[rank 1] one line of rank 1" in shown
    assert max(len(b) for b in console.batches) <= 2 * (64 * 1024 + 9 * 4096)
    assert out.behind == 0 and out.error is None


def test_a_console_that_cannot_keep_up_by_the_end_is_named_not_dropped(tmp_path: Path) -> None:
    console = Console(delay=0.05)
    out = WorkerOutput(tmp_path, time.time(), 1, None, ONE_NODE, console.write).start()
    rank_file(tmp_path, 0, 0).write_text(("v" * 99 + "\n") * 20_000)
    out.close(drain_s=0.0)
    assert out.behind > 0  # the launcher says how much (mlaunch.launcher.worker_output.follow)


def _plan(tmp_path: Path, **flags: object):  # type: ignore[no-untyped-def]
    return build_plan(
        flags={"launch.run_dir": str(tmp_path / "r"), **flags}, environ={}, cwd=tmp_path
    )


@pytest.mark.parametrize(
    ("flags", "shown", "summary"),
    [
        ({}, (False, None), "(the live view shows progress; --tee shows it here)"),
        ({"launch.tee": True}, (True, None), "all 2 ranks here as [rank R] lines (--tee)"),
        # A filter turns it on.
        ({"launch.local_ranks_filter": "1"}, (True, {1}), "rank 1 here as [rank R] lines"),
        ({"launch.script": "SCRIPT"}, (True, None), "all 2 ranks here"),  # a script: on
        ({"launch.script": "SCRIPT", "launch.tee": False}, (False, None), "(--no-tee; --tee"),
        ({"launch.script": "SCRIPT", "launch.local_ranks_filter": " 1 ,0,1"}, (True, {0, 1}),
         "ranks 0,1 here"),
        # Node 1 of 2 x 2: the filter names global ranks, this node shows those it runs.
        (
            {"launch.tee": True, "launch.nnodes": 2, "launch.node_rank": 1,
             "launch.rdzv_endpoint": "127.0.0.1:29500", "launch.rdzv_id": "j",
             "launch.local_ranks_filter": "0,3"},
            (True, {0, 3}),
            "ranks 0,3 (those of this node) here",
        ),
    ],
)  # fmt: skip
def test_which_ranks_the_console_shows(
    tmp_path: Path, flags: dict, shown: tuple, summary: str
) -> None:
    from mlaunch.cli.train_view import worker_output_text

    script = tmp_path / "s.py"
    script.write_text("print('hi')\n")
    plan = _plan(tmp_path, **{k: str(script) if v == "SCRIPT" else v for k, v in flags.items()})
    launch = plan.settings.launch
    assert (launch.tee_on, launch.shown_ranks) == shown
    assert plan.resolved_json()["worker_output"] == {
        "tee": shown[0],
        "ranks": sorted(shown[1]) if shown[1] is not None else None,
    }
    assert summary in worker_output_text(plan)
