"""The run id is chosen by one function: the setting, else SLURM, else an id the caller knows
every process shares, else a fresh one (or None when the caller must not make one alone)."""

from __future__ import annotations

import re

import pytest

from mlaunch.settings import choose_run_id, is_run_id
from mlaunch.settings.run_id import torchrun_shared_ids

FRESH = re.compile(r"[0-9a-f]{12}")


def test_the_setting_wins_over_everything() -> None:
    assert choose_run_id("mine", {"SLURM_JOB_ID": "77"}, shared=("rdzv",)) == "mine"


def test_slurm_wins_over_shared_ids() -> None:
    assert choose_run_id(None, {"SLURM_JOB_ID": " 77 "}, shared=("rdzv",)) == "77"


def test_the_first_usable_shared_id_is_taken() -> None:
    assert choose_run_id(None, {}, shared=("", "none", "rdzv", "later")) == "rdzv"


def test_fresh_or_none_when_nothing_is_known() -> None:
    assert FRESH.fullmatch(choose_run_id(None, {}))
    assert choose_run_id(None, {}, fresh=False) is None


def test_a_fresh_id_never_reads_as_a_slurm_job_id(monkeypatch: pytest.MonkeyPatch) -> None:
    # A local run whose random id came out all digits was shown by `mlaunch status` as SLURM
    # job <id> (found when a CI run drew 890394911719): such a draw is drawn again.
    from mlaunch.settings import run_id
    from mlaunch.slurm.status import _JOB_ID

    draws = iter(["890394911719", "000000000000", "89039491171a"])
    monkeypatch.setattr(run_id.secrets, "token_hex", lambda n: next(draws))
    fresh = choose_run_id(None, {})
    assert fresh == "89039491171a" and not _JOB_ID.fullmatch(fresh)


def test_torchrun_workers_agree_without_talking() -> None:
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert choose_run_id(None, env, shared=torchrun_shared_ids(env)) == choose_run_id(
        None, dict(env), shared=torchrun_shared_ids(dict(env))
    )
    env["TORCHELASTIC_RUN_ID"] = "job-1"
    assert choose_run_id(None, env, shared=torchrun_shared_ids(env)) == "job-1"


def test_what_a_run_id_may_be() -> None:
    assert is_run_id("run.1_a-b")
    assert not is_run_id("-x") and not is_run_id(".hidden") and not is_run_id(None)
