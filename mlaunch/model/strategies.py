"""Rank export strategies (which ranks export) and the md5 rank-sampling rule they share with the
rank-aware sampler."""

from __future__ import annotations

import hashlib
import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

from mlaunch.model.spec import closest_word


class ExportStrategy(StrEnum):
    """The built-in strategies."""

    SINGLE_RANK = "single_rank"
    ALL_RANKS = "all_ranks"
    SAMPLED = "sampled"
    FIRST_RANK_PER_NODE = "first_rank_per_node"


@dataclass(frozen=True, slots=True)
class RankInfo:
    """What a strategy may look at to decide whether one rank exports."""

    rank: int
    world_size: int
    local_rank: int = 0
    export_rank: int = -1
    sample_rate: float = 1.0


#: A custom strategy: ``(info) -> bool``, named as ``package.module:function``.
StrategyFn = Callable[[RankInfo], bool]


class StrategyError(ValueError):
    """A strategy name that is neither built in nor an importable ``module:function``, with the
    closest built-in name (``suggestion``, None when there is none) for a "did you mean"."""

    def __init__(self, message: str, suggestion: str | None = None) -> None:
        super().__init__(message)
        self.suggestion = suggestion


def rank_hash_fraction(rank: int) -> float:
    """``int(md5(str(rank)).hexdigest(), 16) % 10000 / 10000`` exactly, so users can predict it."""
    return int(hashlib.md5(str(rank).encode()).hexdigest(), 16) % 10000 / 10000


def rank_sampled(rank: int, rate: float) -> bool:
    """Whether ``rank`` falls under ``rate`` by the md5 rule (used by ``sampled`` and the
    rank-aware sampler)."""
    return rank_hash_fraction(rank) < rate


def _single_rank(info: RankInfo) -> bool:
    target = info.world_size - 1 if info.export_rank == -1 else info.export_rank
    return info.rank == target


_BUILTIN: dict[ExportStrategy, StrategyFn] = {
    ExportStrategy.SINGLE_RANK: _single_rank,
    ExportStrategy.ALL_RANKS: lambda info: True,
    ExportStrategy.SAMPLED: lambda info: rank_sampled(info.rank, info.sample_rate),
    ExportStrategy.FIRST_RANK_PER_NODE: lambda info: info.local_rank == 0,
}


def is_custom_strategy(name: str) -> bool:
    """Whether ``name`` is a custom ``package.module:function`` (user code), not a built-in."""
    return ":" in name


def load_strategy(name: str) -> StrategyFn:
    """The strategy function for a built-in name or a ``package.module:function`` path.

    Raises :class:`StrategyError` with a did-you-mean for unknown built-in names and a precise
    reason for custom paths that cannot be imported.
    """
    key = name.strip().lower()
    if key in ExportStrategy._value2member_map_:
        return _BUILTIN[ExportStrategy(key)]
    if not is_custom_strategy(name):
        choices = [s.value for s in ExportStrategy]
        close = closest_word(key, choices)
        hint = f" (did you mean {close!r}?)" if close else ""
        raise StrategyError(
            f"unknown export strategy {name!r}{hint}; use one of {', '.join(choices)}"
            " or a custom 'package.module:function'",
            close,
        )
    module_name, _, attr = name.strip().partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is a configuration error here
        raise StrategyError(
            f"custom export strategy {name!r}: cannot import module {module_name!r} ({exc})"
        ) from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise StrategyError(
            f"custom export strategy {name!r}: module {module_name!r} has no callable {attr!r}"
        )
    try:
        # Checked without calling it (the launcher never runs user code; each worker calls it).
        inspect.signature(fn).bind(RankInfo(0, 1))
    except TypeError as exc:
        raise StrategyError(
            f"custom export strategy {name!r} cannot be called with one RankInfo ({exc});"
            " it must take (info) and return whether the rank exports"
        ) from None
    except ValueError:  # no signature to read (some builtins): the workers will tell
        pass
    return fn


def exporting_ranks(
    strategy: str | StrategyFn,
    world_size: int,
    *,
    nproc_per_node: int | None = None,
    export_rank: int = -1,
    sample_rate: float = 1.0,
) -> list[int]:
    """The ranks that export for ``world_size`` (local rank = rank % ``nproc_per_node``)."""
    fn = load_strategy(strategy) if isinstance(strategy, str) else strategy
    per_node = nproc_per_node or world_size
    return [
        r
        for r in range(world_size)
        if fn(RankInfo(r, world_size, r % per_node, export_rank, sample_rate))
    ]


def should_export(
    strategy: str | StrategyFn,
    *,
    rank: int,
    world_size: int,
    local_rank: int = 0,
    export_rank: int = -1,
    sample_rate: float = 1.0,
) -> bool:
    """Whether this one rank exports."""
    fn = load_strategy(strategy) if isinstance(strategy, str) else strategy
    return bool(fn(RankInfo(rank, world_size, local_rank, export_rank, sample_rate)))


def format_ranks(ranks: Iterable[int], width: int | None = None) -> str:
    """Ranks (or iterations) as sorted, comma-separated runs: ``[0, 1, 2, 5]`` -> ``"0-2, 5"``
    (empty -> ``""``).

    ``width`` caps the length for a set too scattered to list in a row or a console line (every
    other iteration of a long run is thousands of characters): past it, the count and the
    extent, then as many leading runs as fit, e.g. ``"200 in 1-399: 1, 3, 5, ..."``. A number is
    never cut, so the count and the extent alone may still be longer than a tiny ``width``."""
    ordered = sorted(set(ranks))
    runs: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    full = ", ".join(runs)
    if width is None or len(full) <= width:
        return full
    text = f"{len(ordered)} in {ordered[0]}-{ordered[-1]}"
    shown: list[str] = []
    for run in runs:
        if len(f"{text}: {', '.join([*shown, run])}, ...") > width:
            break
        shown.append(run)
    return f"{text}: {', '.join(shown)}, ..." if shown else text
