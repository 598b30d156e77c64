"""Activation offload: the tensors autograd saves during a microbatch's forward are moved to host
memory once the forward is done and brought back just before that microbatch's backward.

``saved_tensors_hooks`` only collects references while the forward runs (moving each tensor there
would serialise a copy per op); the copies happen in bulk in :meth:`ActivationStash.offload` and
:meth:`ActivationStash.reload`, each inside one span, so a trace shows one offload and one reload
per microbatch.

On CUDA the copies run on a side stream, ordered against the compute stream with events only (the
host never waits): the copy stream waits for the forward, ``record_stream`` keeps the allocator
from reusing a device buffer until its copy has run, and the compute stream waits for the reload
before backward. On a CPU-only machine the "offload" is a copy to a separate CPU tensor: the same
bookkeeping runs, it just cannot save memory.

Weights are never offloaded: a tensor that is a parameter, a view of one (``weight.t()`` in a
linear layer shares the weight's storage) or a cast of one (autocast's bf16/fp16 weight copy: its
``grad_fn`` leads through casts and views to the parameter's ``AccumulateGrad``) stays resident;
copying it out and back would move every weight twice per microbatch and save nothing.

Other tensors stay resident too: a tensor not on the stash's device (in fp32 the memory-efficient
attention backend returns its ``philox_seed``/``philox_offset`` as CPU scalars, and autograd saves
them: ``record_stream`` refuses a CPU tensor, and a reload would move them to the GPU), a tiny one
(at most ``TINY_NUMEL`` elements: its copies would cost two launches and save nothing), and an
overlapping one (a stride-0 ``expand``: a copy would materialise the expansion).

Saved tensors come back with their strides: backward kernels may rely on the layout forward gave
them, and a transposed view that came back contiguous can give wrong gradients. The
memory-efficient attention backward does: it takes the output's row stride to be heads x head
dim (``o_strideM()`` in PyTorch's ``mem_eff_attention/kernel_backward.h``), the layout its forward
allocates the output in, whatever strides the saved tensor has. A dense tensor (some permutation of
its dimensions is contiguous: a transpose, the attention output) keeps its exact strides on the
host and on reload (``torch.empty_strided``). A non-dense view (q/k/v are slices of the fused qkv
projection) cannot without copying the gaps: it comes back dense in the same dimension order, the
layout ``clone()`` gives it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from mlaunch import telemetry
from mlaunch.model.groups import SpanGroup
from mlaunch.model.spans import SpanName

#: Autograd nodes a parameter passes through on its way into an op without becoming an
#: activation: views and dtype/device casts (autocast's weight copies are ``ToCopyBackward0``).
_PASSTHROUGH_NODES = frozenset(
    {
        "ToCopyBackward0",
        "TBackward0",
        "TransposeBackward0",
        "PermuteBackward0",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ReshapeAliasBackward0",
        "ExpandBackward0",
        "AliasBackward0",
        "SliceBackward0",
        "SelectBackward0",
        "UnsqueezeBackward0",
        "SqueezeBackward0",
    }
)
_MAX_DEPTH = 6
#: Tensors of at most this many elements stay resident (RNG seeds and offsets, scalars).
TINY_NUMEL = 16

_copy_streams: dict[Any, Any] = {}


def _copy_stream(device: torch.device) -> Any:
    """One side stream per device for offload and reload copies."""
    stream = _copy_streams.get(device)
    if stream is None:
        stream = _copy_streams[device] = torch.cuda.Stream(device)
    return stream


def host_strides(t: torch.Tensor) -> tuple[int, ...] | None:
    """The strides of ``t``'s copy (see the module docstring): ``t``'s own when it is dense, else
    dense strides in ``t``'s dimension order; None when it overlaps itself (a stride-0 expand),
    which stays resident."""
    dims = sorted((i for i in range(t.dim()) if t.shape[i] != 1), key=lambda i: (t.stride(i), -i))
    if any(t.stride(i) == 0 for i in dims):
        return None
    out = list(t.stride())
    expected, dense = 1, True
    for i in dims:
        dense = dense and t.stride(i) == expected
        out[i] = expected
        expected *= t.shape[i]
    return tuple(t.stride()) if dense else tuple(out)


def copy_with_layout(
    t: torch.Tensor, strides: tuple[int, ...], device: torch.device | str, pinned: bool = False
) -> torch.Tensor:
    """A copy of ``t`` on ``device`` with ``strides`` (a layout from :func:`host_strides`),
    non-blocking where the copy can be (pinned host memory, CUDA)."""
    out = torch.empty_strided(t.shape, strides, dtype=t.dtype, device=device, pin_memory=pinned)
    out.copy_(t, non_blocking=pinned or out.device.type == "cuda")
    return out


class ParameterFilter:
    """Tells parameter-derived tensors from activations (see the module docstring)."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        params = list(params)
        self.ids = frozenset(id(p) for p in params)
        self.storages = frozenset(p.untyped_storage().data_ptr() for p in params)

    def is_parameter(self, t: torch.Tensor) -> bool:
        if id(t) in self.ids:
            return True
        try:
            if t.untyped_storage().data_ptr() in self.storages:
                return True  # the parameter itself or a view of it
        except (RuntimeError, NotImplementedError):
            return False
        node = t.grad_fn
        for _ in range(_MAX_DEPTH):
            if node is None:
                return False
            kind = type(node).__name__
            if kind == "AccumulateGrad":
                return id(node.variable) in self.ids
            if kind not in _PASSTHROUGH_NODES:
                return False
            inputs = [fn for fn, _ in node.next_functions if fn is not None]
            if len(inputs) != 1:
                return False
            node = inputs[0]
        return False


class ActivationStash:
    """The saved activations of one microbatch."""

    def __init__(self, device: torch.device, params: Iterable[torch.Tensor] | ParameterFilter):
        self.device = device
        self.filter = params if isinstance(params, ParameterFilter) else ParameterFilter(params)
        self.slots: list[torch.Tensor] = []
        self._cuda = device.type == "cuda"
        self._ready: Any = None  # CUDA: the event the last copy recorded on the copy stream

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context manager to run the microbatch's forward under."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _on_device(self, t: torch.Tensor) -> bool:
        dev = self.device
        return t.device.type == dev.type and (dev.index is None or t.device.index == dev.index)

    def _pack(self, t: torch.Tensor) -> int | torch.Tensor:
        # Resident (see the module docstring): weights, tensors elsewhere, tiny and overlapping
        # ones. The checks cheapest first: this runs for every tensor autograd saves.
        if (
            t.numel() <= TINY_NUMEL
            or not self._on_device(t)
            or host_strides(t) is None
            or self.filter.is_parameter(t)
        ):
            return t
        self.slots.append(t)
        return len(self.slots) - 1

    def _unpack(self, handle: int | torch.Tensor) -> torch.Tensor:
        return self.slots[handle] if isinstance(handle, int) else handle

    def offload(self) -> None:
        """Move every saved activation to (a separate tensor in) host memory."""
        if not self._cuda:
            with telemetry.device_span(SpanGroup.ACTIVATION_OFFLOAD, SpanName.ACTIVATION_OFFLOAD):
                self.slots = [copy_with_layout(t, host_strides(t), "cpu") for t in self.slots]
            return
        if not self.slots:
            return  # nothing to copy (all resident): no stream work at all
        compute = torch.cuda.current_stream(self.device)
        copy = _copy_stream(self.device)
        copy.wait_stream(compute)  # the forward that produced them
        out = []
        # The span opens on the copy stream: its device events time the copies themselves (on
        # the compute stream they would only bracket the enqueue, ~0).
        with (
            torch.cuda.stream(copy),
            telemetry.device_span(SpanGroup.ACTIVATION_OFFLOAD, SpanName.ACTIVATION_OFFLOAD),
        ):
            for t in self.slots:
                out.append(copy_with_layout(t, host_strides(t), "cpu", pinned=True))
                # The compute stream may reuse t's memory once we drop it: not before the copy
                # stream has read it.
                t.record_stream(copy)
            self._ready = copy.record_event()
        self.slots = out

    def reload(self) -> None:
        """Bring the saved activations back to the compute device for the backward pass."""
        with telemetry.device_span(SpanGroup.ACTIVATION_OFFLOAD, SpanName.ACTIVATION_RELOAD):
            if not self._cuda:
                self.slots = [copy_with_layout(h, h.stride(), "cpu") for h in self.slots]
                return
            if not self.slots:
                return
            compute = torch.cuda.current_stream(self.device)
            copy = _copy_stream(self.device)
            back = []
            with torch.cuda.stream(copy):
                # Same stream as the offload copies: ordered after them without a wait.
                for host in self.slots:
                    t = copy_with_layout(host, host.stride(), self.device)
                    t.record_stream(compute)  # backward (on the compute stream) uses it
                    back.append(t)
                done = copy.record_event()
            compute.wait_event(done)  # a device-side wait: the host goes on at once
            self.slots = back
