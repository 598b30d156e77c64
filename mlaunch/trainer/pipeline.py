"""Megatron-LM's non-interleaved 1F1B schedule (``forward_backward_pipelining_without_interleaving``):
warm-up forwards, a steady state of one forward + one backward, cool-down backwards.

With one stage it degenerates to forward/backward per microbatch with no communication, so the
same function serves every layout. Spans: ``megatron.microbatch.forward/backward`` around each
microbatch's compute, P2P spans from :class:`~mlaunch.trainer.parallel.P2P`, offload spans from
:class:`~mlaunch.trainer.offload.ActivationStash`; all children of ``megatron.forward_backward``.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mlaunch import telemetry
from mlaunch.model.groups import SpanGroup
from mlaunch.model.spans import Attr, SpanName
from mlaunch.trainer.data import Batch
from mlaunch.trainer.model import GPTStage
from mlaunch.trainer.offload import ActivationStash
from mlaunch.trainer.parallel import P2P

MB = SpanGroup.MICROBATCH


@dataclass
class StepContext:
    """What the schedule needs besides the batch."""

    model: GPTStage
    p2p: P2P
    autocast: object  # a callable returning the autocast context manager
    loss_scale: float = 1.0
    offload: bool = False
    #: What offload keeps resident (an ``offload.ParameterFilter`` built once, or the parameters).
    params: Any = ()
    #: Called just before the step's last backward (the trainer arms the gradient buckets there).
    before_last_backward: Callable[[], None] | None = None
    #: Called inside each microbatch's forward span with the microbatch id (a test hook's sleep).
    in_forward: Callable[[int], None] | None = None


@dataclass
class _InFlight:
    microbatch: int
    input: torch.Tensor | None
    output: torch.Tensor
    stash: ActivationStash | None


def _forward(
    ctx: StepContext,
    batch: Batch,
    i: int,
    num_micro: int,
    x: torch.Tensor | None,
    loss_sum: list[torch.Tensor],
) -> _InFlight:
    model = ctx.model
    stash = ActivationStash(ctx.p2p.device, ctx.params) if ctx.offload else None
    with telemetry.device_span(MB, SpanName.MICROBATCH_FORWARD, {Attr.MICROBATCH_ID: i}):
        if ctx.in_forward is not None:
            ctx.in_forward(i)
        hooks = stash.hooks() if stash is not None else contextlib.nullcontext()
        with hooks, ctx.autocast():
            inp = batch.tokens[i] if model.is_first else x
            targets = batch.targets[i] if model.is_last else None
            out = model(inp, targets)
        if model.is_last:
            # Each microbatch contributes 1/N of the iteration's mean loss (and gradient).
            out = out / num_micro
            loss_sum.append(out.detach())
    if stash is not None:
        stash.offload()
    return _InFlight(i, x, out, stash)


def _backward(
    ctx: StepContext, job: _InFlight, output_grad: torch.Tensor | None, num_micro: int
) -> torch.Tensor | None:
    if job.microbatch == num_micro - 1 and ctx.before_last_backward is not None:
        ctx.before_last_backward()  # backwards run in microbatch order: this one is the last
    if job.stash is not None:
        job.stash.reload()
    with telemetry.device_span(
        MB, SpanName.MICROBATCH_BACKWARD, {Attr.MICROBATCH_ID: job.microbatch}
    ):
        if output_grad is None:  # last stage: the output is the loss
            torch.autograd.backward(job.output * ctx.loss_scale)
        else:
            torch.autograd.backward(job.output, grad_tensors=output_grad)
    job.stash = None  # frees the saved activations
    return job.input.grad if job.input is not None else None


def forward_backward_1f1b(
    ctx: StepContext, batch: Batch, num_micro: int, stage: int, pp: int
) -> torch.Tensor | None:
    """Run forward and backward of ``num_micro`` microbatches; returns this stage's summed loss
    (last stage) as a device tensor, or None on other stages."""
    p2p = ctx.p2p
    losses: list[torch.Tensor] = []
    num_warmup = min(pp - stage - 1, num_micro)
    num_steady = num_micro - num_warmup
    in_flight: deque[_InFlight] = deque()

    # Warm-up: forwards only, filling the pipeline.
    for i in range(num_warmup):
        x = p2p.recv_forward(i)
        job = _forward(ctx, batch, i, num_micro, x, losses)
        p2p.send_forward(job.output)
        in_flight.append(job)

    # Steady state: one forward, one backward.
    x = p2p.recv_forward(num_warmup) if num_steady > 0 else None
    for k in range(num_steady):
        i = num_warmup + k
        job = _forward(ctx, batch, i, num_micro, x, losses)
        output_grad = p2p.send_forward_recv_backward(job.output)
        in_flight.append(job)
        input_grad = _backward(ctx, in_flight.popleft(), output_grad, num_micro)
        if k == num_steady - 1:
            x = None
            p2p.send_backward(input_grad)
        else:
            x = p2p.send_backward_recv_forward(input_grad, i + 1)

    # Cool-down: the remaining backwards.
    for _ in range(num_warmup):
        output_grad = p2p.recv_backward()
        input_grad = _backward(ctx, in_flight.popleft(), output_grad, num_micro)
        p2p.send_backward(input_grad)

    return torch.stack(losses).sum() if losses else None


@torch.no_grad()
def forward_only(ctx: StepContext, batch: Batch, num_micro: int) -> torch.Tensor | None:
    """Evaluation: microbatches flow through the pipeline forward only, with no spans below
    ``megatron.evaluate.step`` (the P2P and layer spans belong to training iterations)."""
    model, p2p = ctx.model, ctx.p2p
    losses = []
    with telemetry.suppressed():
        for i in range(num_micro):
            x = p2p.recv_forward(i)
            with ctx.autocast():
                out = model(
                    batch.tokens[i] if model.is_first else x,
                    batch.targets[i] if model.is_last else None,
                )
            if model.is_last:
                losses.append(out.detach() / num_micro)
            else:
                p2p.send_forward(out)
    return torch.stack(losses).sum() if losses else None
