"""The launcher's embedded OTLP receiver (gRPC and HTTP on 127.0.0.1) and relay with a spool.

- :class:`Receiver` (:mod:`.core`): queue, writer thread, per-rank files, relay, spool, counts;
  its in-process API :meth:`Receiver.ingest_traces` / :meth:`Receiver.ingest_metrics`.
- :mod:`.frontends`: the OTLP/gRPC and OTLP/HTTP listeners.
- :mod:`.upstream`: where the relay forwards (the workers' OTLP exporter settings).

When ``mlaunch train`` hosts it, and the workers' environment, is launcher policy
(:mod:`mlaunch.launcher.receiver_wiring`). The names below load on first use: a launch that
needs no receiver (mlaunch's own trainer) must not pay for protobuf and grpc.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlaunch.receiver.core import Receiver, ReceiverStats, SignalCounts
    from mlaunch.receiver.upstream import Upstream

__all__ = ["Receiver", "ReceiverStats", "SignalCounts", "Upstream"]


def __getattr__(name: str) -> Any:
    if name in ("Receiver", "ReceiverStats", "SignalCounts"):
        from mlaunch.receiver import core

        return getattr(core, name)
    if name == "Upstream":
        from mlaunch.receiver.upstream import Upstream

        return Upstream
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
