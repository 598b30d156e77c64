"""A run directory has one owner at a time, and a checkpoint is resumed only
with the layout that saved it. Both are refused before anything starts (exit 2, one line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from mlaunch.launcher import checkpoint_layout
from mlaunch.launcher import plan as lp
from mlaunch.rundir import layout as lay

ROOT = Path(__file__).resolve().parents[2]
CLEAN = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MEGATRON_OTEL_"))}
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_checkpoint_file_names_are_the_trainers() -> None:
    from mlaunch.trainer import checkpoint

    assert checkpoint_layout.CHECKPOINT_TRACKER_FILE == checkpoint.TRACKER_FILE
    assert checkpoint_layout.CHECKPOINT_MANIFEST_FILE == checkpoint.MANIFEST_FILE


def test_a_second_launch_on_a_busy_run_dir_is_refused_and_touches_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run dir"
    # The first launcher: a real process holding the lock the way `mlaunch train` does.
    holder = subprocess.Popen(
        [
            sys.executable, "-c",
            textwrap.dedent(f"""
                import sys, time
                from pathlib import Path
                from mlaunch.launcher import plan as lp, run
                p = lp.build_plan(flags={{"launch.run_dir": {str(run_dir)!r}}},
                                  environ={{"PATH": "/usr/bin"}}, cwd=Path({str(tmp_path)!r}))
                run.lock_run_dir(p)
                print("locked", flush=True)
                time.sleep(60)
            """),
        ],
        env=_env(), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        before = sorted(p.name for p in run_dir.iterdir())
        out = subprocess.run(
            [sys.executable, "-m", "mlaunch", "train", "--run-dir", str(run_dir)],
            env=_env(), capture_output=True, text=True, timeout=60, cwd=tmp_path,
        )  # fmt: skip
        assert out.returncode == 2, out.stderr
        line = out.stderr.strip()
        assert "\n" not in line and "Traceback" not in line
        assert line.startswith("--run-dir: ") and str(run_dir) in line
        assert f"pid {holder.pid}" in line and "host " in line
        assert sorted(p.name for p in run_dir.iterdir()) == before  # no resolved.json, no logs
    finally:
        holder.kill()
        holder.wait()
    # The holder died (SIGKILL): its lock died with it; nothing stale is left to clear.
    p = lp.build_plan(flags={"launch.run_dir": str(run_dir)}, environ=CLEAN, cwd=tmp_path)
    from mlaunch.launcher import run

    os.close(run.lock_run_dir(p))


def test_each_node_of_one_run_has_its_own_lock(tmp_path: Path) -> None:
    from mlaunch.launcher import run

    flags = {
        "launch.run_dir": str(tmp_path / "r"), "launch.nnodes": 2, "launch.rdzv_id": "j",
        "launch.rdzv_endpoint": "h:29500",
    }  # fmt: skip
    plans = [
        lp.build_plan(flags={**flags, "launch.node_rank": n}, environ=CLEAN, cwd=tmp_path)
        for n in (0, 1)
    ]
    fds = [run.lock_run_dir(p) for p in plans]  # both nodes share the directory legitimately
    assert lay.run_lock_file(plans[1].run_dir, 1).exists()
    for fd in fds:
        os.close(fd)


def _checkpoint(root: Path, pp: int, iteration: int = 10) -> None:
    d = root / f"iter_{iteration:07d}"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(
        json.dumps({"iteration": iteration, "format": "torch", "pipeline_stages": pp, "files": []})
    )
    (root / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")


def test_resuming_with_another_pipeline_size_is_refused_before_launch(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _checkpoint(run_dir / lay.CHECKPOINTS_DIR, pp=1)
    out = subprocess.run(
        [sys.executable, "-m", "mlaunch", "train", "--config", "pp2", "--run-dir", str(run_dir),
         "--save-interval", "5"],
        env=_env(), capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    msg = out.stderr.strip()
    assert "Traceback" not in msg and "--run-dir" in msg
    assert "--pipeline-model-parallel-size 1 (now 2)" in msg and "new --run-dir" in msg
    assert not (run_dir / lay.RESOLVED_JSON_FILE).exists()


def test_model_shape_from_the_saving_runs_resolved_json(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _checkpoint(run_dir / lay.CHECKPOINTS_DIR, pp=1)
    first = lp.build_plan(
        flags={"launch.run_dir": str(run_dir), "model.num_layers": 2}, environ=CLEAN, cwd=tmp_path
    )
    (run_dir / lay.RESOLVED_JSON_FILE).write_text(first.resolved_json_text())
    same = {"launch.run_dir": str(run_dir), "training.save_interval": 5, "model.num_layers": 2}
    lp.build_plan(flags=same, environ=CLEAN, cwd=tmp_path)  # the same layout resumes
    try:
        lp.build_plan(flags={**same, "model.num_layers": 4}, environ=CLEAN, cwd=tmp_path)
    except lp.SettingsError as exc:
        assert "--num-layers 2 (now 4)" in str(exc.problems)
    else:
        raise AssertionError("a different model shape was not refused")
    # An explicit --save elsewhere is a fresh start: nothing to compare.
    lp.build_plan(
        flags={**same, "model.num_layers": 4, "training.save": str(tmp_path / "new")},
        environ=CLEAN, cwd=tmp_path,
    )  # fmt: skip
