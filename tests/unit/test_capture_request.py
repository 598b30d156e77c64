"""``mlaunch trace capture``'s request (no workers): the start iteration ahead of the furthest
rank by the lead, the world size from resolved.json, refusals that write nothing, and a capture
counted as running until every rank acknowledged its end."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from mlaunch.cli import build_app
from mlaunch.launcher import capture as cap
from mlaunch.rundir import layout as lay
from mlaunch.slurm.status import job_status


def make_run(tmp_path, *, enabled: bool = True, step_ms: float = 50.0, last: int = 40):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / lay.RESOLVED_JSON_FILE).write_text(
        json.dumps(
            {
                "run_id": "r1",
                "world_size": 2,
                "settings": {"telemetry.enabled": {"value": enabled, "source": "test"}},
            }
        )  # fmt: skip
    )
    with (run_dir / lay.PROGRESS_FILE).open("w") as f:
        for it in range(1, last + 1):
            f.write(json.dumps({"iteration": it, "train_iters": 10**6, "loss": 1.0,
                                "step_ms": step_ms}) + "\n")  # fmt: skip
    return run_dir


def target(run_dir, cwd):
    """``request_capture``'s first two arguments for ``run_dir``: its name and its status."""
    return str(run_dir), lambda: job_status(str(run_dir), cwd)


def ack(run_dir, rank: int, **body) -> None:
    path = lay.capture_ack_file(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": rank, "run_id": "r1", "started_ns": 1, **body}))


def test_start_is_ahead_of_the_furthest_rank_by_the_lead(tmp_path):
    run_dir = make_run(tmp_path, step_ms=50.0, last=40)
    for rank in (0, 1):
        ack(run_dir, rank, state="listening", exporting=rank == 1, world_size=2)
    req = cap.request_capture(
        *target(run_dir, tmp_path), recorded=False, ranks="all", groups="all", iterations=5
    )
    lead = max(cap.MIN_LEAD_ITERS, math.ceil(cap.LEAD_S / 0.05))
    assert req.start_iteration == 40 + lead + 1
    assert (req.expected_ranks, req.exporter_started) == ([0, 1], [0])
    body = json.loads((run_dir / lay.CAPTURE_REQUEST_FILE).read_text())
    assert {k: body[k] for k in ("id", "run_id", "groups", "iterations", "seconds")} == {
        "id": req.id, "run_id": "r1", "groups": "all", "iterations": 5, "seconds": None,
    }  # fmt: skip
    assert body["start_iteration"] == req.start_iteration and body["ranks"] is None


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"groups": "all", "iterations": 0}, "--iterations 0"),
        ({"groups": "all", "iterations": 2, "seconds": 1.0}, "exactly one"),
        ({"groups": "all"}, "exactly one"),
        ({"groups": "-all", "iterations": 2}, "names no group"),
        ({"groups": "lay", "iterations": 2}, "--groups"),
        ({"seconds": 2.0}, "--groups"),
        ({"groups": "all", "iterations": 2, "ranks": "2"}, "rank 2 is not in this run"),
        ({"groups": "all", "seconds": -1.0}, "--seconds"),
    ],
)
def test_bad_requests_are_refused_and_write_nothing(tmp_path, kwargs, needle):
    run_dir = make_run(tmp_path)
    ranks = kwargs.pop("ranks", "all")
    with pytest.raises(cap.CaptureInputError, match=needle):
        cap.request_capture(*target(run_dir, tmp_path), recorded=False, ranks=ranks, **kwargs)
    assert not (run_dir / lay.CAPTURE_REQUEST_FILE).exists()


def test_a_run_with_telemetry_off_is_refused(tmp_path):
    run_dir = make_run(tmp_path, enabled=False)
    with pytest.raises(cap.CaptureInputError, match="telemetry is off"):
        cap.request_capture(
            *target(run_dir, tmp_path), recorded=False, ranks="all", groups="all", iterations=2
        )
    assert not (run_dir / lay.CAPTURE_REQUEST_FILE).exists()


def test_a_capture_runs_until_every_listening_rank_acked_its_end(tmp_path):
    run_dir = make_run(tmp_path)
    for rank in (0, 1):
        ack(run_dir, rank, state="listening")
    first = cap.request_capture(
        *target(run_dir, tmp_path), recorded=False, ranks="all", groups="layer", iterations=3
    )
    request = (run_dir / lay.CAPTURE_REQUEST_FILE).read_bytes()
    ack(run_dir, 0, id=first.id, state="done")
    with pytest.raises(cap.CaptureInputError, match=f"capture {first.id} is still running"):
        cap.request_capture(
            *target(run_dir, tmp_path), recorded=True, ranks="all", groups="all", iterations=2
        )
    assert (run_dir / lay.CAPTURE_REQUEST_FILE).read_bytes() == request
    ack(run_dir, 1, id=first.id, state="missed")
    second = cap.request_capture(
        *target(run_dir, tmp_path), recorded=False, ranks="all", groups="all", iterations=2
    )
    assert second.id != first.id


def test_the_arguments_are_checked_before_the_target_is_looked_up():
    def no_lookup():
        raise AssertionError("the target was looked up before the window was checked")

    with pytest.raises(cap.CaptureInputError, match="exactly one"):
        cap.request_capture("nowhere", no_lookup, recorded=False, ranks="all", groups="all")


def test_an_unknown_target_is_refused_by_the_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(build_app("trace"), ["trace", "capture", "nowhere", "--recorded"])
    assert result.exit_code == 2
    assert "neither a run directory nor a SLURM job id" in result.output
