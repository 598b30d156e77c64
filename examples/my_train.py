"""Your own training script, traced by mlaunch: a tiny character-level bigram model in plain
PyTorch, data parallel over torch.distributed (gloo on CPU), with mlaunch's telemetry API.

Launch it (telemetry on, every rank exporting to files in the run directory), then open its
report:

    mlaunch train --script examples/my_train.py --megatron-args --nproc-per-node 2 --train-iters 30 \\
        --otel-span-groups per_step --otel-export-strategy all_ranks --run-dir runs/my-run
    mlaunch trace report runs/my-run        # writes runs/my-run/report.html; open it offline

Instrumentation is three habits: wrap the phases in ``telemetry.span(group, name)`` (the span
names of mlaunch's catalogue line up with Megatron-LM dashboards; your own names work too and
show as group "other"), call ``telemetry.set_iteration(it)`` before each step, and write one
``progress.jsonl`` line per iteration for the report's training curves. A span whose group is
off costs a set lookup, so the calls can stay in production code.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mlaunch import telemetry
from mlaunch.model.groups import SpanGroup as G
from mlaunch.model.spans import Attr, SpanName

TEXT = ("the quick brown fox jumps over the lazy dog. " * 200).encode()


def main() -> None:
    # `mlaunch train --megatron-args` passes its model/training flags (Megatron-LM's names).
    parser = argparse.ArgumentParser()
    parser.add_argument("--train-iters", type=int, default=30)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--peak-lr", type=float, default=0.2)  # its own flag: an embedding
    args, _ = parser.parse_known_args()

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    # Settings come from the environment mlaunch wrote (MEGATRON_OTEL_*); the resource says
    # what the report's header shows about this job.
    telemetry.setup(
        rank=rank, world_size=world, local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        resource={"dl.tensor_parallel.size": 1, "dl.pipeline_parallel.size": 1,
                  "dl.pipeline_parallel.rank": 0,
                  "dl.data_parallel.size": world, "dl.data_parallel.rank": rank,
                  "dl.batch_size": args.micro_batch_size * world,
                  "dl.sequence_length": args.seq_length},
    )  # fmt: skip
    run_dir = Path(os.environ.get("MLAUNCH_RUN_DIR", "."))
    progress = open(run_dir / "progress.jsonl", "a") if rank == 0 else None  # noqa: SIM115

    # Megatron-LM's tree: a start-up trace, then the loop in megatron.train blocks. With one
    # megatron.train open, set_iteration starts a new trace every K iterations
    # (MEGATRON_OTEL_TRACE_SEGMENT_ITERS); no worker span covers the whole run (the launcher's
    # job trace does).
    with telemetry.span(G.JOB, SpanName.STARTUP):
        with telemetry.span(G.MODEL_INIT, SpanName.MODEL_INIT):
            torch.manual_seed(0)
            model = torch.nn.Embedding(256, 256)  # logits of the next byte given this one
            opt = torch.optim.Adam(model.parameters(), lr=args.peak_lr)
        data = torch.tensor(list(TEXT), dtype=torch.long)
        gen = torch.Generator().manual_seed(rank)

    telemetry.set_iteration(1)
    with telemetry.span(G.JOB, SpanName.TRAIN):
        for it in range(1, args.train_iters + 1):
            telemetry.set_iteration(it)  # the block's trace id, the same on every rank
            lr = args.peak_lr * 0.5 * (1 + math.cos(math.pi * (it - 1) / args.train_iters))
            for g in opt.param_groups:
                g["lr"] = lr
            t0 = time.perf_counter()
            with telemetry.span(G.STEP, SpanName.ITERATION, attrs={Attr.ITERATION: it}) as step:
                with telemetry.span(G.DATA_LOADING, SpanName.GET_BATCH):
                    starts = torch.randint(len(data) - args.seq_length - 1,
                                           (args.micro_batch_size,), generator=gen)  # fmt: skip
                    x = torch.stack([data[s : s + args.seq_length] for s in starts])
                    y = torch.stack([data[s + 1 : s + args.seq_length + 1] for s in starts])
                with telemetry.span(G.FORWARD_BACKWARD, SpanName.FORWARD_BACKWARD):
                    loss = torch.nn.functional.cross_entropy(model(x).view(-1, 256), y.view(-1))
                    opt.zero_grad()
                    loss.backward()
                # Your own span name: the report shows it (group "other") with its attributes.
                with telemetry.span(G.COMMUNICATION, "my_train.allreduce", ranks=world):
                    if world > 1:
                        for p in model.parameters():
                            dist.all_reduce(p.grad)
                            p.grad /= world
                with telemetry.span(G.OPTIMIZER, SpanName.OPTIMIZER):
                    opt.step()
                value = loss.item()  # a sync point, once per step
                step.set_attribute(Attr.LOSS.value, value)  # a no-op when the group is off
            step_ms = (time.perf_counter() - t0) * 1e3
            tokens_per_sec = args.micro_batch_size * world * args.seq_length / (step_ms / 1e3)
            telemetry.record_step(it, step_ms=step_ms, loss=value, learning_rate=lr,
                                  tokens_per_sec=tokens_per_sec)  # fmt: skip
            if progress is not None:
                progress.write(json.dumps({
                    "iteration": it, "train_iters": args.train_iters, "loss": value,
                    "lr": lr, "tokens_per_sec": tokens_per_sec, "step_ms": step_ms,
                    "perplexity": math.exp(value),
                }) + "\n")  # fmt: skip
    if progress is not None:
        progress.close()
    telemetry.shutdown()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
