"""Resolving a span link to the span it names, with ranks that share ids.

A span's id is unique only within its rank: under nemo-lens 0.1.0, data-parallel ranks that
seeded Python's ``random`` alike emit the same trace and span ids (Lens #28). Every reader keys
spans by rank as well as id; a link, which names only an id, resolves through
:class:`LinkTargets`, the one rule for the export, the report and the straggler analysis.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class LinkTargets(Generic[T]):
    """Linked-to spans by id, each id's spans per rank."""

    __slots__ = ("_by_id",)

    def __init__(self) -> None:
        self._by_id: dict[Hashable, dict[Hashable, T]] = {}

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def add(self, rank: Hashable, span_id: Hashable, value: T) -> None:
        """Record where the span ``span_id`` of ``rank`` is (a rank number, or any key that
        tells the ranks' processes apart, such as rank and incarnation)."""
        self._by_id.setdefault(span_id, {})[rank] = value

    def resolve(self, rank: Hashable, span_id: Hashable) -> T | None:
        """The span a link from ``rank`` to ``span_id`` names: the linking rank's own span of that
        id (Megatron-LM links a train block to its rank's previous one), else the one other rank
        that has it (a pipeline receive linked to its sender); None when no rank has it, or
        several others do (ids shared across ranks: which one is meant cannot be told)."""
        found = self._by_id.get(span_id)
        if not found:
            return None
        own = found.get(rank)
        if own is not None:
            return own
        if len(found) == 1:
            return next(iter(found.values()))
        return None
