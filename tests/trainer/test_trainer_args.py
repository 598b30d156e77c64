"""The trainer's arguments: Megatron-LM names, and invalid combinations rejected before any process
group exists (exit 2, one line per problem, no traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.trainer_runs import clean_env

from mlaunch.settings.trainer_cli import build_parser, validate

MEGATRON_FLAGS = [
    "--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--micro-batch-size",
    "--global-batch-size", "--train-iters", "--lr", "--min-lr", "--lr-warmup-iters",
    "--weight-decay", "--clip-grad", "--eval-interval", "--eval-iters", "--log-interval", "--save",
    "--load", "--save-interval", "--pipeline-model-parallel-size", "--tensor-model-parallel-size",
    "--data-path", "--seed", "--bf16", "--fp16", "--exit-interval",
    "--otel-enabled", "--otel-service-name", "--otel-span-groups",
]  # fmt: skip


def problems(argv: list[str], world_size: int) -> dict[str, str]:
    ns = build_parser().parse_args(argv)
    return dict(validate(ns, world_size))


def test_parser_accepts_megatron_names():
    options = {s for a in build_parser()._actions for s in a.option_strings}
    assert set(MEGATRON_FLAGS) <= options


def test_valid_layout_fills_global_batch_default():
    ns = build_parser().parse_args(
        ["--micro-batch-size", "3", "--pipeline-model-parallel-size", "2"]
    )
    assert validate(ns, 4) == []
    assert ns.global_batch_size == 3 * 2  # micro x DP


@pytest.mark.parametrize(
    ("argv", "world", "arg", "words"),
    [
        (
            ["--global-batch-size", "10", "--micro-batch-size", "2"],
            2,
            "--global-batch-size",
            "not divisible by micro batch 2 x data-parallel size 2",
        ),
        (
            ["--num-layers", "3", "--pipeline-model-parallel-size", "2"],
            2,
            "--num-layers",
            "cannot be split evenly across 2 pipeline stages",
        ),
        (
            ["--pipeline-model-parallel-size", "2"],
            3,
            "--pipeline-model-parallel-size",
            "world size 3",
        ),
        (
            ["--hidden-size", "30", "--num-attention-heads", "4"],
            1,
            "--num-attention-heads",
            "divide",
        ),
        (
            ["--tensor-model-parallel-size", "2"],
            2,
            "--tensor-model-parallel-size",
            "supports tensor parallel size 1 only",
        ),
        (["--bf16", "--fp16"], 1, "--fp16", "pick one"),
        (["--save-interval", "5"], 1, "--save-interval", "--save"),
        (["--otel-span-groups", "defualt"], 1, "--otel-span-groups", "did you mean 'default'"),
        (["--min-lr", "1", "--lr", "0.1"], 1, "--min-lr", "must be <= lr 0.1"),
        (["--hidden-dropout", "1"], 1, "--hidden-dropout", "below 1, got 1.0"),
        (["--hidden-dropout", "-0.1"], 1, "--hidden-dropout", "at least 0"),
    ],
)
def test_invalid_combinations_name_the_argument_and_the_fix(argv, world, arg, words):
    found = problems(argv, world)
    assert arg in found, found
    assert words in found[arg]


def test_the_trainer_checks_its_settings_by_the_settings_own_rules():
    # One definition of each rule: the trainer's verdict is the settings' words, named by its flag.
    from mlaunch.settings import SettingsError, load_settings

    flags = {"model.hidden_size": 30, "model.num_attention_heads": 4, "training.lr": 0.0}
    with pytest.raises(SettingsError) as caught:
        load_settings(flags=flags, environ={})
    argv = ["--hidden-size", "30", "--num-attention-heads", "4", "--lr", "0"]
    assert [str(p) for p in caught.value.problems] == [str(p) for p in problems_of(argv, 2)]
    del flags["training.lr"]
    with pytest.raises(SettingsError) as cross:
        load_settings(flags={**flags, "training.global_batch_size": 4}, environ={})
    assert cross.value.problems == problems_of(argv[:4], 2)


def problems_of(argv: list[str], world_size: int) -> list:
    return validate(build_parser().parse_args(argv), world_size)


def trainer_process(tmp_path, args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m mlaunch.trainer ARGS`` in ``tmp_path`` with a clean environment plus ``env``."""
    return subprocess.run(
        [sys.executable, "-m", "mlaunch.trainer", *args],
        env=clean_env(tmp_path, **env),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_bad_arguments_exit_2_on_every_rank_without_a_traceback(tmp_path):
    # Exactly what a torchrun worker sees: WORLD_SIZE says 3, the layout needs a multiple of 2;
    # no MASTER_ADDR, so reaching init_process_group would fail loudly instead.
    proc = trainer_process(
        tmp_path,
        ["--pipeline-model-parallel-size", "2", "--num-layers", "3",
         "--tensor-model-parallel-size", "2"],
        WORLD_SIZE="3", RANK="1",
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 3, proc.stderr
    assert all(line.startswith("python -m mlaunch.trainer: error: --") for line in lines)
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


def test_bad_telemetry_environment_exits_2(tmp_path):
    proc = trainer_process(tmp_path, [], MEGATRON_OTEL_ENABLED="maybe")
    assert proc.returncode == 2
    assert "MEGATRON_OTEL_ENABLED" in proc.stderr and "Traceback" not in proc.stderr


def test_help_exits_0_with_the_usage_and_no_traceback(tmp_path):
    # torchelastic's record() turns argparse's SystemExit(0) into a return of None; the entry
    # point's exit must still be 0 (it once crashed on os._exit(None)).
    proc = trainer_process(tmp_path, ["--help"])
    assert proc.returncode == 0, proc.stderr
    assert "--num-layers" in proc.stdout and "Traceback" not in proc.stderr
