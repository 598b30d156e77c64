"""mlaunch's telemetry runtime: the public API instrumented code uses.

SKELETON: signatures are final; bodies are no-ops until the telemetry runtime lands (issue 3).
Instrumented code (the trainer, user scripts) imports only this module; it never imports torch,
and imports the OpenTelemetry SDK lazily, only on exporting ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any


class Telemetry:
    """Handle returned by :func:`setup`."""

    enabled_groups: frozenset[str] = frozenset()
    exporting: bool = False

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Flush and stop exporters within a hard deadline; idempotent."""


def setup(
    settings: Any = None,
    *,
    rank: int,
    world_size: int,
    local_rank: int = 0,
    resource: Mapping[str, Any] | None = None,
    run_dir: str | Path | None = None,
) -> Telemetry:
    """Configure telemetry for this process (settings None = read them from the environment)."""
    return Telemetry()


def is_enabled(group: str) -> bool:
    """Whether spans of ``group`` are created in this process."""
    return False


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


_NULL = _Null()


def span(group: str, name: str, **attributes: Any) -> Any:
    """``with span(group, name, **attrs) as s:`` — ``s`` is the span, or None when the group is off."""
    return _NULL


def linked_span(group: str, name: str, carrier_or_context: Any, **attributes: Any) -> Any:
    """Like :func:`span`, with an OTel Link to the span context in ``carrier_or_context``."""
    return _NULL


def trace_region(name: str, **attributes: Any) -> Any:
    """A ``megatron.region.<name>`` marker span in the ``trace_region`` group."""
    return _NULL


def trace_fn(group: str, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: run the function inside ``span(group, name)``."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        return fn

    return deco


def set_iteration(iteration: int) -> None:
    """Tell telemetry which training iteration starts next (trace identity and re-rooting)."""


def inject(carrier: MutableMapping[str, str]) -> None:
    """Write the current span context into ``carrier`` (W3C traceparent)."""


def extract(carrier: Mapping[str, str]) -> Any:
    """Read a span context from ``carrier``; None when absent."""
    return None


def current_context_ints() -> tuple[int, int, int, int]:
    """The current span context as four signed int64 values (trace id high/low, span id, flags),
    for carrying through a tensor; all zero when no span is recording."""
    return (0, 0, 0, 0)


def context_from_ints(values: tuple[int, int, int, int] | list[int]) -> Any:
    """Inverse of :func:`current_context_ints`; None for an all-zero (absent) context."""
    return None


def record_step(
    iteration: int,
    *,
    step_ms: float,
    loss: float | None = None,
    grad_norm: float | None = None,
    learning_rate: float | None = None,
    tokens_per_sec: float | None = None,
    tflops: float | None = None,
    skipped: bool = False,
    memory_gb: float | None = None,
) -> None:
    """Record the SPEC section 5 metrics for one training iteration (exporting ranks only)."""


def shutdown(timeout_s: float | None = None) -> None:
    """Shut down the process's telemetry (idempotent)."""
