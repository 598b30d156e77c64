"""``data_path`` and Megatron-LM's data arguments: checked by the rules of the entry point that
gets them. The launch itself is in tests/integration/test_megatron_data_args.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlaunch.launcher import plan as lp
from mlaunch.settings import SettingsError
from mlaunch.slurm.batch import frozen_flags

CLEAN = {"PATH": "/usr/bin:/bin"}


def _script(tmp_path: Path) -> str:
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    return str(script)


def _plan(tmp_path: Path, flags: dict, passthrough: tuple[str, ...] = ()) -> lp.LaunchPlan:
    return lp.build_plan(
        flags={"launch.run_dir": str(tmp_path / "run"), **flags},
        config="megatron",
        passthrough=passthrough,
        environ=CLEAN,
        cwd=tmp_path,
    )


def _problems(tmp_path: Path, flags: dict, passthrough: tuple[str, ...] = ()) -> list[str]:
    with pytest.raises(SettingsError) as info:
        _plan(tmp_path, flags, passthrough)
    return [f"{p.field}: {p.message}" for p in info.value.problems]


def test_a_megatron_data_path_setting_is_split_into_prefixes_and_weights(tmp_path):
    plan = _plan(
        tmp_path, {"launch.script": _script(tmp_path), "training.data_path": "0.3 rel/a 0.7 /b"}
    )
    at = plan.argv.index("--data-path")
    assert plan.argv[at + 1 : at + 5] == ["0.3", "rel/a", "0.7", "/b"]
    # sbatch freezes each prefix absolute, the weights as they are
    frozen = frozen_flags(plan, tmp_path)
    assert frozen[frozen.index("--data-path") + 1] == f"0.3 {tmp_path}/rel/a 0.7 /b"


def test_megatron_rules_refuse_a_list_that_mixes_weights_and_prefixes(tmp_path):
    flags = {"launch.script": _script(tmp_path), "training.data_path": "0.3 /a /b /c"}
    (problem,) = _problems(tmp_path, flags)
    assert problem.startswith("--data-path: ") and "mixes weights and prefixes" in problem


def test_data_path_given_both_before_and_after_dashes_is_refused_for_a_megatron_script(tmp_path):
    flags = {"launch.script": _script(tmp_path), "training.data_path": "/a"}
    problems = _problems(tmp_path, flags, ("--train-data-path", "/t"))
    assert problems == [
        "-- ARGS: --train-data-path after '--' and --data-path before it: Megatron-LM takes a"
        " single data source; give the prefixes once (after '--' they pass through verbatim)"
    ]


def test_mlaunch_trainer_still_reads_data_path_as_a_text_corpus(tmp_path):
    with pytest.raises(SettingsError) as info:
        lp.build_plan(flags={"training.data_path": "/a/prefix"}, environ=CLEAN, cwd=tmp_path)
    assert [str(p) for p in info.value.problems] == [
        "--data-path: data_path '/a/prefix' does not exist; give a text file or folder"
    ]
    with pytest.raises(SettingsError) as info:
        lp.build_plan(flags={}, passthrough=("--data-path", "c.txt"), environ=CLEAN, cwd=tmp_path)
    assert "--data-path is a setting of mlaunch train" in str(info.value.problems[0])
