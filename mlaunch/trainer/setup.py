"""The trainer's process set-up, before the recipe: joining the job (its telemetry settings, the
process group, the run id, the run directory, the preemption signals), the resource attributes
its telemetry carries and the hooks it needs of torch, how many iterations a ``megatron.train``
block holds, and the error file a failing rank leaves.

Like nanochat's ``common.py`` beside ``base_train.py``: what every process does once, kept out of
the recipe (:mod:`mlaunch.trainer.loop`) so that it reads top to bottom.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mlaunch import envcontract, telemetry
from mlaunch.model.segments import block_iterations
from mlaunch.model.spans import ResourceAttr
from mlaunch.rundir import layout as lay
from mlaunch.settings import SettingsError, TelemetrySettings, load_telemetry_settings
from mlaunch.settings.trainer_cli import PROG
from mlaunch.trainer import profiling
from mlaunch.trainer.parallel import Topology, init_distributed


def log(topo: Topology | None, message: str, *, all_ranks: bool = False) -> None:
    """One line on stdout, from rank 0 only unless ``all_ranks``. No rank prefix: stdout is
    the rank's own log file, and ``--tee`` and ``mlaunch logs`` put ``[rank R]`` before it."""
    if topo is None or all_ranks or topo.rank == 0:
        print(message, flush=True)


def join_job(args: argparse.Namespace) -> tuple[TelemetrySettings, Topology, Path, StopFlag]:
    """The process joins its job: its telemetry settings (invalid ones exit 2 before any process
    group exists), the process group, the run id every rank shares, its run directory (created)
    and the preemption-signal handler (installed). Returns them in that order."""
    settings = load_settings_or_exit(args)
    topo = init_distributed(args.pipeline_model_parallel_size)
    run_id = choose_run_id(settings, topo)
    if settings.run_id != run_id:
        settings = settings.model_copy(update={"run_id": run_id})
    run_dir = envcontract.worker_run_dir(os.environ, run_id)
    run_dir.mkdir(parents=True, exist_ok=True)
    stop_flag = StopFlag(args.preempt_signals)
    stop_flag.install()
    return settings, topo, run_dir, stop_flag


def install_step_hooks(topo: Topology) -> None:
    """What telemetry needs of torch, once its runtime is set up: on a GPU, spans over GPU work
    time the GPU (events, resolved at each step's sync point); and torch.profiler for
    ``mlaunch trace capture --profiler``."""
    if topo.device.type == "cuda":
        telemetry.set_event_timer(telemetry.CudaEventTimer())
    profiling.install()


def load_settings_or_exit(args: argparse.Namespace) -> TelemetrySettings:
    """The worker's telemetry settings: its environment with its own ``--otel-*`` flags on top.
    Invalid settings exit 2 before any process group exists, identically on every rank."""
    overrides: dict[str, Any] = {}
    if args.otel_enabled:
        overrides["enabled"] = True
    if args.otel_service_name is not None:
        overrides["service_name"] = args.otel_service_name
    if args.otel_span_groups is not None:
        overrides["span_groups"] = args.otel_span_groups
    try:
        return load_telemetry_settings(overrides=overrides)
    except SettingsError as exc:
        for field, message in exc.problems:
            print(f"{PROG}: error: {field}: {message}", file=sys.stderr)
        raise SystemExit(2) from None


def choose_run_id(settings: TelemetrySettings, topo: Topology) -> str:
    """The run id :func:`mlaunch.settings.choose_run_id` picks (the launcher sets it); when it
    has none to pick, a fresh one from rank 0, broadcast as bytes (no object collectives: they
    need pickling and numpy)."""
    from mlaunch.settings import choose_run_id as choose
    from mlaunch.settings import new_run_id

    chosen = choose(settings.run_id, os.environ, fresh=False)
    if chosen is not None:
        return chosen
    fresh = new_run_id()
    if topo.distributed and topo.world_size > 1:
        buf = torch.tensor(list(fresh.encode()), dtype=torch.uint8, device=topo.device)
        dist.broadcast(buf, src=0)
        fresh = bytes(buf.tolist()).decode()
    return fresh


class StopFlag:
    """Set by a preemption signal (``--preempt-signals``; default SIGTERM, and SIGUSR1 under SLURM,
    its pre-timeout warning): the loop finishes the current iteration, checkpoints and exits 0. All ranks vote in the per-step reduction, so they
    stop after the same iteration even when the signal reaches them at different times.

    A Python signal handler only runs when the main thread executes Python. When a peer has died,
    the main thread can sit in a collective that never returns (NCCL does not notice a dead peer),
    and torchrun's SIGTERM would go unanswered until its SIGKILL 30 s later, losing the open spans.
    A watchdog thread learns of the signal through the wakeup fd; if the handler has not run
    within ``STUCK_AFTER_S``, it shuts telemetry down (open spans are ended, marked truncated) and
    exits with 128 + the signal number.
    """

    STUCK_AFTER_S = 20.0  # below torchrun's 30 s grace before SIGKILL

    def __init__(self, names: tuple[str, ...] = ("SIGTERM",)) -> None:
        self.signal: int | None = None
        self._names = names
        self._signals: tuple[int, ...] = ()

    def install(self) -> None:
        self._signals = tuple(int(getattr(signal, name)) for name in self._names)
        for signum in self._signals:
            signal.signal(signum, self._handle)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(
            target=self._watch, args=(read_fd,), name="mlaunch-signal-watchdog", daemon=True
        ).start()

    def _handle(self, signum: int, _frame: object) -> None:
        self.signal = signum

    def _watch(self, read_fd: int) -> None:
        while True:
            received = [b for b in os.read(read_fd, 64) if b in self._signals]
            if not received:
                continue
            deadline = time.monotonic() + self.STUCK_AFTER_S
            while self.signal is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.signal is None:
                print(
                    f"{PROG}: signal {received[0]} not handled within {self.STUCK_AFTER_S:.0f} s "
                    "(the main thread is blocked, likely in a collective with a dead peer); "
                    "flushing telemetry and exiting",
                    file=sys.stderr,
                    flush=True,
                )
                telemetry.shutdown()
                os._exit(128 + received[0])

    @property
    def requested(self) -> bool:
        return self.signal is not None


def resource_attributes(args: argparse.Namespace, topo: Topology) -> dict[str, Any]:
    """The trainer-specific resource attributes (parallel layout, batch and model shape,
    precision, GPU identity); telemetry adds the rest."""
    R = ResourceAttr
    return {
        R.TP_SIZE: 1, R.TP_RANK: 0,
        R.PP_SIZE: topo.pp, R.PP_RANK: topo.pp_rank,
        R.DP_SIZE: topo.dp, R.DP_RANK: topo.dp_rank,
        R.BATCH_SIZE: args.global_batch_size, R.SEQUENCE_LENGTH: args.seq_length,
        R.NUM_LAYERS: args.num_layers, R.HIDDEN_SIZE: args.hidden_size,
        R.NUM_ATTENTION_HEADS: args.num_attention_heads, R.TRAIN_ITERS: args.train_iters,
        R.MICRO_BATCH_SIZE: args.micro_batch_size, R.CKPT_FORMAT: "torch",
        R.PRECISION: precision(args), R.GPU_COUNT: torch.cuda.device_count(),
        R.RESTART_COUNT: int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        **gpu_identity(topo.device),
    }  # fmt: skip


def gpu_identity(device: torch.device) -> dict[str, Any]:
    """The GPU a CUDA rank drives, as Megatron-LM reports it (index, name, uuid, PCI bus id, and
    the serial where NVML is importable); empty on CPU. Best effort: a missing field is left out."""
    if device.type != "cuda":
        return {}
    R = ResourceAttr
    index = device.index if device.index is not None else torch.cuda.current_device()
    out: dict[str, Any] = {R.GPU_INDEX: index}
    with contextlib.suppress(Exception):
        props = torch.cuda.get_device_properties(index)
        out[R.GPU_NAME] = props.name
        if getattr(props, "uuid", None) is not None:
            out[R.GPU_UUID] = f"GPU-{props.uuid}"
        if getattr(props, "pci_bus_id", None) is not None:
            out[R.GPU_PCI_BUS_ID] = (
                f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
            )
    with contextlib.suppress(Exception):  # NVML (nvidia-ml-py) is optional
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        out[R.GPU_SERIAL] = pynvml.nvmlDeviceGetSerial(handle)
    return out


def precision(args: argparse.Namespace) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def write_error_file(
    run_dir: Path | None, rank: int, exc: BaseException, iteration: int | None
) -> None:
    """``error-rank{R}.json``: what the launcher shows when this rank fails."""
    if run_dir is None:
        return
    record = {
        "rank": rank,
        "exception_type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "iteration": iteration,
        "time": time.time(),
    }
    with contextlib.suppress(OSError):
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / lay.ERROR_FILE_TEMPLATE.format(rank=rank)).write_text(
            json.dumps(record, indent=1)
        )


def block_iters(args: argparse.Namespace, settings: TelemetrySettings) -> int:
    """Iterations per ``megatron.train`` block, by the one rule
    (:func:`~mlaunch.model.segments.block_iterations`): ``--save-interval`` when the run saves."""
    saving = args.save_interval if args.save else 0
    return block_iterations(saving, getattr(settings, "trace_segment_iters", None))
