"""The command that resumes a run (``resolved.json``'s ``launched_as`` ->
:func:`mlaunch.launcher.run_status.resume_command`): the launch as given, secrets as a marker,
``--run-dir`` where the run directory is when it is read. (A real run resumed with the printed
command: tests/integration/test_launch_runs.py's SIGTERM test.)"""

from __future__ import annotations

import json
from pathlib import Path

from mlaunch.launcher.plan import launched_as
from mlaunch.launcher.run_status import resumable_text, resume_command


def _run_dir(tmp_path: Path, argv: list[str]) -> Path:
    run = tmp_path / "copied here"
    run.mkdir()
    body = {"launched_as": launched_as(argv, Path("/home/me/proj"))}
    (run / "resolved.json").write_text(json.dumps(body))
    return run


def test_the_launch_as_given_into_the_run_directory_where_it_is_now(tmp_path):
    argv = [
        "--script", "train.py", "--run-dir", "runs/old", "--otlp-headers", "authorization=Bearer s3cret",
        "--run-dir=runs/older", "--nproc-per-node", "2", "--", "--lr", "0.1", "--run-dir", "x",
    ]  # fmt: skip
    run = _run_dir(tmp_path, argv)
    assert "s3cret" not in (run / "resolved.json").read_text()
    command = resume_command(run, None)
    assert command == (
        "cd /home/me/proj && mlaunch train --script train.py '--otlp-headers=<redacted>'"
        f" --nproc-per-node 2 --run-dir '{run}' -- --lr 0.1 --run-dir x"
    )
    text = resumable_text(run, None)
    assert text.splitlines()[1] == f"resume:   {command}"


def test_a_slurm_job_is_requeued_and_an_older_run_has_no_command(tmp_path):
    assert resume_command(tmp_path, "4242") == "scontrol requeue 4242"
    assert resume_command(tmp_path, None) is None  # no launched_as: an earlier mlaunch's run
    assert "\n" not in resumable_text(tmp_path, None)
