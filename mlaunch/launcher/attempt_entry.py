"""The worker-side entry wrapper of the launcher's job trace: sets ``TRACEPARENT`` to the current
torchrun attempt's span, then ``exec``s the real entry point.

torchrun starts every worker group with the same environment, but each attempt (restart) has its
own ``mlaunch.job.attempt`` span. torchrun does tell each worker which attempt it belongs to
(``TORCHELASTIC_RESTART_COUNT``), so the attempt's span id is derived from that number: the
launcher and this wrapper compute the same id from ``MLAUNCH_ATTEMPT_TRACE`` with no
communication. ``mlaunch train`` starts ``python -u -m mlaunch.launcher.attempt_entry ENTRY...``
where ENTRY is what torchrun would have run (``-m mlaunch.trainer ...`` or ``script.py ...``);
``os.execv`` keeps the process id, so torchrun's signals, exit codes and error files are the real
worker's. Standard library only: it adds one interpreter start-up to each worker's start, nothing
after (measured in docs/train.md).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys

from mlaunch import envcontract as ec

_HEX = re.compile(r"[0-9a-f]+")


def attempt_span_id(key: str, attempt: int) -> str:
    """The 16-hex-digit span id of attempt ``attempt`` of the job trace keyed by ``key``."""
    digest = hashlib.sha256(f"mlaunch.job.attempt/{key}/{attempt}".encode()).hexdigest()[:16]
    return digest if digest.strip("0") else "0000000000000001"  # an all-zero id is invalid


def traceparent(trace_id: str, span_id: str) -> str:
    """The W3C ``traceparent`` of a sampled span."""
    return f"00-{trace_id}-{span_id}-01"


def attempt_traceparent(spec: str, attempt: int) -> str | None:
    """``TRACEPARENT`` for attempt ``attempt`` from an ``MLAUNCH_ATTEMPT_TRACE`` value
    (``<32 hex trace id>:<key>``), or None when the value is malformed."""
    trace_id, sep, key = spec.partition(":")
    if not sep or not key or len(trace_id) != 32 or not _HEX.fullmatch(trace_id):
        return None
    return traceparent(trace_id, attempt_span_id(key, attempt))


def main(argv: list[str]) -> None:
    """Set ``TRACEPARENT`` and become ``python -u ARGV`` (never returns)."""
    spec = os.environ.get(ec.ATTEMPT_TRACE, "")
    try:
        attempt = int(os.environ.get(ec.RESTART_COUNT, "0"))
    except ValueError:
        attempt = 0
    value = attempt_traceparent(spec, attempt) if spec else None
    if value is not None:  # telemetry never stops a worker: a bad value only loses the link
        os.environ[ec.TRACEPARENT] = value
        os.environ.pop("TRACESTATE", None)  # an inherited tracestate belongs to another parent
    if not argv:
        sys.exit("usage: python -m mlaunch.launcher.attempt_entry (-m MODULE | SCRIPT) [ARGS...]")
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-u", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
