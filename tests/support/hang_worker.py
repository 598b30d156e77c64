"""A 2-rank ``--script`` worker using ``mlaunch.telemetry`` whose rank 1 hangs: for the hang
watchdog's tests (``tests/integration/test_hang_watchdog.py``).

Every iteration: ``megatron.data.get_batch`` (rank 1 sleeps an hour in it at ``HANG_WORKER_AT``,
default 5, in the attempts below ``HANG_WORKER_ATTEMPTS``, default every attempt), then an
all-reduce inside ``megatron.grad_sync.finish`` (where rank 0 then waits), then rank 0 saves
"the checkpoint" (the iteration, in ``$MLAUNCH_RUN_DIR/hang-worker-checkpoint.txt``). A restarted
attempt resumes after the saved iteration and says so (``resumed after iteration N``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mlaunch import telemetry

ITERS = int(os.environ.get("HANG_WORKER_ITERS", "8"))
HANG_AT = int(os.environ.get("HANG_WORKER_AT", "5"))
HANG_ATTEMPTS = int(os.environ.get("HANG_WORKER_ATTEMPTS", "1000"))


def main() -> None:
    # torchrun's store outlives a restart; a per-attempt prefix keeps the new group from reading
    # the old one's addresses (as mlaunch's trainer does, trainer/parallel.py).
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    store, rank, world = next(dist.rendezvous("env://"))
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"attempt_{attempt}", store), rank=rank, world_size=world
    )
    checkpoint = Path(os.environ["MLAUNCH_RUN_DIR"]) / "hang-worker-checkpoint.txt"
    done = int(checkpoint.read_text()) if checkpoint.exists() else 0
    if done:
        print(f"rank {rank}: resumed after iteration {done}", flush=True)
    with telemetry.setup(rank=rank, world_size=world), telemetry.span("job", "megatron.train"):
        for it in range(done + 1, ITERS + 1):
            telemetry.set_iteration(it)
            with telemetry.span("step", "megatron.train.iteration", {"megatron.iteration": it}):
                with telemetry.span("data_loading", "megatron.data.get_batch"):
                    if rank == 1 and it == HANG_AT and attempt < HANG_ATTEMPTS:
                        time.sleep(3600)  # the hang
                grad = torch.ones(4)
                with telemetry.span("communication", "megatron.grad_sync.finish"):
                    dist.all_reduce(grad)
                time.sleep(0.1)
            if rank == 0:
                checkpoint.write_text(str(it))
            print(f"rank {rank}: iteration {it} done", flush=True)
    dist.destroy_process_group()
    print(f"rank {rank}: finished", flush=True)


if __name__ == "__main__":
    main()
