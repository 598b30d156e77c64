"""The pure model of mlaunch: span groups, presets, spec resolution, the span catalogue and rank
export strategies; and, in their own modules, the run identity with the one table of SLURM
resource attributes (:mod:`.identity`), the trace-segment rule (:mod:`.segments`), what counts
as training text (:mod:`.corpus`) and the trained GPT's shape and size (:mod:`.gpt_shape`).
Standard library only, so every command can import it cheaply."""

from mlaunch.model.groups import (
    ALL_GROUPS,
    FINE_GRAINED_GROUPS,
    GOODPUT_GROUPS,
    GROUPS,
    PRESETS,
    GroupInfo,
    SpanGroup,
)
from mlaunch.model.spans import (
    ALIASES,
    CATALOGUE,
    GOODPUT_SPAN_NAMES,
    METRICS,
    SPANS,
    STEP_SPAN,
    Attr,
    LegacyName,
    Metric,
    ResourceAttr,
    SpanDef,
    SpanName,
    canonical_name,
    estimate_spans_per_iteration,
    region_name,
    span_def,
    text_completion_name,
)
from mlaunch.model.spec import SpanSpecError, format_groups, resolve
from mlaunch.model.strategies import (
    ExportStrategy,
    RankInfo,
    StrategyError,
    exporting_ranks,
    load_strategy,
    rank_sampled,
    should_export,
)

__all__ = [
    "ALIASES", "GOODPUT_SPAN_NAMES", "LegacyName", "STEP_SPAN", "canonical_name",
    "ALL_GROUPS", "CATALOGUE", "FINE_GRAINED_GROUPS", "GOODPUT_GROUPS", "GROUPS", "METRICS",
    "PRESETS", "SPANS", "Attr", "ExportStrategy", "GroupInfo", "Metric", "RankInfo",
    "ResourceAttr", "SpanDef", "SpanGroup", "SpanName", "SpanSpecError", "StrategyError",
    "estimate_spans_per_iteration", "exporting_ranks", "format_groups", "load_strategy",
    "rank_sampled", "region_name", "resolve", "should_export", "span_def", "text_completion_name",
]  # fmt: skip
