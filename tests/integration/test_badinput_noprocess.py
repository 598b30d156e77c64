"""Bad input to the real ``mlaunch train`` process starts no process and creates nothing.

The in-process corpus (``tests/unit/test_badinput_corpus.py``) patches the spawn function; this
proves the same end to end with a handful of subprocess runs. A fake ``torch`` package first on
``PYTHONPATH`` records, in a marker directory, any import of ``torch`` and any start of
``torch.distributed.run``: bad input must leave no marker, no ``runs/`` and exit 2 with no
traceback. A good input, run the same way, leaves the "started" marker: the detector works.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.peers import Listener

#: The fake torch: importing it, or running its torch.distributed.run, drops a marker file.
FAKE_INIT = """\
import os, pathlib
pathlib.Path(os.environ["BADINPUT_MARKERS"], "imported-torch").touch()
"""
FAKE_RUN = """\
import os, pathlib
pathlib.Path(os.environ["BADINPUT_MARKERS"], "started-torchrun").touch()
"""


@pytest.fixture
def sandbox(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A working directory, a fake torch on PYTHONPATH, and a clean environment."""
    fake = tmp_path / "fake"
    (fake / "torch" / "distributed").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text(FAKE_INIT)
    (fake / "torch" / "distributed" / "__init__.py").write_text("")
    (fake / "torch" / "distributed" / "run.py").write_text(FAKE_RUN)
    markers = tmp_path / "markers"
    markers.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    (work / "afile").write_text("a regular file\n")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_", "SLURM_", "MLAUNCH_"))
    }
    repo = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(fake), str(repo)])
    env["BADINPUT_MARKERS"] = str(markers)
    return work, env


def mlaunch(work: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m mlaunch ARGS`` in ``work``."""
    return subprocess.run(
        [sys.executable, "-m", "mlaunch", *args],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "extra_env", "named"),
    [
        pytest.param(("--train-iters", "0"), {}, "--train-iters", id="train-iters=0"),
        pytest.param(
            ("--otel-span-groups", "per_stepp"), {}, "--otel-span-groups", id="span-groups=typo"
        ),
        pytest.param(
            (), {"MEGATRON_OTEL_ENABLED": "maybe"}, "MEGATRON_OTEL_ENABLED", id="env-bool"
        ),
        pytest.param(("--run-dir", "afile/run"), {}, "--run-dir", id="run-dir=under-a-file"),
        pytest.param(("--", "--bogus"), {}, "-- ARGS", id="passthrough=unknown-arg"),
        pytest.param(
            # .invalid never resolves (RFC 2606): torchrun would retry it for two minutes.
            (
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-id",
                "j",
                "--rdzv-endpoint",
                "badhost.invalid:29500",
            ),
            {},
            "--rdzv-endpoint: the rendezvous host 'badhost.invalid' does not resolve",
            id="rdzv-endpoint=unresolvable",
        ),  # fmt: skip
    ],
)
def test_bad_input_starts_no_process_and_creates_nothing(
    sandbox: tuple[Path, dict[str, str]], args: tuple[str, ...], extra_env: dict, named: str
) -> None:
    work, env = sandbox
    result = mlaunch(work, {**env, **extra_env}, "train", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.startswith(named), result.stderr
    assert sorted(p.name for p in work.iterdir()) == ["afile"]  # no runs/, no run dir
    assert list(Path(env["BADINPUT_MARKERS"]).iterdir()) == []  # torch never imported or run


def test_a_rendezvous_port_another_program_holds_is_refused_on_node_0(
    sandbox: tuple[Path, dict[str, str]],
) -> None:
    work, env = sandbox
    with Listener() as busy:  # a real listening socket: torchrun would wait on it for minutes
        one = mlaunch(work, env, "train", "--rdzv-endpoint", f"127.0.0.1:{busy.port}")
        slurm = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "localhost,n2",
                 "MASTER_PORT": str(busy.port)}  # fmt: skip
        head = mlaunch(
            work, {**env, **slurm, "SLURM_NODEID": "0"}, "train", "--nproc-per-node", "1"
        )
    for result in (one, head):
        assert result.returncode == 2, result.stdout + result.stderr
        assert "Traceback" not in result.stdout + result.stderr
        assert f"port {busy.port} is in use on this host" in result.stderr
        assert f"held by pid {os.getpid()}" in result.stderr  # this test process holds it
        assert len(result.stderr.splitlines()) == 1
    assert one.stderr.startswith("--rdzv-endpoint: ")
    assert "pick another port in --rdzv-endpoint, or omit it" in one.stderr
    assert head.stderr.startswith("SLURM_JOB_NODELIST: ")  # where the endpoint came from
    assert "set MASTER_PORT to a free port" in head.stderr
    assert sorted(p.name for p in work.iterdir()) == ["afile"]
    assert list(Path(env["BADINPUT_MARKERS"]).iterdir()) == []


def test_other_nodes_do_not_check_the_rendezvous_port(sandbox: tuple[Path, dict[str, str]]) -> None:
    # Node 1 only connects: the port being taken on its own machine says nothing (node 0 may be
    # this machine too, its store already up), so the launch goes on.
    work, env = sandbox
    with Listener() as busy:
        result = mlaunch(
            work, env, "train", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1",
            "--rdzv-id", "n1", "--rdzv-endpoint", f"127.0.0.1:{busy.port}",
        )  # fmt: skip
    assert "started-torchrun" in [p.name for p in Path(env["BADINPUT_MARKERS"]).iterdir()], (
        result.stdout + result.stderr
    )


def test_the_detector_sees_a_real_start(sandbox: tuple[Path, dict[str, str]]) -> None:
    work, env = sandbox
    result = mlaunch(work, env, "train", "--train-iters", "1", "--otel-run-id", "ok")
    markers = sorted(p.name for p in Path(env["BADINPUT_MARKERS"]).iterdir())
    assert "started-torchrun" in markers, (markers, result.stdout, result.stderr)
    assert (work / "runs" / "ok").is_dir()
