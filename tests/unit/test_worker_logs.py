"""How ``mlaunch logs`` numbers attempts and names ranks (:mod:`mlaunch.rundir.worker_logs`),
over a run directory laid out as torchrun lays it out: two launches (a first run restarted once,
then a resume), two nodes, and a node whose rendezvous numbered its ranks otherwise than its
node rank says. (Real runs read back: tests/integration/test_logs_runs.py, tests/slurm/.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mlaunch.launcher import attempt_entry
from mlaunch.rundir import layout as lay
from mlaunch.rundir import worker_logs as wl


def _worker(run_dir: Path, node: int, launch: str, k: int, local: int, text: str) -> Path:
    folder = run_dir / "logs" / f"node{node}" / launch / f"attempt_{k}" / str(local)
    folder.mkdir(parents=True)
    (folder / "stdout.log").write_text(text)
    (folder / "stderr.log").write_text("")
    return folder


def _started(run_dir: Path, node: int, launch: str, k: int, t: float) -> None:
    os.utime(run_dir / "logs" / f"node{node}" / launch / f"attempt_{k}", (t, t))


def test_attempts_are_numbered_over_the_runs_life_and_ranks_by_what_the_worker_said(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    settings = {"launch.nproc_per_node": {"value": 1, "source": "--nproc-per-node"}}
    (run / lay.RESOLVED_JSON_FILE).write_text(json.dumps({"world_size": 2, "settings": settings}))
    # The resume's folder sorts first by name ("a..." < "z..."): its time says it came second.
    first, resume = "zzz_first", "aaa_resume"
    for node in (0, 1):
        for k in (0, 1):
            _worker(run, node, first, k, 0, f"first k{k} node{node}\n")
            _started(run, node, first, k, 1000 + k)
        _worker(run, node, resume, 0, 0, f"resume node{node}\n")
        _started(run, node, resume, 0, 2000)
    found = wl.find(run)
    assert [(a.number, a.launch, a.restart) for a in found.attempts] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0),
    ]  # fmt: skip
    assert found.launches == 2 and found.nodes == (0, 1) and found.ranks == (0, 1)
    assert found.latest is not None
    assert found.latest.describe(found.launches) == "attempt 2 (launch 2 of 2, torchrun restart 0)"
    # Planned: node x nproc + local rank.
    assert [(r.rank, r.node) for r in found.latest.ranks] == [(0, 0), (1, 1)]

    # The rendezvous made node 1's worker rank 0 (and node 0's rank 1): its wrapper said so.
    for node, rank in ((0, 1), (1, 0)):
        folder = run / "logs" / f"node{node}" / resume / "attempt_0" / "0"
        attempt_entry.write_rank({"TORCHELASTIC_ERROR_FILE": str(folder / "error.json"),
                                  "RANK": str(rank)})  # fmt: skip
        assert (folder / lay.WORKER_RANK_FILE).read_text() == str(rank)
    latest = wl.find(run).latest
    assert latest is not None
    assert [(r.rank, r.node) for r in latest.ranks] == [(0, 1), (1, 0)]
    assert [r.files()[0].read_text() for r in wl.select(latest, [0])] == ["resume node1\n"]


def test_tails_and_a_follower_never_cut_a_line(tmp_path):
    path = tmp_path / "stdout.log"
    path.write_text("".join(f"line {i}\n" for i in range(100_000)) + "half")
    assert wl.tail_lines(path, 2) == ["line 99999", "half"]
    end = wl.complete_end(path)
    assert wl.tail_lines(path, 2, end) == ["line 99998", "line 99999"]
    r = wl.RankLog(0, 0, 0, tmp_path)
    (tmp_path / "stderr.log").write_text("")
    follower = wl.Follower([r])
    follower.skip_to(path, end)
    assert follower.poll() == []  # "half" waits for its newline
    with path.open("a") as fh:
        fh.write(" done\nnext")
    assert follower.poll() == [(r, "half done")]
    assert follower.poll(final=True) == [(r, "next")]  # the writer is gone: all of it


def test_follow_takes_the_ranks_torchrun_adds_to_an_attempt_it_already_follows(tmp_path):
    """torchrun makes ``attempt_<K>`` first and its ranks' folders after: a follower that saw
    the attempt empty still shows what those ranks write (a loaded machine widens the gap)."""
    import threading
    import time

    run = tmp_path / "run"
    (run / "logs" / "node0" / "launch_a" / "attempt_0").mkdir(parents=True)
    lines: list[str] = []
    over = threading.Event()
    follower = threading.Thread(
        target=wl.follow,
        args=(run, lambda r, line: lines.append(f"[rank {r.rank}] {line}"), over.is_set),
        kwargs={"poll_s": 0.01, "ended_every_s": 0.01},
    )
    follower.start()
    time.sleep(0.2)  # the follower has taken attempt 0, with no rank in it yet
    _worker(run, 0, "launch_a", 0, 1, "from rank 1\n")
    deadline = time.monotonic() + 30
    while "[rank 1] from rank 1" not in lines and time.monotonic() < deadline:
        time.sleep(0.01)
    over.set()
    follower.join(timeout=30)
    assert lines == ["[rank 1] from rank 1"]
