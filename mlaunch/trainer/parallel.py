"""Process layout and communication: data-parallel and pipeline groups, point-to-point exchange
between stages (with the sender's span context riding along), and the data-parallel gradient
all-reduce.

Rank layout follows Megatron-LM with TP = 1: ``rank = pp_rank * dp + dp_rank``, so the ranks of
one pipeline stage are contiguous and form its data-parallel group.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlaunch import envcontract, telemetry
from mlaunch.model.groups import SpanGroup
from mlaunch.model.spans import Attr, SpanName
from mlaunch.settings.trainer_cli import PROG

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


def device_problem(
    environ: dict[str, str] | os._Environ[str],
    cuda_available: Callable[[], bool] = torch.cuda.is_available,
    device_count: Callable[[], int] = torch.cuda.device_count,
) -> str | None:
    """Why this worker must not start on the device ``mlaunch train --device`` asked for, or None.

    With ``--device cuda`` a worker without CUDA used to fall back to CPU and gloo silently while
    the summary said cuda; and ``nproc_per_node`` larger than the visible GPU count would put two
    ranks on one GPU (NCCL refuses that, late and obscurely). The CUDA probes are parameters so a
    CPU test can fake a machine with GPUs.

    Auto mode (no ``--device cuda``) uses the GPUs when the worker sees any, rank ``LOCAL_RANK``
    on ``cuda:LOCAL_RANK``: with more local ranks than GPUs it refuses too, rather than fall back
    to CPU. The ranks of a node would agree, but another node with enough GPUs would pick NCCL
    where this one picked gloo, and the job would hang; ``--device cpu`` is the way to run more
    processes than GPUs."""
    local_world = int(environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if environ.get(envcontract.DEVICE) != "cuda":
        if local_world == 1 or not cuda_available():
            return None
        count = device_count()
        if local_world <= count:
            return None
        return (
            f"{local_world} processes on this node, but it sees {count} GPU(s) and the device is "
            "auto (the GPUs, one process each); lower --nproc-per-node, use more GPUs, "
            "or --device cpu"
        )
    if not cuda_available():
        return (
            "--device cuda, but this worker sees no CUDA device (torch.cuda.is_available() is "
            f"False; torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
            f"{environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}); use --device cpu or auto"
        )
    count = device_count()
    if local_world > count:
        return (
            f"--nproc-per-node {local_world} with --device cuda, but this node sees {count} "
            "GPU(s): one process per GPU; lower --nproc-per-node or use more GPUs"
        )
    return None


def init_distributed(pp: int) -> Topology:
    """Join the job torchrun started (gloo on CPU, NCCL on GPU) and build the groups; a plain
    ``python -m mlaunch.trainer`` runs as a single process without a process group.

    A device the launcher asked for and this worker cannot honour stops it here, before any
    process group exists, with one line and exit status 2 (as bad input does)."""
    problem = device_problem(os.environ)
    if problem is not None:
        print(f"{PROG}: error: device: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(2)
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


class PinnedRows:
    """Rows of 4 x int64 in page-locked host memory, handed out one per message within a step and
    all given back at the step's sync point (:meth:`release`), when every asynchronous copy from or
    into them has run. A row is never reused before that, so no copy needs a sync of its own; when
    a step uses more rows than there are, a bigger block is allocated (the old one stays alive until
    the release)."""

    def __init__(self) -> None:
        self._block: torch.Tensor | None = None
        self._used = 0
        self._retired: list[torch.Tensor] = []

    def row(self) -> torch.Tensor:
        block = self._block
        if block is None or self._used == block.shape[0]:
            if block is not None:
                self._retired.append(block)
            rows = 64 if block is None else 2 * block.shape[0]
            block = self._block = torch.zeros((rows, 4), dtype=torch.int64, pin_memory=True)
            self._used = 0
        self._used += 1
        return block[self._used - 1]

    def release(self) -> None:
        self._used = 0
        self._retired.clear()


class P2P:
    """Activations forward and gradients backward between neighbouring stages.

    Every forward message carries a 4 x int64 tensor next to the activation: the span context of
    the sender's ``megatron.p2p.send_forward`` span, so the receiver can link to it. It is sent
    even when telemetry is off (all zeros) because both sides must post the same messages and
    ranks may differ in whether they export.

    On CUDA the context never costs a sync: the sender fills a pinned host row and copies it
    ``non_blocking``; the receiver copies what arrived into a pinned host row the same way and
    reads it only after the step's sync point (the link of ``megatron.pp.recv_forward.linked`` is
    resolved then, by ``telemetry.resolve_device_spans``). On CPU (gloo) the tensors are host
    tensors already and the same deferred path runs without copies.
    """

    def __init__(self, topo: Topology, shape: tuple[int, ...]) -> None:
        self.topo = topo
        self.shape = shape
        self.device = topo.device
        self._zero_ctx = torch.zeros(4, dtype=torch.int64, device=topo.device)
        self._cuda = topo.device.type == "cuda"
        self._rows = PinnedRows() if self._cuda else None

    def after_sync(self) -> None:
        """The step's sync point has passed: every staged context copy has run."""
        if self._rows is not None:
            self._rows.release()

    # -- pieces ---------------------------------------------------------------------------
    def _ctx_tensor(self) -> torch.Tensor:
        values = telemetry.current_context_ints()
        if not any(values):
            return self._zero_ctx
        if self._rows is None:
            return torch.tensor(values, dtype=torch.int64)
        row = self._rows.row()
        row.numpy()[:] = values
        return row.to(self.device, non_blocking=True)

    def _recv_ops(self) -> tuple[list[dist.P2POp], torch.Tensor, torch.Tensor]:
        act = torch.empty(self.shape, dtype=torch.float32, device=self.device)
        ctx = torch.empty(4, dtype=torch.int64, device=self.device)
        ops = [
            dist.P2POp(dist.irecv, act, self.topo.prev_rank),
            dist.P2POp(dist.irecv, ctx, self.topo.prev_rank),
        ]
        return ops, act, ctx

    def _send_ops(self, output: torch.Tensor) -> list[dist.P2POp]:
        # Inside telemetry.suppressed() (evaluation, generation) the context is all zeros, so
        # the shared zero tensor goes: nobody links to those exchanges, and no staging row is
        # taken that only the next training step's sync would give back.
        ctx = self._ctx_tensor()
        return [
            dist.P2POp(dist.isend, output.detach().float().contiguous(), self.topo.next_rank),
            dist.P2POp(dist.isend, ctx, self.topo.next_rank),
        ]

    def _linked(self, ctx: torch.Tensor, microbatch: int) -> None:
        """The receiving side of the cross-stage link: a span linked to the sender's span, its
        link read from the received context after the step's sync point (never a sync here).
        Skipped when the group is off or suppressed: no staging row is taken then."""
        if not telemetry.is_enabled(COMM):
            return
        host = ctx
        if self._rows is not None:
            host = self._rows.row()
            host.copy_(ctx, non_blocking=True)  # ordered after the receive on this stream
        attrs = {Attr.PP_RANK: self.topo.pp_rank, Attr.DL_MICROBATCH_ID: microbatch}
        with telemetry.deferred_linked_span(
            COMM, SpanName.PP_RECV_FORWARD_LINKED, host.tolist, attrs
        ):
            pass

    @staticmethod
    def _wait(ops: list[dist.P2POp]) -> None:
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    # -- the exchanges the 1F1B schedule uses ---------------------------------------------
    def recv_forward(self, microbatch: int) -> torch.Tensor | None:
        if self.topo.is_first_stage:
            return None
        with telemetry.device_span(COMM, SpanName.P2P_RECV_FORWARD):
            ops, act, ctx = self._recv_ops()
            self._wait(ops)
        self._linked(ctx, microbatch)
        return act.requires_grad_()

    def send_forward(self, output: torch.Tensor) -> None:
        if self.topo.is_last_stage:
            return
        with telemetry.device_span(COMM, SpanName.P2P_SEND_FORWARD):
            self._wait(self._send_ops(output))

    def recv_backward(self) -> torch.Tensor | None:
        if self.topo.is_last_stage:
            return None
        with telemetry.device_span(COMM, SpanName.P2P_RECV_BACKWARD):
            grad = torch.empty(self.shape, dtype=torch.float32, device=self.device)
            self._wait([dist.P2POp(dist.irecv, grad, self.topo.next_rank)])
        return grad

    def send_backward(self, grad: torch.Tensor | None) -> None:
        if self.topo.is_first_stage:
            return
        with telemetry.device_span(COMM, SpanName.P2P_SEND_BACKWARD):
            self._wait([dist.P2POp(dist.isend, grad.contiguous(), self.topo.prev_rank)])

    def send_forward_recv_backward(self, output: torch.Tensor) -> torch.Tensor | None:
        """Both directions in one batch: posting the send and the receive together is what keeps
        neighbouring stages (each sending to the other) from deadlocking in the steady state."""
        if self.topo.is_last_stage:
            return None
        grad = torch.empty(self.shape, dtype=torch.float32, device=self.device)
        with telemetry.device_span(COMM, SpanName.P2P_SEND_FORWARD):
            ops = self._send_ops(output) + [dist.P2POp(dist.irecv, grad, self.topo.next_rank)]
            reqs = dist.batch_isend_irecv(ops)
        with telemetry.device_span(COMM, SpanName.P2P_RECV_BACKWARD):
            for req in reqs:
                req.wait()
        return grad

    def send_backward_recv_forward(
        self, grad: torch.Tensor | None, microbatch: int
    ) -> torch.Tensor | None:
        """The mirror image of :meth:`send_forward_recv_backward`, for the stage below."""
        if self.topo.is_first_stage:
            return None
        with telemetry.device_span(COMM, SpanName.P2P_SEND_BACKWARD):
            ops, act, ctx = self._recv_ops()
            reqs = dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, grad.contiguous(), self.topo.prev_rank)] + ops
            )
        with telemetry.device_span(COMM, SpanName.P2P_RECV_FORWARD):
            for req in reqs:
                req.wait()
        self._linked(ctx, microbatch)
        return act.requires_grad_()

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
    """All gradients of this stage as views into one flat buffer, all-reduced across the
    data-parallel group in buckets that overlap the last microbatch's backward.

    Buckets are contiguous slices of the flat buffer, filled in reverse parameter order (the order
    backward produces gradients: last layers first). Before the step's last backward the trainer
    calls :meth:`arm`; from then on each parameter's post-accumulate-grad hook counts down its
    bucket, and a bucket whose gradients are all final is all-reduced asynchronously at once, while
    backward goes on with earlier layers (as Megatron-LM's and torch DDP's buckets do).
    :meth:`start_remaining` launches the buckets backward did not complete (parameters that got no
    gradient), :meth:`finish_all_reduce` waits for all of them. Gradients of earlier microbatches
    are not reduced: accumulation happens locally, one reduction per step.

    Autograd accumulates into an existing ``.grad`` in place, so the views stay valid; never call
    ``optimizer.zero_grad()`` (it would drop them), call :meth:`zero` instead.
    """

    #: Elements per bucket (Megatron-LM's ``--ddp-bucket-size`` default is max(40M, 1M x dp)).
    DEFAULT_BUCKET_NUMEL = 40_000_000

    def __init__(
        self, params: list[torch.nn.Parameter], bucket_numel: int = DEFAULT_BUCKET_NUMEL
    ) -> None:
        total = sum(p.numel() for p in params)
        self.flat = torch.zeros(total, dtype=torch.float32, device=params[0].device)
        offset = 0
        spans: list[tuple[int, int]] = []
        for p in params:
            p.grad = self.flat[offset : offset + p.numel()].view_as(p)
            spans.append((offset, offset + p.numel()))
            offset += p.numel()
        # Buckets from the end of the buffer backwards, whole parameters each.
        self.buckets: list[tuple[int, int]] = []  # (start, end) slices of flat
        self._bucket_of: dict[int, int] = {}
        members: list[list[int]] = []
        for index in reversed(range(len(params))):
            start, end = spans[index]
            if not self.buckets or self.buckets[-1][1] - start > bucket_numel:
                self.buckets.append((start, end))
                members.append([])
            else:
                self.buckets[-1] = (start, self.buckets[-1][1])
            members[-1].append(index)
            self._bucket_of[id(params[index])] = len(self.buckets) - 1
        self._sizes = [len(m) for m in members]
        # One view per bucket, made once: a launch inside backward allocates nothing.
        self._views = [self.flat[start:end] for start, end in self.buckets]
        self._pending: list[int] = []
        self._works: list[object | None] = [None] * len(self.buckets)
        self._group: object | None = None
        self.launched_in_backward = 0  # buckets the hooks launched this step (tests, docs)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
            for p in params
            if hasattr(p, "register_post_accumulate_grad_hook")
        ]

    def zero(self) -> None:
        self.flat.zero_()

    def arm(self, group: object) -> None:
        """The next backward is the step's last: launch each bucket as soon as it is complete."""
        self._group = group
        self._pending = list(self._sizes)
        self._works = [None] * len(self.buckets)
        self.launched_in_backward = 0

    def _launch(self, bucket: int) -> None:
        self._works[bucket] = dist.all_reduce(self._views[bucket], group=self._group, async_op=True)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        # Runs inside autograd (on CUDA, on its device thread): no spans, no host syncs here.
        if not self._pending:
            return
        bucket = self._bucket_of.get(id(param))
        if bucket is None or self._works[bucket] is not None:
            return
        self._pending[bucket] -= 1
        if self._pending[bucket] == 0:
            self._launch(bucket)
            self.launched_in_backward += 1

    def start_remaining(self, group: object) -> None:
        """Launch the buckets backward has not (all of them when :meth:`arm` was not called)."""
        if not self._pending:
            self.arm(group)
        for bucket, work in enumerate(self._works):
            if work is None:
                self._launch(bucket)
        self._pending = []

    def finish_all_reduce(self, dp: int) -> None:
        """Wait for every bucket (on CUDA this makes the compute stream wait for NCCL; the host
        returns at once), then turn the sum into a mean."""
        for work in self._works:
            if work is not None:
                work.wait()
        self._works = [None] * len(self.buckets)
        self._pending = []
        self.flat.div_(dp)
