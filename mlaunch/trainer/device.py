"""What the trainer asks of its accelerator beyond the model: host-to-device batch copies, the
step's one host sync, the memory peak, and the GPU's RNG state. CPU and CUDA alike; nothing here
branches on whether telemetry is on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mlaunch import telemetry


def batch_to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """A batch's host tensors on ``device``. For CUDA they are pinned first: a non-blocking copy
    from pageable memory is not asynchronous (the driver stages it through its own pinned buffer
    and may wait for the stream's earlier work, the previous step's optimizer)."""
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    return [t.pin_memory().to(device, non_blocking=True) for t in tensors]


def step_sync(stats: torch.Tensor, p2p: Any) -> list[Any]:
    """``stats.tolist()``: the step's one CPU-GPU sync point (docs/telemetry.md), with what hangs
    on it: an anchor event just before it, so that device-timed spans are resolved right after it,
    and the release of the P2P's staged span-context copies, which it has proven run
    (``p2p.after_sync``).

    Under ``torch.cuda.set_sync_debug_mode`` it is the one sync allowed, so a step run in "error"
    mode (a GPU test) fails on any other."""
    anchor = telemetry.device_mark()
    values = _tolist_allowed(stats)
    telemetry.resolve_device_spans(anchor)
    p2p.after_sync()
    return values


def _tolist_allowed(stats: torch.Tensor) -> list[Any]:
    if stats.device.type != "cuda" or torch.cuda.get_sync_debug_mode() == 0:
        return stats.tolist()
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        return stats.tolist()
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def cuda_rng_state(device: torch.device) -> torch.Tensor | None:
    """This worker's own GPU's RNG state (None on CPU). Never every visible GPU's: another rank
    drives those, and a resume may see a different number of them."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_rng_state(device)


def restore_cuda_rng(state: Any, device: torch.device, log_fn: Callable[[str], None]) -> None:
    """Restore :func:`cuda_rng_state`'s state on this worker's GPU. A checkpoint from before
    (a list, one state per visible GPU) restores the entry of this device's index when it has
    one; a CPU checkpoint resumed on a GPU, or the reverse, leaves the RNG as seeded."""
    if device.type != "cuda" or state is None:
        return
    if isinstance(state, (list, tuple)):
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= len(state):
            log_fn(
                f"checkpoint holds CUDA RNG states for {len(state)} GPU(s), none for GPU {index}: "
                "its RNG stays as seeded"
            )
            return
        state = state[index]
    torch.cuda.set_rng_state(state, device)


def peak_memory_gb(device: torch.device) -> float | None:
    """The accelerator memory peak since the last call, in GiB (Megatron-LM reports the peak,
    ``torch.cuda.max_memory_allocated``); the peak is reset so each record covers one step.
    None on CPU: torch keeps no allocation statistics there, so no memory gauge is recorded."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return peak
