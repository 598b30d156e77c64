"""``mlaunch trace`` on a real ``mlaunch train`` run (two ranks and the launcher's job trace),
read the way a user reads it: through a real pipe into ``head``, and as text."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from support.launch_runs import clean_env, finish, mlaunch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean 2-rank run with every span group (a Chrome trace of about a MB: far more than a
    pipe holds) and no restart."""
    tmp = tmp_path_factory.mktemp("trace-cli")
    run = tmp / "run"
    proc = mlaunch(
        "--run-dir", str(run), "--train-iters", "150", "--eval-interval", "0", "--otel-enabled",
        "--otel-export-strategy", "all_ranks", "--otel-span-groups", "all",
        cwd=tmp, env=clean_env(),
    )  # fmt: skip
    code, out = finish(proc)
    assert code == 0, out
    assert (run / "telemetry" / "traces-launcher-node0.jsonl").is_file()
    return run


def _trace(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlaunch", "trace", *map(str, args)], capture_output=True,
        text=True, timeout=120, env=clean_env(COLUMNS="200"),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("fmt", "head"),
    [("chrome", "head"), ("otlp-json", "head -c 4096")],  # OTLP lines are long
)
def test_export_into_head_stops_quietly_as_cat_does(run_dir: Path, fmt: str, head: str) -> None:
    # `| head` closes the pipe while the export still writes: that is the reader done, not a
    # failure. It printed "error: --output -: cannot write: Broken pipe".
    export = [
        sys.executable,
        "-m",
        "mlaunch",
        "trace",
        "export",
        str(run_dir),
        "-f",
        fmt,
        "-o",
        "-",
    ]
    whole = _trace("export", run_dir, "-f", fmt, "-o", "-")
    assert len(whole.stdout) > 8 * 65536  # 8 pipes' worth: still writing when head exits
    # Without head, the closing line is on standard error: standard output holds the trace only.
    assert whole.stderr.startswith(f"wrote standard output ({fmt}): ")
    script = f'{shlex.join(export)} | {head}; echo "status ${{PIPESTATUS[0]}}" >&2'
    r = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=120, env=clean_env()
    )
    taken = subprocess.run(shlex.split(head), input=whole.stdout, capture_output=True, text=True)
    assert r.stdout == taken.stdout  # what head took of the whole export
    # As `cat` killed by SIGPIPE: no word, and the status a shell reports for it (128 + 13).
    assert r.stderr == "status 141\n", r.stderr


def test_export_counts_the_launcher_apart_from_the_ranks(run_dir: Path, tmp_path: Path) -> None:
    r = _trace("export", run_dir, "-o", tmp_path / "t.json")
    assert r.returncode == 0, r.stderr
    # It said "3 ranks": the launcher's job trace is a process of the export, but no rank.
    assert " spans, 2 ranks and the launcher, " in r.stdout, r.stdout


def test_goodput_of_a_run_that_never_restarted_says_startup(run_dir: Path) -> None:
    r = _trace("goodput", run_dir)
    assert r.returncode == 0, r.stderr
    header = next(ln for ln in r.stdout.splitlines() if ln.split()[:2] == ["rank", "host"])
    assert header.split() == [
        "rank", "host", "goodput", "wall", "productive", "startup", "ckpt", "eval", "unacct"
    ]  # fmt: skip
    (cost,) = [ln for ln in r.stdout.splitlines() if ln.startswith("start-up cost (all ranks): ")]
    assert "model_init " in cost, cost
    assert "restart" not in r.stdout
