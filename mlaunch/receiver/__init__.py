"""The launcher's embedded OTLP receiver (gRPC and HTTP on 127.0.0.1) and relay with a spool.

- :class:`Receiver` (:mod:`.core`): queue, writer thread, per-rank files, relay, spool, counts;
  its in-process API :meth:`Receiver.ingest_traces` / :meth:`Receiver.ingest_metrics`.
- :mod:`.frontends`: the OTLP/gRPC and OTLP/HTTP listeners.
- :mod:`.upstream`: where the relay forwards (the workers' OTLP exporter settings).
- :mod:`.wiring`: when ``mlaunch train`` hosts it and the workers' environment.
"""

from mlaunch.receiver.core import Receiver, ReceiverStats, SignalCounts
from mlaunch.receiver.upstream import Upstream

__all__ = ["Receiver", "ReceiverStats", "SignalCounts", "Upstream"]
