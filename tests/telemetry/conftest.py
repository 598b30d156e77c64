"""Fixtures for the telemetry runtime tests: settings from a fake environment, a fresh telemetry
state per test, and helpers to read what the file exporter wrote."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from mlaunch import telemetry
from mlaunch.settings import load_telemetry_settings

BASE_ENV = {
    "MEGATRON_OTEL_ENABLED": "1",
    "MEGATRON_OTEL_SPAN_GROUPS": "all",
    "MEGATRON_OTEL_EXPORT_STRATEGY": "all_ranks",
    "MEGATRON_OTEL_RUN_ID": "testrun",
    "MEGATRON_OTEL_EXPORTER": "file",
}


@pytest.fixture
def make_settings() -> Callable[..., Any]:
    """``make_settings(KEY=value, ...)``: telemetry settings from BASE_ENV plus the given variables
    (keys without a prefix get ``MEGATRON_OTEL_``; ``OTEL_*`` keys are taken as they are)."""

    def make(**env: str) -> Any:
        environ = dict(BASE_ENV)
        for key, value in env.items():
            name = key if key.startswith("OTEL_") else "MEGATRON_OTEL_" + key
            environ[name] = str(value)
        return load_telemetry_settings(environ=environ)

    return make


@pytest.fixture(autouse=True)
def _fresh_telemetry() -> Iterator[None]:
    """Every test starts and ends with telemetry shut down."""
    telemetry.shutdown(1.0)
    yield
    telemetry.shutdown(1.0)
