"""The hang watchdog's pure parts: the verdict, the bounds ``auto`` and a number give, the merge
of several nodes' reports for ``mlaunch status``, and bad ``--hang-timeout``/``--on-hang`` values
(exit 2, nothing started)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mlaunch import envcontract as ec
from mlaunch.launcher import hang
from mlaunch.launcher.hang_report import HangReport, RankView, hang_status, judge, write_report
from mlaunch.rundir.records import ProgressRecord, read_progress_record
from mlaunch.settings import LaunchSettings

SYNC = "megatron.grad_sync.finish"


def _waiting(rank: int, iteration: int = 1204) -> RankView:
    return RankView(rank, span=SYNC, iteration=iteration, in_collective=True)


def test_the_rank_outside_the_collective_is_the_one_the_others_wait_for() -> None:
    stuck = RankView(1, span="megatron.data.get_batch", iteration=1204, since_s=312.4,
                     frame="data.py:88 next_batch")  # fmt: skip
    assert judge([_waiting(0), stuck, _waiting(2), _waiting(3)]) == (
        "ranks 0,2,3: in megatron.grad_sync.finish (iteration 1204), waiting in a collective;"
        " rank 1: in megatron.data.get_batch (iteration 1204) for 312 s, at data.py:88"
        " next_batch \N{EM DASH} the rank the others wait for"
    )


def test_when_every_rank_waits_the_ranks_behind_are_named() -> None:
    assert judge([_waiting(0), _waiting(1, 1203)]) == (
        "rank 0: in megatron.grad_sync.finish (iteration 1204), waiting in a collective;"
        " rank 1: in megatron.grad_sync.finish (iteration 1203), waiting in a collective"
        " \N{EM DASH} behind the others"
    )


def test_stacks_alone_group_by_frame_and_say_when_no_rank_stands_out() -> None:
    views = [RankView(r, frame="train.py:10 step") for r in range(3)]
    assert judge(views) == "ranks 0,1,2: at train.py:10 step; no rank stands out"
    unread = RankView(3, error="py-spy: Permission denied")
    assert judge([*views, unread]).startswith("ranks 0,1,2: at train.py:10 step; rank 3: stacks")


def _step(**fields: object) -> ProgressRecord | None:
    """A training record, read from its line of progress.jsonl as the follower reads it."""
    return read_progress_record(json.dumps(fields))


def _watchdog(value: str) -> hang.Watchdog:
    launch = LaunchSettings(hang_timeout=value)
    plan = SimpleNamespace(settings=SimpleNamespace(launch=launch), run_dir=Path("/nonexistent"))
    return hang.Watchdog(plan, started=0.0)


@pytest.mark.parametrize(("median_s", "bound"), [(100.0, 1000.0), (1.0, hang.AUTO_MIN_S)])
def test_auto_is_ten_median_iterations_with_a_floor_once_five_have_run(median_s, bound) -> None:
    w = _watchdog("auto")
    assert w.timeout_s() == hang.AUTO_STARTUP_S  # start-up: nothing has iterated
    for it in range(1, 4):
        w.record(_step(iteration=it, loss=1.0, time=it * median_s))
    assert w.timeout_s() == hang.AUTO_MIN_S  # iterating, not yet 5 iterations: the floor
    for it in range(4, 8):
        w.record(_step(iteration=it, loss=1.0, time=it * median_s))
    assert w.timeout_s() == bound
    w.attempt_started(1, 0.0)  # a restart: start-up again
    assert w.timeout_s() == hang.AUTO_STARTUP_S


def test_a_number_of_seconds_holds_after_a_longer_start_up_and_off_watches_nothing() -> None:
    w = _watchdog("10")
    assert w.timeout_s() == hang.STARTUP_MIN_S
    w.record(_step(iteration=1, loss=1.0, time=1.0))
    assert w.timeout_s() == 10.0
    off = _watchdog("off")
    assert off.enabled is False and off.check(torchrun_pid=1, now=1e12) is None


def test_status_merges_every_nodes_report_and_judges_over_all_ranks(tmp_path: Path) -> None:
    def node(n: int, views: list[RankView], at: float) -> HangReport:
        return HangReport(detected_at=at, node=n, attempt=2, timeout_s=10, silent_s=11,
                          source="x", action="stop", verdict=judge(views), ranks=views)  # fmt: skip

    stuck = RankView(3, span="megatron.data.get_batch", iteration=9, frame="d.py:1 f")
    (tmp_path / "hang").mkdir()
    write_report(tmp_path, node(0, [_waiting(0, 9), _waiting(1, 9)], 100.0))
    write_report(tmp_path, node(1, [_waiting(2, 9), stuck], 101.0))
    st = hang_status(tmp_path)
    assert st is not None and st["detected_at"] == 100.0 and st["attempt"] == 2
    assert [r["rank"] for r in st["ranks"]] == [0, 1, 2, 3]
    assert set(st["ranks"][0]) == {"rank", "span", "iteration", "frame"}
    assert st["verdict"].startswith("ranks 0,1,2: in megatron.grad_sync.finish (iteration 9)")
    assert st["verdict"].endswith("rank 3: in megatron.data.get_batch (iteration 9), at d.py:1"
                                  " f \N{EM DASH} the rank the others wait for")  # fmt: skip
    merged = json.loads((tmp_path / "hang" / "report.json").read_text())
    assert merged["verdict"] == st["verdict"] and merged["nodes"] == [0, 1]
    assert hang_status(tmp_path, since=200.0) is None  # an earlier launch's hang


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hang-timeout", "soon"], "--hang-timeout: 'soon' is not a hang timeout"),
        (["--hang-timeout", "0"], "--hang-timeout: '0' is not a hang timeout"),
        (["--on-hang", "kill"], "--on-hang: "),
    ],
)
def test_bad_hang_values_exit_2_with_one_line_and_start_nothing(
    tmp_path: Path, args: list[str], message: str
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mlaunch", "train", "--run-dir", str(tmp_path / "run"), *args],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr + out.stdout and "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()


def test_a_bad_config_value_names_the_file_key(tmp_path: Path) -> None:
    cfg = tmp_path / "h.toml"
    cfg.write_text('[launch]\nhang_timeout = "soon"\n')
    out = subprocess.run(
        [sys.executable, "-m", "mlaunch", "train", "--dry-run", "--config", str(cfg)],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert f"{cfg} [launch] hang_timeout: 'soon' is not a hang timeout" in out.stderr + out.stdout


def test_a_stopped_rank_waits_for_nothing_it_is_the_one_the_others_wait_for() -> None:
    stopped = RankView(1, frame="c10d.py:3245 all_reduce", in_collective=True, process="stopped")
    assert judge([_waiting(0), stopped]) == (
        "rank 0: in megatron.grad_sync.finish (iteration 1204), waiting in a collective;"
        " rank 1: stopped, at c10d.py:3245 all_reduce \N{EM DASH} the rank the others wait for"
    )


@pytest.mark.parametrize("device", ["auto", "cuda", "cpu"])
def test_jobs_that_may_use_nccl_get_its_flight_recorder_and_the_users_values_win(
    tmp_path: Path, device: str
) -> None:
    from mlaunch.launcher.worker_env import worker_environment
    from mlaunch.settings import load_settings

    settings = load_settings(flags={"launch.device": device}, environ={})
    user = {ec.NCCL_TRACE_BUFFER_SIZE: "50"}
    env, _, _ = worker_environment(settings, "r1", tmp_path, user)
    nccl = {k: v for k, v in env.items() if k.startswith("TORCH_NCCL_")}
    if device == "cpu":
        assert nccl == {}  # gloo: there is no NCCL flight recorder
        return
    assert nccl == {  # the user's buffer size is theirs: not in what mlaunch sets
        ec.NCCL_DUMP_ON_TIMEOUT: "1",
        ec.NCCL_DEBUG_INFO_TEMP_FILE: str(tmp_path / "hang" / "nccl-trace-rank"),
        ec.NCCL_DEBUG_INFO_PIPE_FILE: str(tmp_path / "hang" / "nccl-pipe-rank"),
    }
    env, _, _ = worker_environment(settings, "r1", tmp_path, {})
    assert env[ec.NCCL_TRACE_BUFFER_SIZE] == "2000"
