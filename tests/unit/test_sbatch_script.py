"""``mlaunch sbatch``'s script generation (no SLURM needed): every option, quoting of paths with
spaces (checked by running the script under bash with ``srun``/``scontrol`` stubs), secrets never
in the script, and validation before anything exists."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlaunch.settings import SettingsError
from mlaunch.slurm.batch import SbatchOptions, plan_job, render_script, time_limit_s

ROOT = Path(__file__).resolve().parents[2]
SECRET = "Authorization=Bearer s3cr3t-t0ken"
CLEAN = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_", "SLURM_", "MASTER_"))
}


def job(cwd: Path, flags=None, env=None, passthrough=(), **options):
    return plan_job(
        flags=flags or {"launch.nproc_per_node": "1", "training.train_iters": "20"},
        config=None, passthrough=list(passthrough), environ={**CLEAN, **(env or {})}, cwd=cwd,
        options=SbatchOptions(**options),
    )  # fmt: skip


def problems(cwd: Path, **kwargs) -> list[tuple[str, str]]:
    with pytest.raises(SettingsError) as exc:
        job(cwd, **kwargs)
    return exc.value.problems


def test_every_slurm_option_is_a_line_of_the_script(tmp_path):
    text = render_script(
        job(
            tmp_path, nodes=4, gpus_per_node=8, time="1-00:00:00", partition="gpu",
            account="acct", qos="high", sbatch_args=("--mail-type=END", "--comment=two words"),
            signal_grace_s=300, requeue=False, exclusive=False,
        )
    )  # fmt: skip
    directives = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=mlaunch-tiny",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=1-00:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=acct",
        "#SBATCH --qos=high",
        f"#SBATCH --chdir={tmp_path}",
        f"#SBATCH --output={tmp_path}/runs/%j/slurm-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --signal=B:USR1@300",
        "#SBATCH --no-requeue",
        "#SBATCH --mail-type=END",
        '#SBATCH --comment="two words"',
    ]
    assert "scontrol requeue" not in text
    defaults = render_script(job(tmp_path))
    assert "#SBATCH --exclusive" in defaults and "#SBATCH --requeue" in defaults
    assert "#SBATCH --signal=B:USR1@120" in defaults
    assert 'scontrol requeue "$SLURM_JOB_ID"' in defaults


def _run_script(script: str, tmp: Path, job_id: str = "42") -> tuple[list[str], str]:
    """Run ``script`` under bash with stubs for srun (records its argv) and scontrol."""
    stubs = tmp / "stub bin"
    stubs.mkdir()
    record = tmp / "srun-argv"
    (stubs / "srun").write_text(f'#!/bin/bash\nprintf "%s\\0" "$@" > "{record}"\n')
    (stubs / "scontrol").write_text("#!/bin/bash\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {**CLEAN, "PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_JOB_ID": job_id,
           "SLURM_CPUS_ON_NODE": "4"}  # fmt: skip
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return record.read_bytes().decode().split("\0")[:-1], out.stdout


def test_paths_with_spaces_survive_the_script(tmp_path):
    cwd = tmp_path / "my project"
    cwd.mkdir()
    data = cwd / "corpus dir"
    data.mkdir()
    (data / "a.txt").write_text("hello world " * 50)
    flags = {"launch.nproc_per_node": "1", "training.data_path": str(data)}
    j = job(cwd, flags=flags, passthrough=["--exit-interval", "1000"])
    script = render_script(j)
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    argv, _ = _run_script(script, tmp_path)
    assert argv[:5] == [
        "--nodes=1",
        "--ntasks-per-node=1",
        "--cpus-per-task=4",
        "--kill-on-bad-exit=0",
        "--wait=120",
    ]
    train = argv[5:]
    assert train[:4] == [sys.executable, "-m", "mlaunch", "train"]
    assert train[train.index("--data-path") + 1] == str(data)
    assert train[train.index("--run-dir") + 1] == f"{cwd}/runs/42"
    assert train[train.index("--config") + 1].endswith("configs/tiny.toml")
    assert train[-3:] == ["--", "--exit-interval", "1000"]
    assert f'--output="{cwd}/runs/%j/slurm-%j.out"' in script  # sbatch reads double quotes
    assert j.run_dir("42") == cwd / "runs" / "42"


def test_a_fixed_run_dir_with_spaces(tmp_path):
    run_dir = tmp_path / "run dir"
    j = job(tmp_path, flags={"launch.nproc_per_node": "1", "launch.run_dir": str(run_dir)})
    argv, _ = _run_script(render_script(j), tmp_path)
    assert argv[argv.index("--run-dir") + 1] == str(run_dir)
    assert j.run_dir("99") == run_dir


def test_secrets_are_inherited_never_written(tmp_path):
    env = {"OTEL_EXPORTER_OTLP_HEADERS": SECRET, "OTEL_EXPORTER_OTLP_TRACES_HEADERS": SECRET,
           "MEGATRON_OTEL_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}  # fmt: skip
    script = render_script(job(tmp_path, env=env))
    assert "s3cr3t" not in script and "Bearer" not in script
    assert "export OTEL_EXPORTER_OTLP_ENDPOINT=http://c:4317" in script
    for name in ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"):
        assert f': "${{{name}:?' in script  # the job checks it inherited the secret
    # Without the secret in the job's environment the script stops before srun, naming it.
    out = subprocess.run(["bash", "-c", script], env=CLEAN, capture_output=True, text=True)
    assert out.returncode != 0 and "OTEL_EXPORTER_OTLP_HEADERS" in out.stderr
    flagged = problems(tmp_path, flags={"telemetry.otel.headers": SECRET})
    assert [f for f, _ in flagged] == ["--otlp-headers"] and "s3cr3t" not in str(flagged)
    dropped = problems(tmp_path, env=env, sbatch_args=("--export=NONE",))
    assert dropped[0][0] == "--sbatch-arg" and "OTEL_EXPORTER_OTLP_HEADERS" in dropped[0][1]
    render_script(job(tmp_path, env=env, sbatch_args=("--export=ALL,FOO=1",)))  # keeps them


def test_settings_are_frozen_and_slurm_decides_the_nodes(tmp_path):
    j = job(tmp_path, flags={"launch.nproc_per_node": "1", "model.untie_embeddings": "true",
                             "telemetry.span_groups": "all"}, nodes=2)  # fmt: skip
    script = render_script(j)
    assert "--untie-embeddings" in j.train_args and "--nnodes" not in script
    assert "export MEGATRON_OTEL_SPAN_GROUPS=all" in script  # telemetry: the worker env
    assert "export MEGATRON_OTEL_RUN_ID" not in script and "export MLAUNCH_RUN_DIR" not in script
    # a free port asked of the first node at job start, not one derived from the job id
    # (which collided when job ids repeat); a MASTER_PORT the user exported wins
    port_line = next(ln for ln in script.splitlines() if ln.startswith("export MASTER_PORT="))
    assert port_line.startswith("export MASTER_PORT=${MASTER_PORT:-$(") and "SLURM_JOB_ID" not in (
        port_line
    )
    for env in ({}, {"MASTER_PORT": "7777"}):
        out = subprocess.run(
            ["bash", "-c", f"{port_line}; echo $MASTER_PORT"],
            text=True,
            capture_output=True,
            env={**{k: v for k, v in os.environ.items() if k != "MASTER_PORT"}, **env},
            check=True,
        ).stdout
        assert int(out) == 7777 if env else 1024 <= int(out) <= 65535
    # With requeue and no save interval, one is chosen (and said) so a requeue can resume.
    assert j.train_args[j.train_args.index("--save-interval") + 1] == "3"
    assert any("--save-interval 3" in n for n in j.notes)
    assert "--save-interval" not in job(tmp_path, requeue=False).train_args
    gpus = job(tmp_path, flags={"training.train_iters": "20"}, gpus_per_node=4)
    assert gpus.workers_per_node == 4


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"flags": {"launch.nnodes": "2"}}, "--nnodes"),
        ({"flags": {"launch.node_rank": "1"}}, "--node-rank"),
        ({"time": "soon"}, "--time"),
        ({"time": "2", "signal_grace_s": 120}, "--signal-grace"),
        ({"signal_grace_s": 0}, "--signal-grace"),
        ({"sbatch_args": ("--nodes=4",)}, "--sbatch-arg"),
        ({"sbatch_args": ("mail",)}, "--sbatch-arg"),
        ({"partition": 'a"b'}, "--partition"),
        ({"flags": {"model.num_layers": "0"}}, "--num-layers"),
    ],
)
def test_bad_input_is_refused_before_anything_exists(tmp_path, kwargs, field):
    assert field in [f for f, _ in problems(tmp_path, **kwargs)]
    assert list(tmp_path.iterdir()) == []


def test_time_limits_in_slurm_formats():
    assert [time_limit_s(t) for t in ("90", "5:30", "1:00:00", "2-3", "1-00:30", "1-0:0:1")] == [
        5400,
        330,
        3600,
        183600,
        88200,
        86401,
    ]
    assert time_limit_s("UNLIMITED") is None


def test_dry_run_prints_the_script_and_creates_nothing(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mlaunch", "sbatch", "--nodes", "2", "--dry-run"],
        cwd=tmp_path, env={**CLEAN, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("#!/bin/bash") and "#SBATCH --nodes=2" in out.stdout
    assert list(tmp_path.iterdir()) == []


def test_torchrun_and_its_workers_inherit_an_ignored_sigusr1():
    """SLURM signals every process of a step: torchrun's agent must not die of USR1."""
    import signal

    from mlaunch.launcher import run as lrun

    before = signal.getsignal(signal.SIGUSR1)
    try:
        lrun._ignore_usr1_in_children()
        probe = "import signal; print(signal.getsignal(signal.SIGUSR1))"
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
        assert out.stdout.strip() in ("Handlers.SIG_IGN", str(int(signal.SIG_IGN)))
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_a_no_flag_turns_a_setting_off_and_both_ways_are_refused(tmp_path):
    # sbatch takes --no-X as train does: it used to be accepted and silently ignored.
    def sbatch(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "mlaunch", "sbatch", "--nodes", "2", "--dry-run", *flags],
            cwd=tmp_path, env={**CLEAN, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        )  # fmt: skip

    on, off = sbatch("--otel-enabled"), sbatch("--no-otel-enabled")
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    assert "MEGATRON_OTEL_ENABLED=true" in on.stdout
    assert "MEGATRON_OTEL_ENABLED=false" in off.stdout
    both = sbatch("--otel-enabled", "--no-otel-enabled")
    assert both.returncode == 2 and "exclude each other" in both.stderr
    assert list(tmp_path.iterdir()) == []


def _warned_script(script: str, tmp: Path, stop_request: str) -> tuple[str, bool]:
    """Run ``script`` under bash with an srun stub that plays the time-limit warning (USR1 to the
    batch shell, as ``scancel --signal=USR1 --batch`` does), after writing ``stop_request``
    (``new``: as ``mlaunch stop`` does first; ``old``: one an earlier incarnation left; ``none``).
    The script's output, and whether it called ``scontrol requeue``."""
    stubs, run_dir = tmp / "bin", tmp / "runs" / "42"
    stubs.mkdir()
    run_dir.mkdir(parents=True)
    request = run_dir / "stop-request.json"
    if stop_request == "old":
        request.write_text("{}")
        os.utime(request, (1_000_000_000, 1_000_000_000))  # long before this incarnation
    new = f"echo '{{}}' > '{request}'\n" if stop_request == "new" else ""
    (stubs / "srun").write_text(f"#!/bin/bash\n{new}kill -USR1 $PPID\nsleep 5\n")
    (stubs / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> "{tmp}/scontrol"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {**CLEAN, "PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_JOB_ID": "42",
           "SLURM_CPUS_ON_NODE": "4"}  # fmt: skip
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                         cwd=tmp, timeout=60)  # fmt: skip
    calls = (tmp / "scontrol").read_text() if (tmp / "scontrol").exists() else ""
    return out.stdout, "requeue 42" in calls


@pytest.mark.parametrize(("stop_request", "requeued"), [("none", True), ("old", True),
                                                         ("new", False)])  # fmt: skip
def test_the_warning_requeues_unless_mlaunch_stop_asked_for_it(tmp_path, stop_request, requeued):
    script = render_script(job(tmp_path))
    out, did = _warned_script(script, tmp_path, stop_request)
    assert "mlaunch: USR1: stopping the workers" in out
    assert did is requeued, out
    if not requeued:
        assert "mlaunch: not requeueing job 42: stopped by mlaunch stop" in out
