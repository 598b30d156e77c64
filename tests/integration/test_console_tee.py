"""The workers' output on the launcher's console, with real torchrun runs: a ``--script`` whose
two ranks print many lines at once reaches a pipe and a real terminal (tmux) whole, each line
prefixed with its rank, none lost, the per-rank logs still complete; ``--local-ranks-filter 1``
shows rank 1 only; ``--no-tee`` none; ``--tee`` shows the built-in trainer's output; a rank
that prints 10 MB arrives whole."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
from support.launch_runs import clean_env, finish, free_port, mlaunch
from support.terminal import Pane, find_or_install_tmux

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

#: Each rank prints ``r{rank}:{i}:{x...}:end`` lines (lengths varying) on stdout and every 50th
#: one also on stderr, as fast as it can, both ranks at once; rank ``BIG`` (if set) prints
#: ``BIG_LINES`` 100-byte lines instead (10 MB).
PRINTER = """\
import os, sys, time
rank = int(os.environ["RANK"])
n = int(sys.argv[1])
time.sleep(float(os.environ.get("START_SLEEP", "0")))
big = os.environ.get("BIG")
if big is not None and rank == int(big):
    n = int(os.environ["BIG_LINES"])
    for i in range(n):
        print(f"r{rank}:{i:07d}:" + "x" * 84 + ":end")
else:
    for i in range(n):
        print(f"r{rank}:{i:07d}:" + "x" * (i % 97) + ":end")
        if i % 50 == 0:
            print(f"r{rank}:{i:07d}:e:end", file=sys.stderr)
"""
LINE = re.compile(r"\[rank (\d+)\] r(\d+):(\d{7}):(x*|e):end")
#: A worker's line, wherever it is (a line holding one but not matching LINE was broken).
PAYLOAD = re.compile(r"r\d+:\d{7}:")


def run_script(tmp_path: Path, *flags: str, lines: int = 3000, **env: str) -> tuple[int, str]:
    (tmp_path / "printer.py").write_text(PRINTER)
    proc = mlaunch(
        "--script", "printer.py", "--run-dir", str(tmp_path / "run"), *flags, "--", str(lines),
        cwd=tmp_path, env=clean_env(**env),
    )  # fmt: skip
    return finish(proc)


def shown(text: str) -> tuple[dict[int, list[int]], dict[int, int]]:
    """(rank -> the stdout line numbers shown in order, rank -> stderr lines shown); fails on
    any line that holds a worker's line but is not one whole prefixed line of that rank."""
    out: dict[int, list[int]] = {}
    err: dict[int, int] = {}
    for line in text.splitlines():
        line = line.rstrip()
        if not PAYLOAD.search(line):
            continue
        m = LINE.fullmatch(line)
        assert m is not None and m.group(1) == m.group(2), f"a broken line: {line!r}"
        rank = int(m.group(1))
        if m.group(4) == "e":
            err[rank] = err.get(rank, 0) + 1
        else:
            out.setdefault(rank, []).append(int(m.group(3)))
    return out, err


def logs_complete(tmp_path: Path, lines: int) -> None:
    """The per-rank logs hold every line too (the console is a copy, not a move)."""
    for rank in (0, 1):
        (stdout,) = (tmp_path / "run" / "logs" / "node0").glob(f"*/attempt_0/{rank}/stdout.log")
        got = [int(line.split(":")[1]) for line in stdout.read_text().splitlines()]
        assert got == list(range(lines))
        assert len(stdout.with_name("stderr.log").read_text().splitlines()) == -(-lines // 50)


def test_a_scripts_ranks_reach_a_pipe_whole_prefixed_and_complete(tmp_path: Path) -> None:
    code, out = run_script(tmp_path, lines=3000)
    assert code == 0, out
    lines, errs = shown(out)
    assert lines == {0: list(range(3000)), 1: list(range(3000))}
    assert errs == {0: 60, 1: 60}
    logs_complete(tmp_path, 3000)
    assert "all 2 ranks here as [rank R] lines (--tee)" in " ".join(out.replace("│", " ").split())


def test_the_filter_shows_only_rank_1(tmp_path: Path) -> None:
    code, out = run_script(tmp_path, "--local-ranks-filter", "1", lines=500)
    assert code == 0, out
    lines, errs = shown(out)
    assert lines == {1: list(range(500))} and errs == {1: 10}
    logs_complete(tmp_path, 500)  # rank 0's output is in its log all the same


def test_no_tee_shows_none_of_a_scripts_output(tmp_path: Path) -> None:
    code, out = run_script(tmp_path, "--no-tee", lines=500)
    assert code == 0, out
    assert shown(out) == ({}, {})
    # The summary's row, however the panel wraps it at this terminal's width.
    assert "--no-tee; --tee shows it here" in " ".join(out.replace("│", " ").split())
    logs_complete(tmp_path, 500)


def test_tee_shows_the_built_in_trainers_output(tmp_path: Path) -> None:
    proc = mlaunch(
        "--tee", "--train-iters", "3", "--log-interval", "1", "--eval-interval", "0",
        "--run-dir", str(tmp_path / "run"), cwd=tmp_path,
    )  # fmt: skip
    code, out = finish(proc)
    assert code == 0, out
    # The trainer's own lines (rank 0 prints them; they name their rank themselves too).
    steps = [line for line in out.splitlines() if re.match(r"\[rank 0\] .*iteration \d/3 \|", line)]
    assert len(steps) == 3, out
    # Without --tee the trainer's output stays in the logs (its live view is the console).
    code, plain = finish(
        mlaunch("--train-iters", "1", "--run-dir", str(tmp_path / "run2"), cwd=tmp_path)
    )
    assert code == 0, plain
    assert not [line for line in plain.splitlines() if line.startswith("[rank ")]


def test_a_rank_printing_10_mb_arrives_whole(tmp_path: Path) -> None:
    """Rank 1 prints 100,000 lines of 100 bytes (10 MB) while rank 0 prints its usual lines:
    every one reaches the pipe, whole and in order."""
    code, out = run_script(tmp_path, lines=2000, BIG="1", BIG_LINES="100000")
    assert code == 0, out
    lines, _ = shown(out)
    assert len(lines[1]) == 100_000 and lines[1] == list(range(100_000))
    assert lines[0] == list(range(2000))


def test_two_nodes_each_show_their_own_ranks_under_the_ranks_the_workers_have(
    tmp_path: Path,
) -> None:
    """Two "nodes" on one machine, node 1 started first: torchrun's c10d rendezvous numbers the
    nodes by host and pid, so node 1's worker is likely rank 0. Each launcher shows its own
    worker's lines under the rank that worker has (each line says its RANK: they must agree),
    and with ``--local-ranks-filter 1`` only the launcher running rank 1 shows any. (The workers
    live a second, as a training worker lives far longer: the launcher reads their ranks while
    they run; the numbering of workers gone before that is tests/unit/test_worker_output.py's.)"""
    (tmp_path / "printer.py").write_text(PRINTER)
    for filt in ((), ("--local-ranks-filter", "1")):
        port = free_port()
        outs = []
        procs = []
        for node in (1, 0):
            procs.append(
                mlaunch(
                    "--script",
                    "printer.py",
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    "1",
                    "--node-rank",
                    str(node),
                    "--rdzv-endpoint",
                    f"127.0.0.1:{port}",
                    "--rdzv-id",
                    f"two{len(filt)}",
                    "--run-dir",
                    str(tmp_path / f"run{len(filt)}"),
                    *filt,
                    "--",
                    "300",
                    cwd=tmp_path,
                    env=clean_env(START_SLEEP="1"),
                )  # fmt: skip
            )
            if node == 1:
                time.sleep(1.0)  # node 1's torchrun first: the lower pid
        for proc in procs:
            code, out = finish(proc)
            assert code == 0, out
            outs.append(shown(out)[0])
        if not filt:
            # One rank on each launcher, both ranks in all: each line under its worker's RANK.
            assert sorted(r for lines in outs for r in lines) == [0, 1]
            assert all(len(lines) == 1 for lines in outs)
            assert all(v == list(range(300)) for lines in outs for v in lines.values())
        else:
            assert sorted(outs, key=len) == [{}, {1: list(range(300))}]


@pytest.fixture(scope="module")
def tmux() -> str:
    """tmux, installed with apt-get when missing (skips only where it cannot be)."""
    path, why = find_or_install_tmux()
    if path is None:
        pytest.skip(why)
    return path


def test_a_scripts_ranks_reach_a_real_terminal_whole_above_the_live_view(
    tmp_path: Path, tmux: str
) -> None:
    """In a terminal the live view stays the last thing on the screen and the workers' lines
    scroll above it: every one whole, prefixed and there (the pane's scrollback holds them all,
    and the view once: it is redrawn below each batch, not left behind in copies)."""
    (tmp_path / "printer.py").write_text(PRINTER)
    command = (
        f"{sys.executable} -m mlaunch train --script printer.py --run-dir {tmp_path / 'run'}"
        " -- 1500"
    )
    pane = Pane(tmux, command, tmp_path, clean_env(), history=20_000)
    try:
        pane.wait_for(lambda s: "[exit " in s, 180, "the run ending")
        text = pane.history()
    finally:
        pane.close()
    assert "[exit 0]" in text, text[-3000:]
    lines, errs = shown(text)
    assert lines == {0: list(range(1500)), 1: list(range(1500))}
    assert errs == {0: 30, 1: 30}
    assert len(re.findall(r"^train .*/\d+ loss", text, re.M)) == 1  # the view, drawn once
    logs_complete(tmp_path, 1500)
