"""Rank export strategies: exactly their arithmetic (the md5 rule included), so a user can predict
which ranks export."""

from __future__ import annotations

import hashlib
import sys
import textwrap

import pytest

from mlaunch.model import (
    ExportStrategy,
    StrategyError,
    exporting_ranks,
    load_strategy,
    should_export,
)
from mlaunch.model.strategies import format_ranks, rank_hash_fraction


def test_single_rank_defaults_to_the_last_rank() -> None:
    assert exporting_ranks("single_rank", 8) == [7]
    assert exporting_ranks("single_rank", 8, export_rank=3) == [3]


def test_all_ranks() -> None:
    assert exporting_ranks(ExportStrategy.ALL_RANKS, 4) == [0, 1, 2, 3]


def test_sampled_uses_the_md5_rule_exactly() -> None:
    assert exporting_ranks("sampled", 8, sample_rate=0.1) == [3, 5, 6]
    for rank in range(64):
        expected = int(hashlib.md5(str(rank).encode()).hexdigest(), 16) % 10000 / 10000
        assert rank_hash_fraction(rank) == expected
    assert exporting_ranks("sampled", 16, sample_rate=0.0) == []
    assert exporting_ranks("sampled", 16, sample_rate=1.0) == list(range(16))


def test_sampled_is_deterministic_and_monotonic_in_the_rate() -> None:
    low = set(exporting_ranks("sampled", 256, sample_rate=0.2))
    high = set(exporting_ranks("sampled", 256, sample_rate=0.5))
    assert low <= high
    assert low == set(exporting_ranks("sampled", 256, sample_rate=0.2))


def test_first_rank_per_node() -> None:
    assert exporting_ranks("first_rank_per_node", 8, nproc_per_node=4) == [0, 4]
    assert should_export("first_rank_per_node", rank=5, world_size=8, local_rank=0)


def test_unknown_strategy_suggests_the_closest() -> None:
    with pytest.raises(StrategyError, match="did you mean 'all_ranks'") as caught:
        load_strategy("all_rank")
    assert caught.value.suggestion == "all_ranks"  # the word itself, for structured problems
    with pytest.raises(StrategyError) as far:
        load_strategy("zzz")
    assert far.value.suggestion is None


def test_settings_name_the_exporting_ranks_of_their_run() -> None:
    from mlaunch.settings import load_settings

    flags = {"launch.nnodes": 2, "launch.nproc_per_node": 4, "training.global_batch_size": 16}
    settings = load_settings(
        flags={**flags, "telemetry.export_strategy": "first_rank_per_node"}, environ={}
    )
    assert settings.exporting_ranks() == [0, 4]
    assert settings.exporting_ranks(4) == [0]  # a smaller world (doctor's worker probe)
    assert load_settings(flags=flags, environ={}).exporting_ranks() == [7]


def test_custom_strategy_from_module_path(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_strategies.py").write_text(
        textwrap.dedent(
            """
            def even(info):
                return info.rank % 2 == 0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert exporting_ranks("my_strategies:even", 6) == [0, 2, 4]
        with pytest.raises(StrategyError, match="no callable 'odd'"):
            load_strategy("my_strategies:odd")
        with pytest.raises(StrategyError, match="cannot import module"):
            load_strategy("no_such_module_xyz:even")
    finally:
        sys.modules.pop("my_strategies", None)


def test_rank_lists_format_as_runs() -> None:
    assert format_ranks([5, 0, 1, 2, 2]) == "0-2, 5"
    assert format_ranks([3]) == "3"
    assert format_ranks([]) == ""


def test_a_scattered_set_is_summed_up_within_a_width() -> None:
    odd = range(1, 400, 2)
    assert format_ranks(odd, 30) == "200 in 1-399: 1, 3, 5, 7, ..."
    assert len(format_ranks(odd, 30)) <= 30
    assert format_ranks(odd, 5) == "200 in 1-399"  # numbers are never cut, even past the width
    assert format_ranks([1, 2, 3, 9], 30) == "1-3, 9"  # what fits is listed in full
