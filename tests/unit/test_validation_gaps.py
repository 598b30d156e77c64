"""Validation gaps beyond the bad-input corpus: what is now accepted (a config
with a UTF-8 byte-order mark) and what the trainer itself reports (MLAUNCH_PREEMPT_SIGNALS named as
the variable, an empty --data-path refused before any tensor exists)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlaunch.settings import SettingsError, load_settings
from mlaunch.settings.trainer_cli import build_parser, validate


def test_a_config_saved_with_a_bom_is_read(tmp_path: Path) -> None:
    cfg = tmp_path / "bom.toml"
    cfg.write_bytes(b"\xef\xbb\xbf[training]\ntrain_iters = 7\n")
    assert load_settings(config=cfg, environ={}).training.train_iters == 7


def test_a_type_error_says_got_once(tmp_path: Path) -> None:
    cfg = tmp_path / "f.toml"
    cfg.write_text("[training]\ntrain_iters = 2.5\n")
    with pytest.raises(SettingsError) as info:
        load_settings(config=cfg, environ={})
    (field, message), *_ = info.value.problems
    assert message.count("got") == 1 and "2.5" in message, message


def test_quoted_number_refused_with_the_fix(tmp_path: Path) -> None:
    cfg = tmp_path / "q.toml"
    cfg.write_text('[training]\ntrain_iters = "30"\n')
    with pytest.raises(SettingsError) as info:
        load_settings(config=cfg, environ={})
    assert "train_iters = 30" in info.value.problems[0][1]


def test_trainer_names_the_variable_not_the_flag(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("MLAUNCH_PREEMPT_SIGNALS", "SIGFOO")
    ns = build_parser().parse_args([])
    fields = [f for f, _ in validate(ns, 1)]
    assert "MLAUNCH_PREEMPT_SIGNALS" in fields and "--preempt-signals" not in fields
    monkeypatch.setenv("MLAUNCH_PREEMPT_SIGNALS", "SIGTERM")
    empty = tmp_path / "e.txt"
    empty.write_text("")
    ns = build_parser().parse_args(["--data-path", str(empty)])
    assert [m for f, m in validate(ns, 1) if f == "--data-path"] == [
        f"{str(empty)!r} is empty; give a text file with something to train on"
    ]
