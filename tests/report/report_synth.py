"""A synthetic ``per_step`` run for the report tests and ``benchmarks/report_size.py``.

What ``MEGATRON_OTEL_SPAN_GROUPS=per_step`` emits on a PP=2 x DP=2 job (the trainer's span tree): job,
model_init, data setup, first_iteration, and per iteration train_step > get_batch,
forward_backward > P2P send/recv per microbatch (+ ``megatron.pp.recv_forward.linked`` with a link
to the sender's ``send_forward`` on stage 1), grad_sync start/finish, optimizer_step; checkpoints
and evaluation now and then. Built with :class:`support.synthetic_traces.TraceBuilder`, plus the
matching ``progress.jsonl``.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from support.synthetic_traces import SpanRef, TraceBuilder, ms, resource_attributes

from mlaunch.model.spans import Attr, SpanName

S = SpanName
PP = 2
MICROBATCHES = 4


def write_per_step_run(
    run_dir: Path,
    *,
    iterations: int = 1000,
    ranks: int = 4,
    ckpt_every: int = 250,
    eval_every: int = 100,
    seed: int = 0,
    progress: bool = True,
) -> Path:
    """Write ``telemetry/traces-rank{R}.jsonl`` for ``ranks`` ranks (stage = rank % 2) and, with
    ``progress``, ``progress.jsonl``. Rank 3 (when present) is a 10% straggler. Returns run_dir."""
    rng = random.Random(seed)
    b = TraceBuilder(world_size=ranks, run_id="synthperstep")
    for r in range(ranks):
        b.resources[r] = resource_attributes(
            r, world_size=ranks, run_id=b.run_id, pp=PP, num_layers=8,
            extra={"dl.batch_size": 64, "dl.sequence_length": 1024},
        )  # fmt: skip
    records: list[dict] = []
    sends: dict[tuple[int, int, int], SpanRef] = {}  # (rank, iteration, microbatch)
    pre = {r: b.span(r, S.STARTUP, 0, 1100, attrs={Attr.MODEL_TYPE: "gpt"}) for r in range(ranks)}
    for r in range(ranks):
        b.span(r, S.MODEL_INIT, 0, 900, parent=pre[r])
        b.span(r, S.DATALOADER, 900, 1100, parent=pre[r])
    # The block's link to start-up is left out: it would be a zero-length arrow (the block starts
    # where start-up ends), which the browser check cannot count as a drawn line.
    train = {r: b.span(r, S.TRAIN, 1100, 1101) for r in range(ranks)}
    t = 1100.1  # after data setup ends: first_iteration must not overlap it
    for it in range(1, iterations + 1):
        step_ms = {r: (10.0 + rng.random()) * (1.1 if r == 3 else 1.0) for r in range(ranks)}
        longest = max(step_ms.values())
        loss = 8.0 * math.exp(-it / 300) + 2.0 + 0.05 * rng.random()
        for r in range(ranks):
            _step(b, r, it, t, step_ms[r], train[r], loss, sends)
        if it == 1:
            for r in range(ranks):
                b.span(r, S.FIRST_ITERATION, t - 0.05, t + step_ms[r] + 0.05, parent=train[r],
                       attrs={Attr.ITERATION: 1})  # fmt: skip
        records.append({
            "iteration": it, "train_iters": iterations, "loss": loss,
            "lr": 3e-4 * min(1.0, it / 50), "grad_norm": 1.0 + 0.1 * rng.random(),
            "tokens_per_sec": 64 * 1024 / (longest / 1e3), "step_ms": longest, "skipped": False,
        })  # fmt: skip
        t += longest + 0.2
        if ckpt_every and it % ckpt_every == 0:
            for r in range(ranks):
                c = b.span(r, S.CHECKPOINT_SAVE, t, t + 30, parent=train[r],
                           attrs={Attr.ITERATION: it})  # fmt: skip
                b.span(r, S.CHECKPOINT_SAVE_STATE_DICT, t, t + 5, parent=c)
                b.span(r, S.CHECKPOINT_SAVE_IO_WRITE, t + 5, t + 30, parent=c)
            t += 30.5
        if eval_every and it % eval_every == 0:
            for r in range(ranks):
                e = b.span(r, S.EVALUATE, t, t + 8, parent=train[r], attrs={Attr.EVAL_ITERS: 2})
                b.span(r, S.EVALUATE_STEP, t, t + 4, parent=e, attrs={Attr.EVAL_ITERATION: 1})
                b.span(r, S.EVALUATE_STEP, t + 4, t + 8, parent=e, attrs={Attr.EVAL_ITERATION: 2})
            records.append({"iteration": it, "eval_loss": loss + 0.1})
            t += 8.5
    for r in range(ranks):  # the job spans end with the run, known only now
        _set_end(b, r, train[r], t + 0.5)
    b.write_run_dir(run_dir, batch=256)
    if progress:
        (run_dir / "progress.jsonl").write_text("".join(json.dumps(x) + "\n" for x in records))
    return run_dir


def _set_end(b: TraceBuilder, rank: int, ref: SpanRef, end_ms: float) -> None:
    for sp in b.spans[rank]:
        if sp["spanId"] == ref.span_id:
            sp["endTimeUnixNano"] = str(ms(end_ms))


def _step(
    b: TraceBuilder,
    rank: int,
    it: int,
    t: float,
    dur: float,
    train: SpanRef,
    loss: float,
    sends: dict[tuple[int, int, int], SpanRef],
) -> None:
    """One train_step of ``rank`` lasting ``dur`` ms from ``t``, with its per_step children."""
    stage = rank % PP
    step = b.span(rank, S.ITERATION, t, t + dur, parent=train,
                  attrs={Attr.ITERATION: it, Attr.LOSS: loss, Attr.GRAD_NORM: 1.0,
                         Attr.SKIPPED: False})  # fmt: skip
    b.span(rank, S.GET_BATCH, t, t + 0.3, parent=step)
    fb_end = t + dur - 1.6
    fb = b.span(rank, S.FORWARD_BACKWARD, t + 0.3, fb_end, parent=step,
                attrs={Attr.NUM_MICROBATCHES: MICROBATCHES})  # fmt: skip
    slot = (fb_end - t - 0.3) / MICROBATCHES
    for m in range(MICROBATCHES):
        s0 = t + 0.3 + m * slot
        if stage == 0:
            sends[(rank, it, m)] = b.span(rank, S.P2P_SEND_FORWARD, s0 + 0.2, s0 + 0.3, parent=fb)
            b.span(rank, S.P2P_RECV_BACKWARD, s0 + slot * 0.6, s0 + slot * 0.7, parent=fb)
        else:
            sender = sends.get((rank - 1, it, m))
            b.span(rank, S.P2P_RECV_FORWARD, s0 + 0.25, s0 + 0.35, parent=fb)
            b.span(rank, S.PP_RECV_FORWARD_LINKED, s0 + 0.35, s0 + 0.36, parent=fb,
                   attrs={Attr.PP_RANK: stage, Attr.DL_MICROBATCH_ID: m},
                   links=[sender] if sender else [])  # fmt: skip
            b.span(rank, S.P2P_SEND_BACKWARD, s0 + slot * 0.55, s0 + slot * 0.65, parent=fb)
    b.span(rank, S.GRAD_SYNC_START, fb_end, fb_end + 0.1, parent=step)
    b.span(rank, S.GRAD_SYNC_FINISH, fb_end + 0.1, fb_end + 0.6, parent=step)
    b.span(rank, S.OPTIMIZER, fb_end + 0.6, t + dur - 0.05, parent=step,
           attrs={Attr.GRAD_NORM: 1.0, Attr.UPDATE_SUCCESSFUL: True})  # fmt: skip
