"""A ``--script`` worker that traces through ``mlaunch.telemetry`` (not nemo-lens), for
``mlaunch train --script`` tests: no torch, one ``megatron.train`` block of iterations with a layer
span in each, until the file named by ``SCRIPT_STOP_FILE`` exists (so a test decides when it ends,
whatever the machine's load).

Rank 0 writes one ``progress.jsonl`` line per iteration (what ``mlaunch trace capture`` waits
for, and whose step time sets a live capture's lead). At the end every rank writes ``script-worker-rank{R}.json``: ``iterations``, ``threads``
(the names of its threads), ``sitecustomize`` (the file Python's ``site`` imported, or null),
``user_sitecustomize`` (what a user's own sitecustomize set, if it ran) and ``nemo_lens``
(whether nemo-lens was ever imported).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from mlaunch import telemetry
from mlaunch.model.groups import SpanGroup as G
from mlaunch.model.spans import Attr
from mlaunch.model.spans import SpanName as S

#: Sleep per iteration, seconds.
ITER_SECONDS = float(os.environ.get("SCRIPT_ITER_SECONDS", "0.05"))


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run_dir = Path(os.environ["MLAUNCH_RUN_DIR"])
    stop = Path(os.environ["SCRIPT_STOP_FILE"])
    iterations = 0
    with telemetry.setup(rank=rank, world_size=world, local_rank=int(os.environ["LOCAL_RANK"])):
        telemetry.set_iteration(1)
        with telemetry.span(G.JOB, S.TRAIN):
            while not stop.exists() and iterations < 100_000:
                iterations += 1
                telemetry.set_iteration(iterations)
                attrs = {Attr.ITERATION: iterations}
                with (
                    telemetry.span(G.STEP, S.ITERATION, attrs=attrs),
                    telemetry.span(G.LAYER, S.LAYER_FORWARD),
                ):
                    time.sleep(ITER_SECONDS)
                if rank == 0:
                    with open(run_dir / "progress.jsonl", "a") as f:
                        line = {"iteration": iterations, "loss": 1.0,
                                "step_ms": ITER_SECONDS * 1e3}  # fmt: skip
                        f.write(json.dumps(line) + "\n")
    site = sys.modules.get("sitecustomize")
    report = {
        "iterations": iterations,
        "threads": sorted(t.name for t in threading.enumerate()),
        "sitecustomize": getattr(site, "__file__", None),
        "user_sitecustomize": os.environ.get("USER_SITECUSTOMIZE"),
        "nemo_lens": "nemo.lens" in sys.modules,
    }
    (run_dir / f"script-worker-rank{rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
