"""The receiver tests' clients authenticate as a job's workers do: the SDK exporters read the
token from ``OTEL_EXPORTER_OTLP_HEADERS`` (set here for every test, and inherited by the worker
subprocesses some tests start); each test's receiver is given the same token."""

from __future__ import annotations

import pytest
from support.otlp import RECEIVER_HEADERS_ENV


@pytest.fixture(autouse=True)
def _workers_token(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in RECEIVER_HEADERS_ENV.items():
        monkeypatch.setenv(key, value)
