"""The worker-side entry wrapper of the launcher's job trace: sets ``TRACEPARENT`` to the current
torchrun attempt's span, then ``exec``s the real entry point.

torchrun starts every worker group with the same environment, but each attempt (restart) has its
own ``mlaunch.job.attempt`` span. torchrun does tell each worker which attempt it belongs to
(``TORCHELASTIC_RESTART_COUNT``), so the attempt's span id is derived from that number: the
launcher and this wrapper compute the same id from ``MLAUNCH_ATTEMPT_TRACE`` with no
communication.

``mlaunch train`` has torchrun start ``python -S -u .../attempt_entry.py ENTRY...`` (torchrun's
``--no-python``), where ENTRY is what torchrun would have run (``-m mlaunch.trainer ...`` or
``script.py ...``), and this file ``os.execv``s ``python -u ENTRY...``: the same process id, so
torchrun's signals, exit codes and error files are the real worker's.

Every worker pays for this file's start-up, so it runs without ``site`` (``-S``: on a machine with
many ``.pth`` files ``site`` alone costs tens of milliseconds) and imports only ``os`` and
``sys`` - hence the variable names below are copies of :mod:`mlaunch.envcontract`'s (a unit test
pins them equal) and the span id is arithmetic, not a hash. Measured cost: docs/train.md.
"""

import os
import sys

#: Copies of ``envcontract.ATTEMPT_TRACE``, ``RESTART_COUNT``, ``TRACEPARENT`` and the two
#: ``LAUNCH_SCRIPT_*_TIME`` names (this file cannot import mlaunch without ``site``;
#: ``tests/unit/test_jobtrace.py`` keeps them equal).
ATTEMPT_TRACE = "MLAUNCH_ATTEMPT_TRACE"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TRACEPARENT = "TRACEPARENT"
LAUNCH_TIMES = ("LENS_LAUNCH_SCRIPT_START_TIME", "LENS_LAUNCH_SCRIPT_PRESRUN_TIME")
#: A copy of ``mlaunch.rundir.layout.WORKER_RANK_FILE`` (the same unit test keeps it equal), and
#: torchrun's variables naming the worker's error file (in its log folder) and its global rank.
WORKER_RANK_FILE = "rank"
ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"
RANK_VAR = "RANK"


def write_rank(environ: "os._Environ[str] | dict[str, str]") -> None:
    """Write the worker's global rank into its log folder (beside torchrun's error file), so
    ``mlaunch logs`` knows whose output a folder holds: torchrun's rendezvous may number a
    node's ranks otherwise than its node rank says. Never stops the worker."""
    error_file, rank = environ.get(ERROR_FILE_VAR), environ.get(RANK_VAR)
    if not error_file or rank is None:
        return
    try:
        with open(os.path.join(os.path.dirname(error_file), WORKER_RANK_FILE), "w") as fh:
            fh.write(rank)
    except OSError:
        pass


def attempt_span_id(base: str, attempt: int) -> str:
    """The 16-hex-digit span id of attempt ``attempt``: ``base`` (16 hex digits, random or
    derived by the launcher) plus the attempt number, modulo 2**64 (never the invalid 0)."""
    return f"{(int(base, 16) + attempt) % 2**64 or 1:016x}"


def traceparent(trace_id: str, span_id: str) -> str:
    """The W3C ``traceparent`` of a sampled span."""
    return f"00-{trace_id}-{span_id}-01"


def _is_hex(text: str, length: int) -> bool:
    if len(text) != length:
        return False
    try:
        int(text, 16)
    except ValueError:
        return False
    return text == text.lower()


def attempt_traceparent(spec: str, attempt: int) -> str | None:
    """``TRACEPARENT`` for attempt ``attempt`` from an ``MLAUNCH_ATTEMPT_TRACE`` value
    (``<32 hex trace id>:<16 hex base span id>``), or None when the value is malformed."""
    trace_id, _, base = spec.partition(":")
    if not (_is_hex(trace_id, 32) and _is_hex(base, 16)):
        return None
    return traceparent(trace_id, attempt_span_id(base, attempt))


def main(argv: list[str]) -> None:
    """Set ``TRACEPARENT`` (and drop the launch stamps after a restart), then become
    ``python -u ARGV`` (never returns)."""
    try:
        attempt = int(os.environ.get(RESTART_COUNT, "0"))
    except ValueError:
        attempt = 0
    value = attempt_traceparent(os.environ.get(ATTEMPT_TRACE, ""), attempt)
    if value is not None:  # telemetry never stops a worker: a bad value only loses the link
        os.environ[TRACEPARENT] = value
        os.environ.pop("TRACESTATE", None)  # an inherited tracestate belongs to another parent
    if attempt > 0:
        # The launch stamps are the first attempt's: a restarted worker's start-up began when
        # torchrun restarted it (the launcher's attempt span and goodput's requeue cover the gap),
        # and Megatron-LM would backdate this start-up to the launch (as it drops them itself
        # on a restarted NVRx cohort, whose stamps are as stale).
        for name in LAUNCH_TIMES:
            os.environ.pop(name, None)
    if not argv:
        sys.exit("usage: python -S attempt_entry.py (-m MODULE | SCRIPT) [ARGS...]")
    write_rank(os.environ)
    os.execv(sys.executable, [sys.executable, "-u", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
