"""Live capture in workers launched by ``mlaunch train --script`` (mlaunch/lens_hook): the real
nemo-lens worker (0.1.0 and 0.2.0) switched to ``all`` for a time window and back, and a worker
without nemo-lens (it traces through ``mlaunch.telemetry``) that the hook leaves alone.

Two ranks under real torchrun; the live request comes from the real ``mlaunch trace capture``
command, other requests are written from the test with the keys the command writes. Each worker loops until the test's stop
file exists, so how long the run lasts never depends on the machine's load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.launch_runs import clean_env, finish, mlaunch, progress, status

from mlaunch.launcher.capture import lens_capture_ranks
from mlaunch.lens_hook import SITE_DIR, START_LEAD_S
from mlaunch.lens_hook.capture import LOG_PREFIX, THREAD_NAME
from mlaunch.model.groups import SpanGroup
from mlaunch.model.spans import CATALOGUE, SpanName
from mlaunch.model.spec import resolve
from mlaunch.otlp.otlp_json import read_spans
from mlaunch.rundir import layout as lay

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "telemetry_script.py"
#: The span names of the groups only a capture turns on here (the run traces ``per_step``).
FINE = {d.name for d in CATALOGUE if d.group in (SpanGroup.LAYER, SpanGroup.MICROBATCH)}


def wait_for(predicate, what: str, timeout: float = 120.0) -> None:
    """Poll ``predicate`` until true (a hang fails with ``what``)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not there yet, or being replaced
        return None


def _rank_stderr(run_dir: Path, rank: int) -> str:
    """What a rank wrote on stderr (torchrun's per-rank log; one node: local rank = rank)."""
    logs = sorted(run_dir.glob(f"{lay.LOGS_DIR}/*/*/attempt_0/{rank}/stderr.log"))
    return "".join(p.read_text(errors="replace") for p in logs)


def _write_request(run_dir: Path, text: str) -> None:
    path = run_dir / lay.CAPTURE_REQUEST_FILE
    tmp = path.with_name(".request.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # as mlaunch trace capture writes it


def _live_request(run_dir: Path, rid: str, *, groups: str, start_in_s: float, seconds: float):
    now = time.time_ns()
    body = {
        "id": rid,
        "created_ns": now,
        "run_id": json.loads((run_dir / lay.RESOLVED_JSON_FILE).read_text())["run_id"],
        "ranks": None,
        "groups": groups,
        "seconds": seconds,
        "start_ns": now + int(start_in_s * 1e9),
    }
    _write_request(run_dir, json.dumps(body))
    return body


@pytest.mark.nemo_lens
def test_a_nemo_lens_worker_is_switched_to_all_for_a_time_window_and_back(
    lens_worker_script, tmp_path
):
    run_dir, stop = tmp_path / "run", tmp_path / "stop"
    proc = mlaunch(
        "--script", str(lens_worker_script), "--nproc-per-node", "2", "--device", "cpu",
        "--train-iters", "2", "--eval-interval", "0", "--run-dir", str(run_dir),
        "--otel-enabled", "--otel-span-groups", "per_step",
        # rank 1 exports; rank 0 has no-op providers and cannot capture
        "--otel-export-strategy", "single_rank",
        cwd=tmp_path,
        env=clean_env(LENS_WORKER_ITER_SECONDS="0.02", LENS_WORKER_STOP_FILE=str(stop)),
    )  # fmt: skip
    reports = [run_dir / f"lens-worker-rank{r}.json" for r in range(2)]
    try:
        wait_for(
            lambda: (
                all((_read_json(p) or {}).get("iteration", 0) >= 2 for p in reports)
                or proc.poll() is not None
            ),
            "both workers in their loop",
        )
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        # A bad file first: logged once on each rank, and the next request still applies.
        _write_request(run_dir, "{not json")
        wait_for(
            lambda: all(f"{LOG_PREFIX}ignoring" in _rank_stderr(run_dir, r) for r in range(2)),
            "the bad file logged by both ranks",
        )
        # The real command, as a user would type it in a second terminal.
        cmd = subprocess.run(
            [sys.executable, "-m", "mlaunch", "trace", "capture", str(run_dir),
             "--groups", "all", "--seconds", "1.5", "--wait", "--json"],
            capture_output=True, text=True, timeout=120, env=clean_env(), cwd=tmp_path,
        )  # fmt: skip
        assert cmd.returncode == 0, cmd.stdout + cmd.stderr
        told = json.loads(cmd.stdout)
        assert told["nemo_lens"]["ranks"] == [1]
        assert "built no exporter" in told["nemo_lens"]["cannot"]["0"]
        assert told["complete"] is True and told["outcome"]["1"]["state"] == "done", told
        request = _read_json(run_dir / lay.CAPTURE_REQUEST_FILE)
        assert request["start_ns"] - request["created_ns"] == int(START_LEAD_S * 1e9)
        rid = told["id"]
        acks = [lay.lens_capture_ack_file(run_dir, r, rid) for r in range(2)]
        wait_for(lambda: _read_json(acks[0]) is not None, "rank 0's refusal")
    finally:
        stop.touch()  # a few more iterations, all after the window, then the end
    code, out = finish(proc)
    assert code == 0, out[-4000:]

    refused, ack = _read_json(acks[0]), _read_json(acks[1])
    assert refused["applied"] is False and "no exporter" in refused["reason"], refused
    assert ack["applied"] is True and ack["reason"] is None, ack
    per_step = sorted(g.value for g in resolve("per_step"))
    assert ack["previous"] == per_step
    assert ack["groups"] == sorted(g.value for g in resolve("all"))
    assert (ack["start_ns"], ack["end_ns"]) == (
        request["start_ns"],
        request["start_ns"] + int(request["seconds"] * 1e9),
    )
    applied, ended = ack["applied_ns"], ack["ended_ns"]
    ranks, why = lens_capture_ranks(run_dir)  # what the command will say
    assert ranks == [1] and set(why) == {0}
    # The run model has the same capture life for nemo-lens workers: done (rank 1 captured,
    # rank 0 refused), a time window, so no iterations.
    (capture,) = status(run_dir)["captures"]
    assert capture == {"id": rid, "phase": "done", "groups": "all", "iterations": None,
                       "ranks": None}  # fmt: skip

    for r in range(2):
        report = _read_json(reports[r])
        assert report["finished"] is True and "error" not in report, report
        assert _rank_stderr(run_dir, r).count(LOG_PREFIX) == 1  # the bad file, once
    spans = read_spans(lay.traces_file(run_dir, 1))
    assert not lay.traces_file(run_dir, 0).exists()
    fine = [s for s in spans if s["name"] in FINE]
    steps = [s for s in spans if s["name"] == SpanName.ITERATION]
    # Fine spans only inside the window, and some of them: layer and microbatch alike.
    assert {s["name"] for s in fine} == FINE
    outside = [s for s in fine if not applied <= s["start_ns"] <= ended]
    assert not outside, outside[:3]
    # The run's own spans before, during and after it (the captured ones nest under them).
    assert any(s["start_ns"] < applied for s in steps)
    assert any(s["start_ns"] > ended for s in steps)
    forward_backward = {s["span_id"] for s in spans if s["name"] == SpanName.FORWARD_BACKWARD}
    microbatches = [s for s in fine if s["name"].startswith("megatron.microbatch.")]
    assert all(s["parent_span_id"] in forward_backward for s in microbatches)


def test_a_worker_without_nemo_lens_keeps_training_through_bad_and_live_requests(tmp_path):
    # Traces through mlaunch.telemetry: the hook is there, reads the file, touches nothing.
    run_dir, stop, user = tmp_path / "run", tmp_path / "stop", tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n")
    proc = mlaunch(
        "--script", str(SCRIPT), "--nproc-per-node", "2", "--device", "cpu",
        "--run-dir", str(run_dir), "--otel-enabled", "--otel-export-strategy", "all_ranks",
        cwd=tmp_path, env=clean_env(SCRIPT_STOP_FILE=str(stop), PYTHONPATH=str(user)),
    )  # fmt: skip
    try:
        wait_for(lambda: len(progress(run_dir)) >= 3 or proc.poll() is not None, "iterations")
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        _write_request(run_dir, '["not", "a", "request"]')
        wait_for(
            lambda: all(f"{LOG_PREFIX}ignoring" in _rank_stderr(run_dir, r) for r in range(2)),
            "the bad file logged by both ranks",
        )
        _live_request(run_dir, "live2", groups="all", start_in_s=0, seconds=1)
        # 40 iterations of 50 ms sleep: two seconds at least, so every watcher has read it.
        seen = len(progress(run_dir))
        wait_for(lambda: len(progress(run_dir)) >= seen + 40, "training going on")
    finally:
        stop.touch()
    code, out = finish(proc)
    assert code == 0, out[-4000:]
    for r in range(2):
        report = json.loads((run_dir / f"script-worker-rank{r}.json").read_text())
        assert report["sitecustomize"] == str(SITE_DIR / "sitecustomize.py")
        assert report["user_sitecustomize"] == "ran"  # the one it shadows still ran
        assert THREAD_NAME in report["threads"] and report["nemo_lens"] is False
        if r == 0:  # progress.jsonl is rank 0's (the ranks share no collective here)
            assert report["iterations"] >= seen + 40
        assert _rank_stderr(run_dir, r).count(LOG_PREFIX) == 1
        assert not lay.lens_capture_ack_file(run_dir, r, "live2").exists()
