"""``mlaunch train`` through Typer's CliRunner with the spawn function patched: the exact torchrun
command line and worker environment per config and flag, every validation error path, dry run,
print-env, progress following and failure reports. No process is started."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlaunch.cli import build_app
from mlaunch.launcher import attempt_entry
from mlaunch.launcher import run as lrun
from mlaunch.launcher.configs import CONFIGS_DIR
from mlaunch.rundir.records import read_progress_record

PREFIXES = (
    "MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_", "SLURM_", "PET_", "MLAUNCH_", "TORCHELASTIC_",
)  # fmt: skip


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No telemetry/SLURM variables from the machine; run in an empty directory."""
    for name in list(os.environ):
        if name.startswith(PREFIXES):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


class FakeProc:
    """Stands in for torchrun: optionally writes what a job would, then exits with ``code``."""

    pid = 2**22 + 12345  # never signalled in these tests

    def __init__(self, code: int = 0, effects=None) -> None:
        self.code, self.effects, self.polls = code, effects, 0

    def poll(self) -> int | None:
        self.polls += 1
        if self.effects:
            self.effects()
            self.effects = None
        return self.code


class Calls(list):
    """(argv, env) of each spawn call, plus ``state["proc"]``: the process the next call gets."""

    state: dict


@pytest.fixture
def spawned(monkeypatch):
    """Patch the spawn function; the list collects (argv, env) of each call."""
    calls = Calls()
    state = {"proc": FakeProc()}

    def fake_spawn(argv, env, log):
        calls.append((argv, env))
        return state["proc"]

    monkeypatch.setattr(lrun, "spawn", fake_spawn)
    calls.state = state
    return calls


def invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(build_app("train"), ["train", *args], env=env)


def only_run_dir(tmp_path: Path) -> Path:
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1
    return runs[0]


#: With telemetry on, torchrun starts each worker through the job trace's wrapper, which sets
#: TRACEPARENT to the attempt's span and execs the entry (mlaunch.launcher.jobtrace).
WRAPPER = ["--no-python", sys.executable, "-S", "-u", attempt_entry.__file__]

TINY_TRAINER_ARGS = [
    "-m", "mlaunch.trainer",
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "30",
    "--lr", "0.003", "--min-lr", "0.0003", "--lr-warmup-iters", "5", "--weight-decay", "0.01",
    "--clip-grad", "1.0", "--eval-interval", "15", "--eval-iters", "2", "--log-interval", "5",
    "--keep-last", "2", "--seed", "1234", "--sample-tokens", "0",
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
]  # fmt: skip


def test_no_arguments_runs_tiny_with_exact_command_and_environment(spawned, tmp_path):
    result = invoke(env={"NEMO_LENS_SPAN_GROUPS": "all", "OTEL_TRACES_SAMPLER": "always_on"})
    assert result.exit_code == 0, result.output
    ((argv, env),) = spawned
    run_dir = only_run_dir(tmp_path)
    run_id = run_dir.name
    assert len(run_id) == 12 and int(run_id, 16) >= 0
    assert argv == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
        "--nproc-per-node", "2", "--max-restarts", "0", "--log-dir", str(run_dir / "logs" / "node0"),
        "--redirects", "3", *WRAPPER, *TINY_TRAINER_ARGS,
    ]  # fmt: skip
    mine = {k: v for k, v in env.items() if k.startswith(PREFIXES) or k == "CUDA_VISIBLE_DEVICES"}
    trace_id, _, key = mine.pop("MLAUNCH_ATTEMPT_TRACE").partition(":")
    assert len(trace_id) == 32 and key
    assert mine == {
        "MEGATRON_OTEL_ENABLED": "true",
        "MEGATRON_OTEL_SPAN_GROUPS": "all",  # NEMO_LENS_* beats the file...
        "MEGATRON_OTEL_EXPORT_STRATEGY": "all_ranks",
        "MEGATRON_OTEL_EXPORT_RANK": "-1",
        "MEGATRON_OTEL_EXPORT_SAMPLE_RATE": "1.0",
        "MEGATRON_OTEL_SAMPLER_ENABLED": "false",
        "MEGATRON_OTEL_TRACES_ENABLED": "true",
        "MEGATRON_OTEL_METRICS_ENABLED": "true",
        "MEGATRON_OTEL_LOGS_ENABLED": "false",
        "MEGATRON_OTEL_EXPORTER": "file",
        "MEGATRON_OTEL_RUN_ID": run_id,
        "MEGATRON_OTEL_USER_ID": "",
        "MEGATRON_OTEL_SHUTDOWN_TIMEOUT": "5.0",
        "MEGATRON_OTEL_TRACE_SEGMENT_ITERS": "100",
        "MEGATRON_OTEL_RECORDER_GROUPS": "",  # the flight recorder is off unless asked for
        "MEGATRON_OTEL_RECORDER_ITERS": "20",
        "MEGATRON_OTEL_RECORDER_MAX_MIB": "64.0",
        "MEGATRON_OTEL_RECORDER_SLOW_FACTOR": "2.0",
        "MLAUNCH_RUN_DIR": str(run_dir),
        "OTEL_SERVICE_NAME": "mlaunch-tiny",
        "OTEL_TRACES_SAMPLER": "always_on",
        "CUDA_VISIBLE_DEVICES": "",
    }  # ...and the NEMO_LENS_* copy is gone: workers see one truth
    assert (
        (run_dir / "command.txt")
        .read_text()
        .startswith(f"{sys.executable} -m torch.distributed.run")
    )
    assert stat.S_IMODE((run_dir / "resolved.env").stat().st_mode) == 0o600
    assert "exporting ranks" in result.output and "all 2 (0, 1)" in result.output
    assert f"mlaunch trace summary {run_dir}" in result.output


def test_flags_win_over_environment_and_stale_aliases_are_removed(spawned):
    result = invoke(
        "--otel-span-groups", "all,-layer", "--otel-export-strategy", "single_rank",
        "--otel-export-rank", "0", "--no-otel-enabled", "--otel-service-name", "svc",
        "--train-iters", "7",
        env={"MEGATRON_OTEL_RANK_STRATEGY": "all_ranks", "MEGATRON_OTEL_SPAN_GROUPS": "default",
             "NEMO_LENS_EXPORT_STRATEGY": "sampled"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    ((argv, env),) = spawned
    assert env["MEGATRON_OTEL_SPAN_GROUPS"] == "all,-layer"
    assert env["MEGATRON_OTEL_EXPORT_STRATEGY"] == "single_rank"
    assert env["MEGATRON_OTEL_EXPORT_RANK"] == "0"
    assert env["MEGATRON_OTEL_ENABLED"] == "false"
    assert env["OTEL_SERVICE_NAME"] == "svc"
    assert "MEGATRON_OTEL_RANK_STRATEGY" not in env and "NEMO_LENS_EXPORT_STRATEGY" not in env
    assert argv[argv.index("--train-iters") + 1] == "7"
    assert "telemetry" in result.output and "off" in result.output


def test_otlp_flags_select_the_otlp_exporter_and_reach_workers(spawned):
    result = invoke(
        "--otlp-endpoint", "http://127.0.0.1:4317", "--otlp-protocol", "grpc",
        "--otel-exporter", "otlp", "--otlp-traces-sampler", "traceidratio",
        "--otlp-traces-sampler-arg", "0.25",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    ((_, env),) = spawned
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://127.0.0.1:4317"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    assert env["OTEL_TRACES_SAMPLER"] == "traceidratio"
    assert env["OTEL_TRACES_SAMPLER_ARG"] == "0.25"
    assert env["MEGATRON_OTEL_EXPORTER"] == "otlp"
    assert "otlp (grpc) -> http://127.0.0.1:4317" in result.output


def test_a_typed_endpoint_flag_wins_over_the_shipped_default_configs_file_exporter(spawned):
    # tiny.toml (plain `mlaunch train`) sets exporter = "file": the flag the user typed wins.
    result = invoke("--otlp-endpoint", "http://127.0.0.1:4317")
    assert result.exit_code == 0, result.output
    ((_, env),) = spawned
    assert env["MEGATRON_OTEL_EXPORTER"] == "otlp"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://127.0.0.1:4317"
    resolved = json.loads((only_run_dir(Path.cwd()) / "resolved.json").read_text())
    assert resolved["settings"]["telemetry.exporter"] == {
        "value": "otlp",
        "source": "--otlp-endpoint over tiny.toml's exporter = 'file'",
    }


@pytest.mark.parametrize(
    ("where", "args", "env"),
    [
        ("own-config", ("--config", "mine.toml"), None),
        ("variable", (), {"MEGATRON_OTEL_EXPORTER": "console"}),
    ],
)
def test_an_endpoint_flag_against_an_exporter_the_user_chose_stops_with_the_fix(
    spawned, tmp_path, where, args, env
):
    (tmp_path / "mine.toml").write_text('[telemetry]\nenabled = true\nexporter = "file"\n')
    result = invoke("--otlp-endpoint", "http://127.0.0.1:4317", *args, env=env)
    assert result.exit_code == 2, result.output
    assert "--otlp-endpoint: not used: the exporter is" in result.output
    assert "pass --otel-exporter otlp to send there, or drop --otlp-endpoint" in result.output
    assert "Traceback" not in result.output
    assert spawned == [] and not (tmp_path / "runs").exists()


def test_shipped_configs_other_than_tiny_follow_the_endpoint(spawned):
    result = invoke("--config", "gpu8", "--otlp-endpoint", "http://127.0.0.1:4317", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "otlp (grpc) -> http://127.0.0.1:4317" in result.output
    assert "not used" not in result.output


@pytest.mark.parametrize(
    ("config", "expect"),
    [
        ("pp2", ["--pipeline-model-parallel-size", "2"]),
        ("dp2pp2", ["--nproc-per-node", "4"]),
        ("profiling", ["--offload-activations"]),
        (str(CONFIGS_DIR / "tiny.toml"), ["--train-iters", "30"]),
    ],
)
def test_each_shipped_config_launches(spawned, config, expect):
    result = invoke("--config", config)
    assert result.exit_code == 0, result.output
    ((argv, _),) = spawned
    joined = " ".join(argv)
    assert " ".join(expect) in joined


def test_gpu8_and_megatron_configs(spawned, tmp_path, monkeypatch):
    # These configs say device = "cuda": the launch stands for one on a GPU machine.
    from mlaunch.doctor import torch_probe

    monkeypatch.setattr(torch_probe, "cuda_missing", lambda python, env: None)
    result = invoke("--config", "gpu8", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "--nproc-per-node 8" in result.output and "--bf16" in result.output
    assert "CUDA_VISIBLE_DEVICES" not in result.output  # cuda: the workers pick their GPU
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    result = invoke("--config", "megatron", "--script", str(script), "--", "--vocab-file", "v.json")
    assert result.exit_code == 0, result.output
    ((argv, env),) = spawned
    assert argv[argv.index(str(script)) :][-2:] == ["--vocab-file", "v.json"]
    assert argv[argv.index("--redirects") + 2 :][: len(WRAPPER) + 1] == [*WRAPPER, str(script)]
    # Relay (the default for a script with an endpoint): the workers export to the launcher's
    # receiver on loopback, which forwards to the configured endpoint.
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http://127.0.0.1:")
    assert env["MEGATRON_OTEL_EXPORTER"] == "otlp"
    result = invoke(
        "--config", "megatron", "--script", str(script), "--no-otlp-relay", "--run-dir",
        str(tmp_path / "r2"),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert spawned[-1][1]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://localhost:4317"


def test_the_readmes_megatron_example_runs_as_written(spawned, tmp_path, monkeypatch):
    # README: mlaunch train --config megatron --script .../pretrain_gpt.py -- --data-path PREFIX
    # (megatron.toml says device = "cuda": this stands for a GPU machine).
    from mlaunch.doctor import torch_probe

    monkeypatch.setattr(torch_probe, "cuda_missing", lambda python, env: None)
    script = tmp_path / "Megatron-LM" / "pretrain_gpt.py"
    script.parent.mkdir()
    script.write_text("")
    result = invoke(
        "--config", "megatron", "--script", str(script), "--", "--data-path",
        "/data/corpus_text_document",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    ((argv, _),) = spawned
    assert argv[-2:] == ["--data-path", "/data/corpus_text_document"]
    assert argv.count("--data-path") == 1


@pytest.mark.parametrize("how", [("--device", "cuda"), ("--config", "gpu8")])
def test_device_cuda_without_cuda_is_refused_before_anything_starts(spawned, tmp_path, how):
    # The real probe (doctor's, in a subprocess); an empty CUDA_VISIBLE_DEVICES hides every GPU
    # there is, so the machine has no CUDA for the workers whatever it holds.
    result = invoke(*how, env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.exit_code == 2, result.output
    label = "--device" if how[0] == "--device" else "gpu8.toml [launch] device"
    assert f"{label}: cuda, but the workers would find no CUDA device" in result.output
    assert "use --device cpu" in result.output and "Traceback" not in result.output
    assert spawned == [] and not (tmp_path / "runs").exists()


def test_module_target_and_passthrough(spawned, tmp_path):
    (tmp_path / "my").mkdir()
    (tmp_path / "my" / "train.py").write_text("")
    result = invoke("--module", "my.train", "--no-megatron-args", "--", "--foo", "bar baz")
    assert result.exit_code == 0, result.output
    ((argv, _),) = spawned
    assert argv[argv.index("--redirects") + 2 :] == [*WRAPPER, "-m", "my.train", "--foo", "bar baz"]


def test_a_module_is_found_before_launch_without_running_its_package(spawned, tmp_path):
    # A dry run never runs user code: finding pkg.train must not execute pkg/__init__.py
    # (importlib.util.find_spec of a dotted name would import the parent).
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("open('ran', 'w').close()\n")
    (tmp_path / "pkg" / "train.py").write_text("")
    assert invoke("--dry-run", "--module", "pkg.train").exit_code == 0
    missing = invoke("--module", "pkg.nope")
    assert missing.exit_code == 2
    assert missing.stderr.startswith("--module: no module named 'pkg.nope' from")
    assert not (tmp_path / "ran").exists() and spawned == []


def test_passthrough_to_the_builtin_trainer_is_checked_before_launch(spawned, tmp_path):
    ok = invoke("--", "--eval-fraction", "0.1")
    assert ok.exit_code == 0, ok.output
    assert spawned[0][0][-2:] == ["--eval-fraction", "0.1"]
    bad = CliRunner().invoke(build_app("train"), ["train", "--run-dir", "x", "--", "--bogus"])
    assert bad.exit_code == 2
    assert (
        "-- ARGS: the trainer rejects its arguments: unrecognized arguments: --bogus" in bad.stderr
    )
    assert not (tmp_path / "x").exists() and len(spawned) == 1


def test_multi_node_flags_and_run_id_from_rendezvous_id(spawned, tmp_path):
    result = invoke(
        "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "10.0.0.1:29400",
        "--rdzv-id", "job7", "--nproc-per-node", "1", "--max-restarts", "3",
        "--global-batch-size", "4",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    ((argv, env),) = spawned
    assert argv[3:19] == [
        "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "10.0.0.1:29400", "--rdzv-id", "job7", "--max-restarts", "3",
        "--log-dir", str(tmp_path / "runs" / "job7" / "logs" / "node1"),
    ]  # fmt: skip
    assert env["MEGATRON_OTEL_RUN_ID"] == "job7"


def test_slurm_variables_fill_in_the_launch(spawned):
    # The first node hosts the rendezvous; its name must resolve (a real launch checks), so it
    # is this machine's 'localhost' here, the job's other nodes made-up names.
    result = invoke(
        "--global-batch-size", "16",
        env={"SLURM_JOB_ID": "991", "SLURM_NNODES": "4", "SLURM_NODEID": "3",
             "SLURM_JOB_NODELIST": "localhost,gpu[08-10]"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    ((argv, env),) = spawned
    assert argv[argv.index("--rdzv-endpoint") + 1] == "localhost:29500"
    assert argv[argv.index("--node-rank") + 1] == "3"
    assert env["MEGATRON_OTEL_RUN_ID"] == "991"
    # Node 3 of 4 shows no progress view of its own: one line points to its launcher.log.
    (pointer,) = result.output.splitlines()
    assert pointer.startswith("node 3 of 4: the progress view is node 0's")
    log = Path(env["MLAUNCH_RUN_DIR"]) / "logs" / "node3" / "launcher.log"
    assert pointer.endswith(str(log)) and "node rank 3 (from SLURM_NODEID)" in log.read_text()


# ---- validation: exit 2, one line per problem naming the field, nothing created ------------


@pytest.mark.parametrize(
    ("args", "env", "field"),
    [
        (["--num-layers", "abc"], {}, "--num-layers"),
        (["--otel-span-groups", "default,stepp"], {}, "--otel-span-groups"),
        ([], {"MEGATRON_OTEL_SPAN_GROUP": "all"}, "MEGATRON_OTEL_SPAN_GROUP"),
        ([], {"OTEL_TRACES_SAMPLER": "always_onn"}, "OTEL_TRACES_SAMPLER"),
        ([], {"OTEL_TRACES_SAMPLER_ARG": "1.5"}, "OTEL_TRACES_SAMPLER_ARG"),
        (["--config", "nosuch"], {}, "--config"),
        (["--nnodes", "2"], {}, "--rdzv-endpoint"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--global-batch-size", "8"], {}, "--rdzv-id"),
        (["--rdzv-endpoint", "nohost"], {}, "--rdzv-endpoint"),
        (["--pipeline-model-parallel-size", "3"], {}, "--pipeline-model-parallel-size"),
        (["--otel-export-rank", "5"], {}, "--otel-export-rank"),
        (["--otel-export-strategy", "singel_rank"], {}, "--otel-export-strategy"),
        (["--script", "missing.py"], {}, "--script"),
        (
            ["--tensor-model-parallel-size", "2", "--nproc-per-node", "4"],
            {},
            "--tensor-model-parallel-size",
        ),
        (["--otlp-endpoint", "localhost:4317"], {}, "--otlp-endpoint"),
        (["--otel-run-id", "bad id!"], {}, "--otel-run-id"),
        (["--otel-enabled", "--otel-export-sample-rate", "2"], {}, "--otel-export-sample-rate"),
        (["--num-layer", "3"], {}, "--num-layer"),  # Click's own usage errors: same shape
        (["--nnodes"], {}, "--nnodes"),
    ],
)
def test_bad_input_exits_2_naming_the_field_and_creates_nothing(
    spawned, tmp_path, args, env, field
):
    result = invoke("--run-dir", "out", *args, env=env)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines and all(": " in line for line in lines)
    assert any(line.startswith(field) for line in lines), lines
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()
    assert spawned == []


def test_every_problem_is_reported_at_once(spawned, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\ntrain_itres = 3\n[modle]\n")
    result = invoke("--config", str(bad), env={"MEGATRON_OTEL_ENABLD": "1"})
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 3, lines
    assert any("train_itres" in line and "train_iters" in line for line in lines)
    assert any(line.startswith("MEGATRON_OTEL_ENABLD") for line in lines)


# ---- dry run and print-env -----------------------------------------------------------------


def test_dry_run_prints_command_and_redacted_environment_and_creates_nothing(spawned, tmp_path):
    env = {"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer TOPSECRET"}
    result = invoke("--dry-run", env=env)
    assert result.exit_code == 0, result.output
    assert "-m torch.distributed.run --standalone" in result.output
    assert "export MEGATRON_OTEL_SPAN_GROUPS=per_step" in result.output
    assert "OTEL_EXPORTER_OTLP_HEADERS=<redacted>" in result.output
    assert "TOPSECRET" not in result.output
    assert not (tmp_path / "runs").exists() and spawned == []
    shown = invoke("--dry-run", "--show-secrets", env=env)
    assert "TOPSECRET" in shown.output


def test_print_env_prints_pasteable_exports_only(spawned, tmp_path):
    result = invoke(
        "--print-env", "--otel-user-id", "a b$c", env={"NEMO_LENS_RANK_STRATEGY": "all_ranks"}
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert all(line.startswith(("export ", "# export ", "unset ")) for line in lines)
    assert "export MEGATRON_OTEL_USER_ID='a b$c'" in lines
    assert lines[-1] == "unset NEMO_LENS_RANK_STRATEGY"
    assert not (tmp_path / "runs").exists() and spawned == []


# ---- following and reporting ---------------------------------------------------------------


def test_progress_lines_per_log_interval_and_run_summary(spawned, tmp_path):
    def job():
        run_dir = only_run_dir(tmp_path)
        with (run_dir / "progress.jsonl").open("a") as fh:
            for i in range(1, 11):
                rec = {"iteration": i, "train_iters": 10, "loss": 5.0 - i / 10, "lr": 1e-3,
                       "grad_norm": 1.0, "tokens_per_sec": 1000.0 * i, "step_ms": 10.0, "skipped": False}  # fmt: skip
                fh.write(json.dumps(rec) + "\n")
            fh.write(json.dumps({"iteration": 10, "eval_loss": 4.5}) + "\n")
        (run_dir / "telemetry" / "traces-rank0.jsonl").write_text("")

    spawned.state["proc"] = FakeProc(0, job)
    result = invoke("--train-iters", "10", "--log-interval", "5")
    assert result.exit_code == 0, result.output
    shown = [line for line in result.stdout.splitlines() if line.startswith("iteration ")]
    assert [line.split(" | ")[0] for line in shown] == [
        "iteration 1/10",
        "iteration 5/10",
        "iteration 10/10",
    ]
    assert "eval at iteration 10: loss 4.5000" in result.stdout
    assert "final loss  4.0000" in result.stdout and "10/10" in result.stdout
    assert "5,500 (mean of 10 records)" in result.stdout
    assert "(2 file(s))" in result.stdout  # rank 0's and the launcher's job trace


def test_failed_rank_reported_with_rank_exception_and_log_tail(spawned, tmp_path):
    def job():
        run_dir = only_run_dir(tmp_path)
        (run_dir / "error-rank1.json").write_text(json.dumps({
            "rank": 1, "exception_type": "RuntimeError", "message": "boom at iteration 3",
            "traceback": "Traceback ...", "iteration": 3,
        }))  # fmt: skip
        folder = run_dir / "logs" / "node0" / "abc_x1" / "attempt_0" / "1"
        folder.mkdir(parents=True)
        (folder / "error.json").write_text(
            json.dumps({"message": {"message": "RuntimeError: boom"}})
        )
        (folder / "stderr.log").write_text("\n".join(f"[rank1]: line {i}" for i in range(40)))
        (run_dir / "logs" / "node0" / "torchrun.log").write_text("error_file: <N/A>\n")

    spawned.state["proc"] = FakeProc(1, job)
    result = invoke()
    assert result.exit_code == 1
    out = result.stdout
    assert "rank 1 (node 0, local rank 1) failed" in out
    assert "RuntimeError: boom at iteration 3" in out
    assert "[rank1]: line 39" in out and "[rank1]: line 20" not in out  # the last lines only
    assert "<N/A>" not in out


def test_failure_without_error_files_shows_torchrun_log(spawned, tmp_path):
    def job():
        (only_run_dir(tmp_path) / "logs" / "node0" / "torchrun.log").write_text(
            "rendezvous timed out\n"
        )

    spawned.state["proc"] = FakeProc(1, job)
    result = invoke()
    assert result.exit_code == 1
    assert "torchrun exited with 1" in result.stdout and "rendezvous timed out" in result.stdout


def test_secrets_never_reach_disk_or_screen(spawned, tmp_path):
    secret = "authorization=Bearer SUPERSECRET"
    result = invoke(
        "--otlp-headers", "x-api-key=FLAGSECRET", env={"OTEL_EXPORTER_OTLP_TRACES_HEADERS": secret}
    )
    assert result.exit_code == 0, result.output
    ((argv, env),) = spawned
    assert env["OTEL_EXPORTER_OTLP_HEADERS"] == "x-api-key=FLAGSECRET"
    assert env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"] == secret
    for path in only_run_dir(tmp_path).rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert "SUPERSECRET" not in text and "FLAGSECRET" not in text, path
    assert "SUPERSECRET" not in result.output and "FLAGSECRET" not in result.output


def test_terminal_gets_a_progress_bar():
    import io

    from rich.console import Console

    from mlaunch.cli.train_view import BarDisplay

    out = io.StringIO()
    bar = BarDisplay(Console(file=out, force_terminal=True, width=120), total=10)
    for line in (
        {"iteration": 4, "train_iters": 10, "loss": 2.5, "tokens_per_sec": 1234.0},
        {"iteration": 4, "eval_loss": 2.25},
    ):
        bar.record(read_progress_record(json.dumps(line)))
    task = bar.progress.tasks[0]
    assert (task.completed, task.total, task.fields["loss"], task.fields["tps"]) == (
        4,
        10,
        "2.5000",
        "1,234",
    )
    bar.close()
    assert "eval at iteration 4: loss 2.2500" in out.getvalue()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1])
def test_ctrl_c_and_sigterm_are_forwarded_as_sigterm_to_torchruns_group(monkeypatch, signum):
    sent: list[tuple[int, int]] = []
    seen: list[int] = []
    monkeypatch.setattr(lrun.os, "killpg", lambda pgid, sig: sent.append((pgid, sig)))
    proc = FakeProc()
    with lrun._forwarding(proc, lambda s, _forced: seen.append(s)) as received:
        os.kill(os.getpid(), signum)
    assert sent == [(proc.pid, signal.SIGTERM)] and received == [signum] and seen == [signum]
    assert signal.getsignal(signum) is not None  # the previous handler is back


def test_a_setting_repeated_after_the_separator_is_refused(spawned, tmp_path):
    # argparse keeps the last value, so the workers would train 5 iterations while the summary,
    # resolved.json and the checkpoint plan say 30.
    result = invoke("--", "--train-iters=5")
    assert result.exit_code == 2
    assert "-- ARGS: --train-iters is a setting of mlaunch train" in result.stderr
    assert spawned == [] and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "args", [["--otel-span-groups", "default"], ["--otel-enabled"], ["--otel-service-name=x"]]
)
def test_the_trainers_otel_flags_after_the_separator_are_refused(spawned, tmp_path, args):
    # The trainer's --otel-* flags win over the MEGATRON_OTEL_* mlaunch resolved: the workers
    # would run 'default' while the summary, resolved.env and resolved.json said 'all'.
    result = invoke("--", *args, env={"MEGATRON_OTEL_SPAN_GROUPS": "all"})
    assert result.exit_code == 2, result.output
    flag = args[0].split("=")[0]
    assert f"-- ARGS: {flag} is a setting of mlaunch train: give it before '--'" in result.stderr
    assert spawned == [] and not (tmp_path / "runs").exists()


def test_an_abbreviated_setting_after_the_separator_is_refused(spawned, tmp_path):
    # argparse took '--train-iter 5' as --train-iters 5 (the record said 30); the trainer's
    # parser now takes whole names only, as Megatron-LM's does.
    result = invoke("--", "--train-iter", "5")
    assert result.exit_code == 2, result.output
    assert "unrecognized arguments: --train-iter 5" in result.stderr
    assert spawned == [] and not (tmp_path / "runs").exists()


def test_megatrons_otel_flags_are_refused_even_when_it_gets_environment_only(spawned, tmp_path):
    # --no-megatron-args: the model arguments after '--' are the user's, but pretrain_gpt.py's
    # --otel-* flags would still override the MEGATRON_OTEL_* variables mlaunch wrote.
    (tmp_path / "pretrain_gpt.py").write_text("")
    base = ("--script", "pretrain_gpt.py", "--no-megatron-args", "--")
    result = invoke(*base, "--otel-span-groups=all")
    assert result.exit_code == 2, result.output
    assert "-- ARGS: --otel-span-groups is a setting of mlaunch train" in result.stderr
    assert invoke("--dry-run", *base, "--train-iters", "3").exit_code == 0


def test_a_script_summary_shows_only_the_settings_the_script_receives(spawned, tmp_path):
    # A plain script gets none of tiny.toml's model/training/parallelism values: the summary
    # showed "2 layers, hidden 64" and "30 iterations" beside "megatron args: not passed".
    (tmp_path / "plain.py").write_text("")
    (tmp_path / "pretrain_gpt.py").write_text("")
    plain = invoke("--dry-run", "--script", "plain.py")
    assert plain.exit_code == 0, plain.output
    rows = [line.strip("│ ").split("  ")[0] for line in plain.output.splitlines()]
    assert "megatron args" in rows and "model" not in rows and "training" not in rows
    assert "2 layers" not in plain.output and "30 iterations" not in plain.output
    assert "2 ranks; device cpu" in plain.output and "pipeline" not in plain.output.split("#")[0]
    megatron = invoke("--dry-run", "--script", "pretrain_gpt.py")
    assert megatron.exit_code == 0, megatron.output
    flat = " ".join(megatron.output.replace("│", " ").split())
    assert "model 2 layers, hidden 64" in flat and "training 30 iterations" in flat
    assert "--train-iters 30" in megatron.output  # ... because the script receives them


def test_an_otlp_timeout_in_milliseconds_is_a_warning_in_the_summary(spawned):
    # OTEL_EXPORTER_OTLP_TIMEOUT=10000 (milliseconds in older docs) was taken as 10,000 s
    # without a word: the SDK reads seconds.
    result = invoke("--dry-run", env={"OTEL_EXPORTER_OTLP_TIMEOUT": "10000"})
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.replace("│", " ").split())
    assert (
        "warning OTEL_EXPORTER_OTLP_TIMEOUT=10000 looks like milliseconds, but the Python SDK"
        " reads seconds" in flat
    )
    assert "set OTEL_EXPORTER_OTLP_TIMEOUT=10 (seconds)" in flat
    quiet = invoke("--dry-run", env={"OTEL_EXPORTER_OTLP_TIMEOUT": "30"})
    assert "milliseconds" not in quiet.output


def test_a_custom_export_strategy_is_never_called_by_the_launcher(spawned, tmp_path, monkeypatch):
    # `--otel-export-strategy os:system --dry-run` called os.system during validation: a dry run
    # ran user code. The settings check that it imports and takes one argument; only the
    # workers call it.
    (tmp_path / "strat_mod.py").write_text(
        "def every(info):\n    open('called', 'a').close()\n    return True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for how in (["--dry-run"], []):
        result = invoke(*how, "--otel-export-strategy", "strat_mod:every")
        assert result.exit_code == 0, result.output
        flat = " ".join(result.output.replace("│", " ").split())
        assert "exporting ranks decided in each worker by 'strat_mod:every'" in flat
    assert not (tmp_path / "called").exists() and len(spawned) == 1
    resolved = json.loads((only_run_dir(tmp_path) / "resolved.json").read_text())
    assert resolved["exporting_ranks"] is None


def test_a_sampler_argument_without_a_ratio_sampler_is_shown_as_ignored(spawned):
    result = invoke("--dry-run", env={"OTEL_TRACES_SAMPLER_ARG": "0.5"})
    text = " ".join(result.output.replace("│", " ").split())
    assert "OTEL_TRACES_SAMPLER_ARG=0.5 ignored: not a ratio sampler" in text
    result = invoke(
        "--dry-run", env={"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5"}
    )
    assert "traceidratio (ratio 0.5)" in result.output


def test_the_relays_counts_and_the_replay_command_end_the_report(tmp_path):
    # The report used to say "traces: sent to ..." while every span went to the spool.
    from rich.console import Console

    from mlaunch.cli import train_view
    from mlaunch.launcher.plan import build_plan
    from mlaunch.receiver.core import ReceiverStats

    plan = build_plan(
        flags={"launch.run_dir": str(tmp_path / "r"), "telemetry.exporter": "otlp",
               "telemetry.otel.base_endpoint": "http://collector:4318",
               "telemetry.otel.base_protocol": "http/protobuf"},
        environ={"PATH": os.environ.get("PATH", "")}, cwd=tmp_path,
    )  # fmt: skip
    stats = ReceiverStats(mode="relay")
    stats.signals["traces"].received_items = 120
    stats.signals["traces"].forwarded_items = 20
    stats.signals["traces"].spooled_items = 100
    result = lrun.RunResult(0, 1.0, [], receiver=stats)
    console = Console(record=True, width=300)
    train_view.print_result(console, plan, result)
    text = console.export_text()
    assert (
        "traces:  120 spans: 20 delivered to http://collector:4318/v1/traces, 100 spooled" in text
    )
    assert (
        f"send them: mlaunch trace replay {plan.run_dir} --endpoint http://collector:4318"
        " --protocol http/protobuf" in text
    )


def test_a_ratio_sampler_says_its_unit_is_a_train_block_and_warns_on_too_few(spawned):
    # A 20-iteration run at ratio 0.5 keeps 0 or 100 % of its spans: the report says why.
    env = {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5"}
    text = " ".join(
        invoke("--dry-run", "--train-iters", "20", env=env).output.replace("│", " ").split()
    )
    assert (
        "sampling unit a whole megatron.train block (20 iterations; all its spans kept or" in text
    )
    assert "this run has 1" in text
    assert "ratio 0.5 over 1 block(s) keeps all or none of each" in text
    assert "--otel-trace-segment-iters <= 2" in text
    text = " ".join(
        invoke("--dry-run", "--train-iters", "20", "--otel-trace-segment-iters", "2", env=env)
        .output.replace("│", " ")
        .split()
    )
    assert "(2 iterations; all its spans" in text and "this run has 10" in text
    assert "keeps all or none" not in text
    # No ratio sampler, no unit row.
    assert "sampling unit" not in invoke("--dry-run").output
