"""mlaunch: launch distributed PyTorch training with cheap, correct OpenTelemetry tracing."""

import time as _time

__version__ = "0.1.0"

#: When mlaunch started in this process (wall clock, ns): the first import of the package, which
#: the ``mlaunch`` command does before anything else. Not the process's creation: a wrapper that
#: ``exec``s mlaunch (a batch script, ``bash -c 'sleep 15; exec mlaunch train ...'``) keeps its
#: process, and the time it spent before the exec is not mlaunch's (the job span starts here).
STARTED_NS = _time.time_ns()
