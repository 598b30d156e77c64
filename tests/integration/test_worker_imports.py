"""Workers import the installed mlaunch whatever the directory a job starts in holds, and a rank
whose telemetry setup fails is named by the launcher (console, closing lines, ``mlaunch status``
and its ``--json``), not only in that rank's log. Real torchrun runs.

The launcher runs as ``python -P -m mlaunch``: what the ``mlaunch`` console script does (its own
folder first on sys.path, never the current directory), so only the workers meet the folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.launch_runs import clean_env, finish, status, status_text

from mlaunch.otlp.otlp_json import read_spans

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def launch(*args: str, cwd: Path, **env: str) -> tuple[int, str]:
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "mlaunch", "train", *args],
        cwd=cwd, env=clean_env(COLUMNS="200", **env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    return finish(proc)


def shadow(folder: Path, kind: str = "old copy") -> None:
    """A folder named ``mlaunch`` that is not the installed package: an old copy (a package with
    no ``__version__``: it shadows whatever the install is), or a clone (its root holds the
    package one level down: Python imports the root as a namespace package, which shadows an
    editable install)."""
    if kind == "clone":
        (folder / "mlaunch" / "mlaunch").mkdir(parents=True)
        (folder / "mlaunch" / "mlaunch" / "__init__.py").write_text('__version__ = "0.0.1"\n')
        (folder / "mlaunch" / "pyproject.toml").write_text('[project]\nname = "mlaunch"\n')
        return
    (folder / "mlaunch").mkdir()
    (folder / "mlaunch" / "__init__.py").write_text('"""an old copy of mlaunch"""\n')


@pytest.mark.parametrize("kind", ["old copy", "clone"])
def test_trainer_workers_import_the_installed_mlaunch_beside_a_folder_named_mlaunch(tmp_path, kind):
    shadow(tmp_path, kind)
    run_dir = tmp_path / "run"
    code, out = launch("--run-dir", str(run_dir), "--train-iters", "2", cwd=tmp_path)
    assert code == 0, out
    assert "telemetry off" not in out, out
    for rank in (0, 1):
        spans = read_spans(run_dir / "telemetry" / f"traces-rank{rank}.jsonl")
        assert any(s["name"] == "megatron.train.iteration" for s in spans), rank
    logs = "".join(p.read_text() for p in (run_dir / "logs").rglob("stderr.log"))
    assert "setup failed" not in logs


SCRIPT = """
import os, sys, time
import helper  # the script's own directory is on sys.path, as with `python script.py`
from mlaunch import telemetry
from mlaunch.model.groups import SpanGroup as G
from mlaunch.model.spans import SpanName as S

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
# BAD_RANK passes its save interval as the text of its command line (a slip only that worker's
# code makes): its telemetry setup fails, the job goes on.
save = "10" if str(rank) == os.environ.get("BAD_RANK") else 10
with telemetry.setup(rank=rank, world_size=world, save_interval=save):
    for i in (1, 2, 3):
        telemetry.set_iteration(i)
        with telemetry.span(G.STEP, S.ITERATION):
            time.sleep(0.3)
print("helper", helper.VALUE)
"""


def script_run(tmp_path: Path, **env: str) -> tuple[int, str, Path]:
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "helper.py").write_text("VALUE = 42\n")
    run_dir = tmp_path / "run"
    code, out = launch(
        "--script", "train.py", "--no-megatron-args", "--run-dir", str(run_dir),
        cwd=tmp_path, **env,
    )  # fmt: skip
    return code, out, run_dir


def test_a_script_beside_a_folder_named_mlaunch_traces_and_still_sees_its_directory(tmp_path):
    shadow(tmp_path)
    code, out, run_dir = script_run(tmp_path)
    assert code == 0, out
    assert "telemetry off" not in out, out
    for rank in (0, 1):
        spans = read_spans(run_dir / "telemetry" / f"traces-rank{rank}.jsonl")
        assert any(s["name"] == "megatron.train.iteration" for s in spans), rank
        stdout = next((run_dir / "logs").rglob(f"attempt_0/{rank}/stdout.log")).read_text()
        assert "helper 42" in stdout


def test_a_rank_whose_telemetry_setup_fails_is_named_on_the_console_and_in_status(tmp_path):
    code, out, run_dir = script_run(tmp_path, BAD_RANK="1")
    assert code == 0, out
    reason = "setup failed (TypeError: '>' not supported between instances of 'str' and 'int')"
    # On the console while the run goes on, and again in the closing lines.
    assert out.count(f"telemetry off on rank 1: {reason}") == 2, out
    assert "telemetry off on rank 0" not in out
    st = status(run_dir)
    assert st["telemetry_off"] == [{"rank": 1, "reason": reason}], st
    assert f"telemetry: off on rank 1: {reason}" in status_text(run_dir)
    # The rank that set up fine traced; the failed one wrote nothing.
    assert (run_dir / "telemetry" / "traces-rank0.jsonl").exists()
    assert not (run_dir / "telemetry" / "traces-rank1.jsonl").exists()
