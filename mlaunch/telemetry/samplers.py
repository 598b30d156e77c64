"""Trace samplers: the ``OTEL_TRACES_SAMPLER`` sampler, the rank-aware sampler,
and their composition (a span is kept only when both keep it).

Imports the OpenTelemetry SDK; only the runtime (exporting ranks) imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)

from mlaunch.model.strategies import rank_sampled


class RankAwareSampler(Sampler):
    """Keeps every span of a rank whose md5 hash falls under ``rate``, drops all spans of others."""

    def __init__(self, rank: int, rate: float) -> None:
        self.rank = rank
        self.rate = rate
        self.keep = rank_sampled(rank, rate)

    def should_sample(
        self, parent_context: Any, trace_id: int, name: str, *args: Any, **kwargs: Any
    ) -> SamplingResult:
        """Sample when this rank is one of the kept ranks."""
        return SamplingResult(Decision.RECORD_AND_SAMPLE if self.keep else Decision.DROP)

    def get_description(self) -> str:
        """Human-readable description."""
        return f"RankAware(rank={self.rank},rate={self.rate},keep={self.keep})"


class AllOfSampler(Sampler):
    """Keeps a span only if every inner sampler keeps it (the mlaunch composition rule)."""

    def __init__(self, samplers: Sequence[Sampler]) -> None:
        self.samplers = tuple(samplers)

    def should_sample(
        self, parent_context: Any, trace_id: int, name: str, *args: Any, **kwargs: Any
    ) -> SamplingResult:
        """DROP as soon as one sampler drops; otherwise sample with the merged attributes."""
        attributes: dict[str, Any] = {}
        for sampler in self.samplers:
            result = sampler.should_sample(parent_context, trace_id, name, *args, **kwargs)
            if not result.decision.is_sampled():
                return SamplingResult(Decision.DROP)
            if result.attributes:
                attributes.update(result.attributes)
        return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes or None)

    def get_description(self) -> str:
        """Human-readable description."""
        return "AllOf{" + ",".join(s.get_description() for s in self.samplers) + "}"


def root_trace_sampler(name: str | None, arg: float | None) -> Sampler:
    """The root-span decision of an ``OTEL_TRACES_SAMPLER`` value (names validated by settings).

    Parent-based variants and plain ones make the same decisions for mlaunch's own span trees
    (children share their root's trace id, and ratio sampling decides on the trace id), so only
    the root sampler matters; :func:`build_sampler` wraps it in ``ParentBased``.
    """
    key = (name or "parentbased_always_on").strip().lower()
    key = key.removeprefix("parentbased_")
    if key == "always_on":
        return ALWAYS_ON
    if key == "always_off":
        return ALWAYS_OFF
    if key == "traceidratio":
        return TraceIdRatioBased(1.0 if arg is None else float(arg))
    raise ValueError(f"unsupported OTEL_TRACES_SAMPLER {name!r}")


def build_sampler(
    *,
    rank: int,
    traces_sampler: str | None,
    traces_sampler_arg: float | None,
    rank_aware: bool,
    sample_rate: float,
) -> Sampler:
    """The composed sampler: ParentBased(root = rank-aware AND trace sampler)."""
    parts: list[Sampler] = []
    if rank_aware:
        parts.append(RankAwareSampler(rank, sample_rate))
    parts.append(root_trace_sampler(traces_sampler, traces_sampler_arg))
    root = parts[0] if len(parts) == 1 else AllOfSampler(parts)
    return ParentBased(root=root)
