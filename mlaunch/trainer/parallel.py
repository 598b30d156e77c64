"""Process layout and communication: data-parallel and pipeline groups, point-to-point exchange
between stages (with the sender's span context riding along), and the data-parallel gradient
all-reduce.

Rank layout follows Megatron-LM with TP = 1: ``rank = pp_rank * dp + dp_rank``, so the ranks of
one pipeline stage are contiguous and form its data-parallel group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlaunch import telemetry
from mlaunch.model.groups import SpanGroup
from mlaunch.model.spans import Attr, SpanName

COMM = SpanGroup.COMMUNICATION


@dataclass
class Topology:
    """Where this process sits: its ranks, its groups and its device."""

    rank: int
    world_size: int
    local_rank: int
    pp: int
    dp: int
    pp_rank: int
    dp_rank: int
    device: torch.device
    distributed: bool
    dp_group: object | None = None
    embed_group: object | None = None  # first + last stage of this pipeline (tied embeddings)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_rank(self) -> int:
        return (self.pp_rank - 1) * self.dp + self.dp_rank

    @property
    def next_rank(self) -> int:
        return (self.pp_rank + 1) * self.dp + self.dp_rank

    @property
    def owns_loss(self) -> bool:
        """The rank that writes progress records: last stage, data-parallel rank 0."""
        return self.is_last_stage and self.dp_rank == 0


def init_distributed(pp: int) -> Topology:
    """Join the job torchrun started (gloo on CPU, NCCL on GPU) and build the groups; a plain
    ``python -m mlaunch.trainer`` runs as a single process without a process group."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    distributed = "MASTER_ADDR" in os.environ
    if distributed and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        # torchrun keeps one TCP store for all restarts of a job (shared with its rendezvous), so
        # the keys a killed attempt wrote (gloo's peer addresses among them) are still there when
        # the group restarts, and a restarted rank can read a dead peer's address and fail with
        # "connection refused". A per-attempt key prefix gives every attempt a clean store.
        store, rank, world_size = next(dist.rendezvous("env://"))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
        dist.init_process_group(
            backend, store=dist.PrefixStore(f"mlaunch/attempt_{attempt}", store), rank=rank,
            world_size=world_size, device_id=device if device.type == "cuda" else None,
        )  # fmt: skip
    dp = world_size // pp
    topo = Topology(
        rank, world_size, local_rank, pp, dp, rank // dp, rank % dp, device, distributed
    )
    if distributed:
        # new_group is collective over the whole world: every rank creates every group, in order.
        for stage in range(pp):
            group = dist.new_group(list(range(stage * dp, (stage + 1) * dp)))
            if stage == topo.pp_rank:
                topo.dp_group = group
        if pp > 1:
            for d in range(dp):
                group = dist.new_group([d, (pp - 1) * dp + d])
                if d == topo.dp_rank and (topo.is_first_stage or topo.is_last_stage):
                    topo.embed_group = group
    return topo


class P2P:
    """Activations forward and gradients backward between neighbouring stages.

    Every forward message carries a 4 x int64 tensor next to the activation: the span context of
    the sender's ``megatron.p2p.send_forward`` span, so the receiver can link to it. It is sent
    even when telemetry is off (all zeros) because both sides must post the same messages and
    ranks may differ in whether they export.
    """

    def __init__(self, topo: Topology, shape: tuple[int, ...]) -> None:
        self.topo = topo
        self.shape = shape
        self.device = topo.device
        self._zero_ctx = torch.zeros(4, dtype=torch.int64, device=topo.device)

    # -- pieces ---------------------------------------------------------------------------
    def _ctx_tensor(self) -> torch.Tensor:
        values = telemetry.current_context_ints()
        if not any(values):
            return self._zero_ctx
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _recv_ops(self) -> tuple[list[dist.P2POp], torch.Tensor, torch.Tensor]:
        act = torch.empty(self.shape, dtype=torch.float32, device=self.device)
        ctx = torch.empty(4, dtype=torch.int64, device=self.device)
        ops = [
            dist.P2POp(dist.irecv, act, self.topo.prev_rank),
            dist.P2POp(dist.irecv, ctx, self.topo.prev_rank),
        ]
        return ops, act, ctx

    def _send_ops(self, output: torch.Tensor) -> list[dist.P2POp]:
        return [
            dist.P2POp(dist.isend, output.detach().float().contiguous(), self.topo.next_rank),
            dist.P2POp(dist.isend, self._ctx_tensor(), self.topo.next_rank),
        ]

    def _linked(self, ctx: torch.Tensor, microbatch: int) -> None:
        """The receiving side of the cross-stage link: a span linked to the sender's span."""
        if not telemetry.is_enabled(COMM):
            return  # skip the .tolist() (a device sync) when nobody records the span
        attrs = {Attr.PP_RANK.value: self.topo.pp_rank, Attr.DL_MICROBATCH_ID.value: microbatch}
        link = telemetry.context_from_ints(ctx.tolist())
        with telemetry.linked_span(COMM, SpanName.PP_RECV_FORWARD_LINKED, link, **attrs):
            pass

    @staticmethod
    def _wait(ops: list[dist.P2POp]) -> None:
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    # -- the exchanges the 1F1B schedule uses ---------------------------------------------
    def recv_forward(self, microbatch: int) -> torch.Tensor | None:
        if self.topo.is_first_stage:
            return None
        with telemetry.span(COMM, SpanName.P2P_RECV_FORWARD):
            ops, act, ctx = self._recv_ops()
            self._wait(ops)
        self._linked(ctx, microbatch)
        return act.requires_grad_()

    def send_forward(self, output: torch.Tensor) -> None:
        if self.topo.is_last_stage:
            return
        with telemetry.span(COMM, SpanName.P2P_SEND_FORWARD):
            self._wait(self._send_ops(output))

    def recv_backward(self) -> torch.Tensor | None:
        if self.topo.is_last_stage:
            return None
        with telemetry.span(COMM, SpanName.P2P_RECV_BACKWARD):
            grad = torch.empty(self.shape, dtype=torch.float32, device=self.device)
            self._wait([dist.P2POp(dist.irecv, grad, self.topo.next_rank)])
        return grad

    def send_backward(self, grad: torch.Tensor | None) -> None:
        if self.topo.is_first_stage:
            return
        with telemetry.span(COMM, SpanName.P2P_SEND_BACKWARD):
            self._wait([dist.P2POp(dist.isend, grad.contiguous(), self.topo.prev_rank)])

    def send_forward_recv_backward(self, output: torch.Tensor) -> torch.Tensor | None:
        """Both directions in one batch: posting the send and the receive together is what keeps
        neighbouring stages (each sending to the other) from deadlocking in the steady state."""
        if self.topo.is_last_stage:
            return None
        grad = torch.empty(self.shape, dtype=torch.float32, device=self.device)
        with telemetry.span(COMM, SpanName.P2P_SEND_FORWARD):
            ops = self._send_ops(output) + [dist.P2POp(dist.irecv, grad, self.topo.next_rank)]
            reqs = dist.batch_isend_irecv(ops)
        with telemetry.span(COMM, SpanName.P2P_RECV_BACKWARD):
            for req in reqs:
                req.wait()
        return grad

    def send_backward_recv_forward(
        self, grad: torch.Tensor | None, microbatch: int
    ) -> torch.Tensor | None:
        """The mirror image of :meth:`send_forward_recv_backward`, for the stage below."""
        if self.topo.is_first_stage:
            return None
        with telemetry.span(COMM, SpanName.P2P_SEND_BACKWARD):
            ops, act, ctx = self._recv_ops()
            reqs = dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, grad.contiguous(), self.topo.prev_rank)] + ops
            )
        with telemetry.span(COMM, SpanName.P2P_RECV_FORWARD):
            for req in reqs:
                req.wait()
        self._linked(ctx, microbatch)
        return act.requires_grad_()

    # -- untraced exchanges for evaluation and generation ------------------------------------
    def recv_forward_untraced(self) -> torch.Tensor | None:
        if self.topo.is_first_stage:
            return None
        ops, act, _ = self._recv_ops()
        self._wait(ops)
        return act

    def send_forward_untraced(self, output: torch.Tensor) -> None:
        if not self.topo.is_last_stage:
            self._wait(self._send_ops(output))

    def exchange_token(self, token: torch.Tensor | None) -> torch.Tensor:
        """Generation: the last stage hands the next token to the first stage (PP > 1)."""
        first, last = self.topo.dp_rank, (self.topo.pp - 1) * self.topo.dp + self.topo.dp_rank
        if self.topo.is_last_stage:
            self._wait([dist.P2POp(dist.isend, token, first)])
            return token
        buf = torch.empty(1, dtype=torch.int64, device=self.device)
        self._wait([dist.P2POp(dist.irecv, buf, last)])
        return buf


class GradBuffer:
    """All gradients of this stage as views into one flat buffer, so the data-parallel
    all-reduce is a single asynchronous collective (one bucket) started after the last backward.

    Autograd accumulates into an existing ``.grad`` in place, so the views stay valid; never call
    ``optimizer.zero_grad()`` (it would drop them), call :meth:`zero` instead.
    """

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        total = sum(p.numel() for p in params)
        self.flat = torch.zeros(total, dtype=torch.float32, device=params[0].device)
        offset = 0
        for p in params:
            p.grad = self.flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self._work = None

    def zero(self) -> None:
        self.flat.zero_()

    def start_all_reduce(self, group: object) -> None:
        """Launch the averaging all-reduce; returns at once (``async_op=True``)."""
        self._work = dist.all_reduce(self.flat, group=group, async_op=True)

    def finish_all_reduce(self, dp: int) -> None:
        """Wait for the all-reduce, then turn the sum into a mean."""
        self._work.wait()
        self._work = None
        self.flat.div_(dp)
