"""Activation offload: the tensors autograd saves during a microbatch's forward are moved to CPU
once the forward is done and brought back just before that microbatch's backward.

``saved_tensors_hooks`` only collects references while the forward runs (moving each tensor there
would serialise a copy per op); the copies happen in bulk in :meth:`ActivationStash.offload` and
:meth:`ActivationStash.reload`, each inside one span, so a trace shows one offload and one reload
per microbatch. On a CPU-only machine the "offload" is a copy to a separate CPU tensor: the same
code path runs, it just cannot save device memory.
"""

from __future__ import annotations

import torch

from mlaunch import telemetry
from mlaunch.model.groups import SpanGroup
from mlaunch.model.spans import SpanName


class ActivationStash:
    """The saved activations of one microbatch."""

    def __init__(self, device: torch.device, skip: set[int]) -> None:
        self.device = device
        self.skip = skip  # ids of parameters: they stay resident, offloading them saves nothing
        self.slots: list[torch.Tensor] = []
        self.offloaded: list[bool] = []

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context manager to run the microbatch's forward under."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> int | torch.Tensor:
        if id(t) in self.skip:
            return t
        self.slots.append(t)
        return len(self.slots) - 1

    def _unpack(self, handle: int | torch.Tensor) -> torch.Tensor:
        return self.slots[handle] if isinstance(handle, int) else handle

    def offload(self) -> None:
        """Move every saved activation to (a separate tensor in) host memory."""
        with telemetry.span(SpanGroup.ACTIVATION_OFFLOAD, SpanName.ACTIVATION_OFFLOAD):
            pin = self.device.type == "cuda"
            out = []
            for t in self.slots:
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                host.copy_(t, non_blocking=pin)
                out.append(host)
            if pin:
                # The copies must land before the device buffers can be reused.
                torch.cuda.current_stream().synchronize()
            self.slots = out

    def reload(self) -> None:
        """Bring the saved activations back to the compute device for the backward pass."""
        with telemetry.span(SpanGroup.ACTIVATION_OFFLOAD, SpanName.ACTIVATION_RELOAD):
            if self.device.type == "cuda":
                self.slots = [t.to(self.device, non_blocking=True) for t in self.slots]
            else:
                self.slots = [t.clone() for t in self.slots]
