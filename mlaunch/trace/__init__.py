"""Reading exported traces without a backend: ``mlaunch trace summary|export|goodput``.

Everything here streams OTLP/JSON lines (see :mod:`mlaunch.trace.reader`) and imports neither
torch nor the OpenTelemetry SDK.
"""
