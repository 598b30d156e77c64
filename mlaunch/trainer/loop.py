"""The training recipe, top to bottom: arguments, process group, run id, telemetry, model,
data, resume, the loop (train step, progress, evaluation, checkpoints), shutdown.

Telemetry is reached only through :mod:`mlaunch.telemetry`'s public API; with a group off, each
``with telemetry.span(...)`` costs a set lookup.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mlaunch import envcontract, telemetry
from mlaunch.model.gpt_shape import GPTConfig, count_parameters
from mlaunch.model.groups import SpanGroup as G
from mlaunch.model.spans import Attr, ResourceAttr, SpanName, text_completion_name, train_block
from mlaunch.settings.trainer_cli import PROG, parse_and_validate
from mlaunch.trainer import checkpoint, profiling
from mlaunch.trainer.data import TokenData, decode, load_corpus
from mlaunch.trainer.model import GPTStage
from mlaunch.trainer.offload import ParameterFilter
from mlaunch.trainer.optim import AdamW
from mlaunch.trainer.parallel import P2P, GradBuffer, Topology, init_distributed
from mlaunch.trainer.pipeline import StepContext, forward_backward_1f1b, forward_only

MODEL_TYPE = "gpt"
PROMPT_TOKENS = 16  # text-completion prompt length (held-out bytes)
_NULL = contextlib.nullcontext()


def log(topo: Topology | None, message: str, *, all_ranks: bool = False) -> None:
    """One line on stdout, from rank 0 only unless ``all_ranks``."""
    if topo is None or all_ranks or topo.rank == 0:
        prefix = f"[rank {topo.rank}] " if topo is not None and all_ranks else ""
        print(f"{prefix}{message}", flush=True)


# ----------------------------------------------------------------------------------------------
# Configuration that is not the model: telemetry settings, run id, signals


def load_settings_or_exit(args: argparse.Namespace) -> Any:
    """The worker's telemetry settings: its environment with its own ``--otel-*`` flags on top.
    Invalid settings exit 2 before any process group exists, identically on every rank."""
    from mlaunch.settings import SettingsError, load_telemetry_settings

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


def choose_run_id(settings: Any, topo: Topology) -> str:
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
    """The trainer-specific resource attributes (SPEC section 3); telemetry adds the rest."""
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
    """The GPU a CUDA rank drives (MEGATRON.md section 4: index, name, uuid, PCI bus id, and the
    serial where NVML is importable); empty on CPU. Best effort: a missing field is left out."""
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


def lr_at(args: argparse.Namespace, iteration: int) -> float:
    """Linear warm-up to ``--lr``, then cosine decay to ``--min-lr`` at ``--train-iters``."""
    if args.lr_warmup_iters and iteration <= args.lr_warmup_iters:
        return args.lr * iteration / args.lr_warmup_iters
    span = max(1, args.train_iters - args.lr_warmup_iters)
    ratio = min(1.0, (iteration - args.lr_warmup_iters) / span)
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


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
        (run_dir / envcontract.ERROR_FILE_TEMPLATE.format(rank=rank)).write_text(
            json.dumps(record, indent=1)
        )


class Progress:
    """``progress.jsonl``: one JSON line per iteration (and per evaluation), flushed at once, so
    the launcher can follow it. Only the rank that owns the loss writes."""

    def __init__(self, path: Path | None) -> None:
        self.file = open(path, "a", buffering=1) if path is not None else None  # noqa: SIM115

    def write(self, **record: Any) -> None:
        if self.file is not None:
            clean = {
                k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in record.items()
            }
            self.file.write(json.dumps(clean) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


# ----------------------------------------------------------------------------------------------
# Mutable training state (what a checkpoint restores besides model and optimizer)


@dataclass
class TrainState:
    iteration: int = 0  # iterations completed
    consumed_samples: int = 0  # the data position
    skipped_iters: int = 0
    loss_scale: float = 1.0
    good_steps: int = 0  # fp16: finite steps since the loss scale last changed


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool
    stop: bool


# ----------------------------------------------------------------------------------------------
# The trainer


class Trainer:
    """Holds the model, optimizer, data and state of one process; :meth:`run` is the recipe."""

    def __init__(
        self,
        args: argparse.Namespace,
        topo: Topology,
        run_dir: Path,
        stop: StopFlag,
        block_iters: int = 100,
    ) -> None:
        self.args, self.topo, self.run_dir, self.stop = args, topo, run_dir, stop
        self.block_iters = block_iters  # iterations per megatron.train block
        self.num_micro = args.global_batch_size // (args.micro_batch_size * topo.dp)
        self.cfg = GPTConfig(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_heads=args.num_attention_heads,
            seq_length=args.seq_length,
            tie_embeddings=not args.untie_embeddings,
            hidden_dropout=args.hidden_dropout,
        )
        self.state = TrainState(loss_scale=2.0**16 if args.fp16 else 1.0)
        self.last_saved = -1
        self._stop_vote: torch.Tensor | None = None  # the device scalar of the stop vote
        self._slow_vote: torch.Tensor | None = None  # the recorder's slow flag, likewise
        # Flight recorder: this rank's last iteration was slow (sent with the next step's stats
        # reduce), and a dump every rank owes after the step whose reduce said some rank was.
        self.recorder_slow = False
        self.recorder_trigger: str | None = None
        self.model_name = f"mlaunch-gpt-{args.num_layers}l-{args.hidden_size}h"

    # -- setup ------------------------------------------------------------------------------
    def build_model(self) -> None:
        args, topo = self.args, self.topo
        # The global RNGs (dropout draws from them; weights and data have generators of their
        # own) from --seed, as Megatron-LM's _set_random_seed: + 100 x the pipeline rank.
        # Unseeded, a run's dropout masks differ from the next run's, resumed or not.
        random.seed(args.seed + 100 * topo.pp_rank)
        torch.manual_seed(args.seed + 100 * topo.pp_rank)  # the CPU and every CUDA generator
        self.model = GPTStage(self.cfg, topo.pp_rank, topo.pp).to(topo.device)
        self.model.init_weights(args.seed)
        params = list(self.model.parameters())
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]  # biases and norms, as in Megatron
        self.optimizer = AdamW(
            [
                {"params": decay, "weight_decay": args.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=args.lr,
            betas=(0.9, 0.95),
            eps=1e-8,
        )
        self.grads = GradBuffer(params, args.ddp_bucket_size or GradBuffer.DEFAULT_BUCKET_NUMEL)
        tied = self.model.tied_copy
        # The tied head copy on the last stage duplicates stage 0's embedding: count it once.
        self.norm_grads = [p.grad for p in params if p is not tied]
        dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        device_type = topo.device.type
        self.autocast = (
            (lambda: torch.autocast(device_type, dtype=dtype)) if dtype else (lambda: _NULL)
        )
        shape = (args.micro_batch_size, args.seq_length, args.hidden_size)
        self.ctx = StepContext(
            self.model,
            P2P(topo, shape),
            self.autocast,
            self.state.loss_scale,
            args.offload_activations,
            ParameterFilter(params),
        )
        self.gen_p2p = P2P(topo, (1, args.seq_length, args.hidden_size))

    def setup_data(self) -> None:
        with telemetry.trace_region("data.read_corpus"):
            corpus = load_corpus(self.args.data_path)
        with telemetry.trace_region("data.split"):
            self.data = TokenData(
                corpus,
                seq_length=self.args.seq_length,
                eval_fraction=self.args.eval_fraction,
                seed=self.args.seed,
            )

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        def cpu(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return x.detach().to("cpu", copy=True)
            if isinstance(x, dict):
                return {k: cpu(v) for k, v in x.items()}
            if isinstance(x, list):
                return [cpu(v) for v in x]
            return x

        s = self.state
        return {
            "iteration": s.iteration,
            "model": cpu(self.model.state_dict()),
            "optimizer": cpu(self.optimizer.state_dict()),
            "scheduler": {"iteration": s.iteration, "lr": lr_at(self.args, max(1, s.iteration))},
            "loss_scaler": {"scale": s.loss_scale, "good_steps": s.good_steps},
            "data": {"consumed_samples": s.consumed_samples, "seed": self.args.seed},
            "skipped_iters": s.skipped_iters,
            "rng": {
                "python": random.getstate(),
                "torch": torch.get_rng_state(),
                "cuda": cuda_rng_state(self.topo.device),
            },
            "arch": self.arch(),
        }

    def arch(self) -> dict[str, Any]:
        a = self.args
        return {
            "num_layers": a.num_layers,
            "hidden_size": a.hidden_size,
            "seq_length": a.seq_length,
            "num_attention_heads": a.num_attention_heads,
            "pipeline_stages": self.topo.pp,
            "tied": not a.untie_embeddings,
        }

    def restore(self, ckpt: dict[str, Any], where: str) -> None:
        if ckpt["arch"] != self.arch():
            raise ValueError(
                f"checkpoint in {where} was saved for {ckpt['arch']}, but this run is "
                f"{self.arch()}; resume with the same model shape and pipeline size"
            )
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        s = self.state
        s.iteration = ckpt["iteration"]
        s.consumed_samples = ckpt["data"]["consumed_samples"]
        s.skipped_iters = ckpt["skipped_iters"]
        s.loss_scale = ckpt["loss_scaler"]["scale"]
        s.good_steps = ckpt["loss_scaler"]["good_steps"]
        random.setstate(ckpt["rng"]["python"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        restore_cuda_rng(ckpt["rng"]["cuda"], self.topo.device, lambda m: log(self.topo, m))
        self.last_saved = s.iteration

    def save(self) -> None:
        checkpoint.save_checkpoint(
            self.args.save,
            self.state.iteration,
            self.topo,
            self.state_dict,
            keep_last=self.args.keep_last,
            log=lambda m: log(self.topo, m),
        )
        self.last_saved = self.state.iteration

    # -- one iteration ----------------------------------------------------------------------
    def train_step(self, iteration: int) -> StepResult:
        args, topo, s = self.args, self.topo, self.state
        with telemetry.span(G.STEP, SpanName.ITERATION, {Attr.ITERATION: iteration}) as step_span:
            _maybe_fail(iteration, topo.rank)
            _maybe_slow(iteration, topo.rank)
            _maybe_pause()
            with telemetry.span(G.DATA_LOADING, SpanName.GET_BATCH):
                batch = self.data.batch(
                    s.consumed_samples // args.global_batch_size,
                    global_batch=args.global_batch_size,
                    first_row=topo.dp_rank * args.micro_batch_size * self.num_micro,
                    micro=args.micro_batch_size,
                    num_micro=self.num_micro,
                )
                batch.tokens = batch_to_device(batch.tokens, topo.device)
                batch.targets = batch_to_device(batch.targets, topo.device)

            self.grads.zero()
            self.ctx.loss_scale = s.loss_scale
            self.ctx.before_last_backward = lambda: self._before_last_backward(iteration)
            self.ctx.in_forward = _slow_forward_hook(iteration, topo.rank)
            with telemetry.span(
                G.FORWARD_BACKWARD,
                SpanName.FORWARD_BACKWARD,
                {Attr.NUM_MICROBATCHES: self.num_micro},
            ):
                loss = forward_backward_1f1b(self.ctx, batch, self.num_micro, topo.pp_rank, topo.pp)

            if topo.dp > 1:
                # Per step: start launches the buckets the last backward did not already launch
                # (normally none: see GradBuffer); finish waits for all of them. On a GPU finish's
                # device time is the all-reduce time backward did not hide (the compute stream
                # waits for NCCL there).
                with telemetry.device_span(G.COMMUNICATION, SpanName.GRAD_SYNC_START):
                    self.grads.start_remaining(topo.dp_group)
                with telemetry.device_span(G.COMMUNICATION, SpanName.GRAD_SYNC_FINISH):
                    self.grads.finish_all_reduce(topo.dp)
            if self.cfg.tie_embeddings and topo.embed_group is not None:
                # Tied embeddings across stages: both copies get the sum of both gradients.
                tied = self.model.tok_emb.weight if topo.is_first_stage else self.model.tied_copy
                dist.all_reduce(tied.grad, group=topo.embed_group)

            # The step's one host sync (the norm decides skip and clip on the host) happens here,
            # outside the optimizer span: on a GPU it waits for all of forward-backward, which
            # the optimizer span must not absorb. Device-timed spans are resolved right after it.
            grad_norm, loss_value, stop = self._reduce_stats(loss)
            with telemetry.span(G.OPTIMIZER, SpanName.OPTIMIZER) as opt_span:
                skipped = not math.isfinite(grad_norm)
                if skipped:
                    s.skipped_iters += 1
                else:
                    if args.clip_grad > 0 and grad_norm > args.clip_grad:
                        self.grads.flat.mul_(args.clip_grad / (grad_norm + 1e-6))
                    lr = lr_at(args, iteration)
                    for group in self.optimizer.param_groups:
                        group["lr"] = lr
                    self.optimizer.step()
                self._update_loss_scale(skipped)
                opt_span.set_attribute(Attr.GRAD_NORM, grad_norm)
                opt_span.set_attribute(Attr.UPDATE_SUCCESSFUL, not skipped)
            step_span.set_attribute(Attr.LOSS, loss_value)
            step_span.set_attribute(Attr.GRAD_NORM, grad_norm)
            step_span.set_attribute(Attr.SKIPPED, skipped)
        s.consumed_samples += args.global_batch_size
        return StepResult(loss_value, grad_norm, skipped, stop)

    def _before_last_backward(self, iteration: int) -> None:
        """The test hook's NaN goes in before the last backward (accumulation keeps it), then the
        gradient buckets are armed so the all-reduce overlaps that backward."""
        _maybe_poison(iteration, self.grads.flat)
        if self.topo.dp > 1:
            self.grads.arm(self.topo.dp_group)

    def _reduce_stats(self, loss: torch.Tensor | None) -> tuple[float, float, bool]:
        """Global gradient norm, data-parallel mean loss and the stop vote, in one small
        all-reduce over all ranks (the norm needs every stage anyway)."""
        topo, s = self.topo, self.state
        if s.loss_scale != 1.0:
            self.grads.flat.div_(s.loss_scale)
        norms = torch._foreach_norm(self.norm_grads)
        sq = torch.stack(norms).double().square().sum()
        loss_t = (
            loss.double()
            if loss is not None
            else torch.zeros((), dtype=torch.float64, device=sq.device)
        )
        # The votes are filled on the device (the fill kernel takes the value as an argument):
        # torch.tensor(..., device=cuda) would copy it from the host, a blocking copy that waits
        # for forward-backward, a second host sync per step. The flight recorder's slow flag
        # rides on the reduce every step makes anyway.
        if self._stop_vote is None:
            self._stop_vote = torch.zeros((), dtype=torch.float64, device=sq.device)
            self._slow_vote = torch.zeros((), dtype=torch.float64, device=sq.device)
        vote = self._stop_vote.fill_(float(self.stop.requested))
        slow = self._slow_vote.fill_(float(self.recorder_slow))
        stats = torch.stack([sq, loss_t, vote, slow])
        if topo.distributed and topo.world_size > 1:
            dist.all_reduce(stats)
        # .tolist() is the step's CPU-GPU sync point: the skip / clip decision needs the norm on
        # the host. The anchor event just before it lets device-timed spans be resolved after it.
        anchor = telemetry.device_mark()
        total_sq, loss_sum, votes, slow_votes = the_step_sync(stats)
        telemetry.resolve_device_spans(anchor)
        if slow_votes > 0:
            self.recorder_trigger = "slow_iteration"
        self.ctx.p2p.after_sync()
        # Data-parallel replicas hold identical (averaged) gradients: each stage is counted dp times.
        return math.sqrt(total_sq / topo.dp), loss_sum / topo.dp, votes > 0

    def _update_loss_scale(self, skipped: bool) -> None:
        """fp16 dynamic loss scaling: halve on overflow, double after 1000 clean steps."""
        s = self.state
        if not self.args.fp16:
            return
        if skipped:
            s.loss_scale = max(1.0, s.loss_scale / 2)
            s.good_steps = 0
        else:
            s.good_steps += 1
            if s.good_steps % 1000 == 0:
                s.loss_scale *= 2

    # -- evaluation and generation ----------------------------------------------------------
    def evaluate(self, iteration: int, progress: Progress) -> None:
        args, topo = self.args, self.topo
        with telemetry.span(G.EVALUATE, SpanName.EVALUATE, {Attr.EVAL_ITERS: args.eval_iters}):
            self.model.eval()
            total = torch.zeros((), dtype=torch.float64, device=topo.device)
            for k in range(args.eval_iters):
                with telemetry.span(
                    G.EVALUATE, SpanName.EVALUATE_STEP, {Attr.EVAL_ITERATION: k + 1}
                ):
                    batch = self.data.batch(
                        k,
                        global_batch=args.global_batch_size,
                        eval_split=True,
                        first_row=topo.dp_rank * args.micro_batch_size * self.num_micro,
                        micro=args.micro_batch_size,
                        num_micro=self.num_micro,
                    )
                    batch.tokens = [t.to(topo.device) for t in batch.tokens]
                    batch.targets = [t.to(topo.device) for t in batch.targets]
                    loss = forward_only(self.ctx, batch, self.num_micro)
                    if loss is not None:
                        total += loss.double()
            if topo.distributed and topo.world_size > 1:
                dist.all_reduce(total)
            eval_loss = total.item() / (topo.dp * max(1, args.eval_iters))
            sample = self.generate() if args.sample_tokens > 0 else None
            self.model.train()
        if topo.owns_loss:
            record: dict[str, Any] = {"iteration": iteration, "eval_loss": eval_loss}
            if sample is not None:
                record["sample"] = sample
            progress.write(**record)
            log(
                topo,
                f"iteration {iteration} | eval loss {eval_loss:.4f}"
                + (f" | sample {sample!r}" if sample is not None else ""),
                all_ranks=True,
            )

    @torch.no_grad()
    def generate(self) -> str | None:
        """Greedy completion of a held-out prompt, through the pipeline, inside a GenAI
        ``text_completion <model>`` span: a root span of its own (GenAI convention; the catalogue
        gives it no parent), with nothing traced below it. Returns the text on the last stage."""
        args, topo, model, p2p = self.args, self.topo, self.model, self.gen_p2p
        prompt_len = min(PROMPT_TOKENS, args.seq_length - 1)
        tokens = self.data.prompt(prompt_len).tolist()
        attrs = {
            Attr.GEN_AI_OPERATION: "text_completion",
            Attr.GEN_AI_REQUEST_MODEL: self.model_name,
            Attr.GEN_AI_INPUT_TOKENS: prompt_len,
            Attr.GEN_AI_OUTPUT_TOKENS: args.sample_tokens,
        }
        name = text_completion_name(self.model_name)
        with telemetry.span(G.INFERENCE, name, attrs, root=True), telemetry.suppressed():
            for _ in range(args.sample_tokens):
                window = tokens[-args.seq_length :]
                # Right-padded to the fixed shape the P2P buffers expect; causal attention keeps
                # the padding from influencing the positions that matter.
                x = torch.zeros((1, args.seq_length), dtype=torch.int64, device=topo.device)
                x[0, : len(window)] = torch.tensor(window, device=topo.device)
                h = p2p.recv_forward(0)
                with self.autocast():
                    out = model(x if model.is_first else h, None)
                nxt = None
                if model.is_last:
                    nxt = out[0, len(window) - 1].argmax().reshape(1)
                else:
                    p2p.send_forward(out)
                if topo.pp > 1 and (topo.is_first_stage or topo.is_last_stage):
                    nxt = p2p.exchange_token(nxt)
                tokens.append(int(nxt.item()) if nxt is not None else 0)
        return decode(tokens[prompt_len:]) if topo.is_last_stage else None

    # -- the recipe -------------------------------------------------------------------------
    def run(self) -> None:
        """Start-up (its own trace, as Megatron-LM's ``megatron.startup``), then training."""
        args, topo = self.args, self.topo
        if args.save:
            checkpoint.check_shared(args.save, topo)  # before anything is saved or resumed
        with telemetry.span(G.JOB, SpanName.STARTUP, {Attr.MODEL_TYPE: MODEL_TYPE}):
            with telemetry.span(G.MODEL_INIT, SpanName.MODEL_INIT):
                self.build_model()
            with telemetry.span(G.DATA_LOADING, SpanName.DATALOADER):
                self.setup_data()
            load = args.load or self.resume_from_save()
            if load:
                with telemetry.span(G.LOAD_CHECKPOINT, SpanName.CHECKPOINT_LOAD) as load_span:
                    iteration, ckpt = checkpoint.load_checkpoint(load, topo, lambda m: log(topo, m))
                    if ckpt is not None:
                        self.restore(ckpt, load)
                    load_span.set_attribute(Attr.ITERATION, iteration)
        # No span covers the whole run (a SIGKILL would lose it): the launcher's job trace does.
        self.train_loop()

    def resume_from_save(self) -> str | None:
        """``--load`` defaults to ``--save`` when a checkpoint is there (Megatron's convention), in
        the trainer itself: a torchrun restart re-runs the same argv and must resume, not start
        over. Rank 0 decides and tells everyone, so all ranks take the same (collective) path."""
        args, topo = self.args, self.topo
        if not args.save:
            return None
        found = checkpoint.has_checkpoint(args.save) if topo.rank == 0 else False
        if topo.distributed and topo.world_size > 1:
            t = torch.tensor([int(found)], dtype=torch.int64, device=topo.device)
            dist.broadcast(t, src=0)
            found = bool(t.item())
        if found:
            log(
                topo,
                f"--load not given: resuming from --save {args.save}, which holds a checkpoint",
            )
        return args.save if found else None

    def train_loop(self) -> None:
        """The loop, in ``megatron.train`` blocks of ``block_iters`` iterations, each the root of
        a trace of its own (SPEC section 4). Saves, evaluation and the final save happen inside
        the block of the iteration they follow."""
        args, topo, s = self.args, self.topo, self.state
        progress = Progress(self.run_dir / envcontract.PROGRESS_FILE if topo.owns_loss else None)
        self.tokens_per_iter = args.global_batch_size * args.seq_length
        # 6N per token for forward+backward of the weights, plus attention scores.
        self.flops_per_iter = self.tokens_per_iter * (
            6 * count_parameters(self.cfg)
            + 12 * args.num_layers * args.hidden_size * args.seq_length
        )
        first = True
        stop: str | None = None
        try:
            while stop is None and s.iteration < args.train_iters:
                block = train_block(s.iteration + 1, self.block_iters)
                telemetry.set_iteration(s.iteration + 1)  # the block's trace, before it opens
                with telemetry.span(G.JOB, SpanName.TRAIN) as train_span:
                    while True:
                        stop = self.iteration(progress, first=first)
                        first = False
                        if stop is not None or s.iteration >= args.train_iters:
                            break
                        if train_block(s.iteration + 1, self.block_iters) != block:
                            break
                    if (
                        args.save
                        and self.last_saved != s.iteration
                        and (stop is not None or s.iteration >= args.train_iters)
                    ):
                        self.save()  # the final save, inside the last block
                    if stop == "signal":
                        # The job was cut short: the block is marked truncated, as a block still
                        # open at shutdown is, so a reader can tell a preempted run from a
                        # finished one.
                        train_span.set_attribute(Attr.TRUNCATED, True)
        finally:
            progress.close()

    def iteration(self, progress: Progress, *, first: bool) -> str | None:
        """One iteration with its metrics, progress line, evaluation and periodic save. Returns
        why training stops after it (``"signal"``, ``"exit_interval"``), or None to go on."""
        args, topo, s = self.args, self.topo, self.state
        iteration = s.iteration + 1
        telemetry.set_iteration(iteration)
        wrap = (
            telemetry.span(G.FIRST_ITERATION, SpanName.FIRST_ITERATION, {Attr.ITERATION: iteration})
            if first
            else _NULL
        )
        t0, cpu0 = time.perf_counter(), time.process_time()
        with wrap:
            result = self.train_step(iteration)
        step_s = time.perf_counter() - t0
        # CPU time of the whole process (telemetry's export thread included): on a shared
        # machine it measures this step's work far more steadily than wall time.
        cpu_ms = (time.process_time() - cpu0) * 1e3
        s.iteration = iteration
        if self.recorder_trigger is not None:
            # Every rank learnt from the same reduce: each writes the same iterations.
            telemetry.recorder_dump(self.recorder_trigger)
            self.recorder_trigger = None
        self.recorder_slow = telemetry.recorder_active() and telemetry.recorder_step(step_s * 1e3)

        lr = lr_at(args, iteration)
        tokens_per_sec = self.tokens_per_iter / step_s
        telemetry.record_step(
            iteration,
            step_ms=step_s * 1e3,
            loss=result.loss,
            grad_norm=result.grad_norm,
            learning_rate=lr,
            tokens_per_sec=tokens_per_sec,
            tflops=self.flops_per_iter / step_s / topo.world_size / 1e12,
            skipped=result.skipped,
            memory_gb=peak_memory_gb(topo.device),
        )
        progress.write(
            iteration=iteration,
            train_iters=args.train_iters,
            loss=result.loss,
            lr=lr,
            grad_norm=result.grad_norm,
            tokens_per_sec=tokens_per_sec,
            step_ms=step_s * 1e3,
            cpu_ms=cpu_ms,
            skipped=result.skipped,
            time=time.time(),  # wall clock: a reader can see stalls between steps
            # DP: how many gradient buckets the step's last backward launched itself (all of them
            # when the all-reduce overlaps backward; a GPU test reads it).
            **(
                {
                    "grad_buckets": len(self.grads.buckets),
                    "grad_buckets_in_backward": self.grads.launched_in_backward,
                }
                if topo.dp > 1
                else {}
            ),  # fmt: skip
        )
        if topo.owns_loss and (iteration % args.log_interval == 0 or iteration == 1):
            log(
                topo,
                f"iteration {iteration}/{args.train_iters} | loss {result.loss:.4f} | "
                f"lr {lr:.3e} | grad norm {result.grad_norm:.3f} | {tokens_per_sec:.0f} tokens/s | "
                f"{step_s * 1e3:.1f} ms | skipped {s.skipped_iters}",
                all_ranks=True,
            )

        if args.eval_iters > 0 and iteration % args.eval_interval == 0:
            self.evaluate(iteration, progress)
        exiting = bool(args.exit_interval) and iteration % args.exit_interval == 0
        if result.stop:
            telemetry.recorder_dump("signal")  # before the save, which may take long
        if args.save and (
            result.stop or exiting or (args.save_interval and iteration % args.save_interval == 0)
        ):
            self.save()
        if result.stop or exiting:
            why = "stop requested by signal" if result.stop else "--exit-interval reached"
            log(topo, f"{why}: stopped after iteration {iteration}")
            return "signal" if result.stop else "exit_interval"
        return None


def batch_to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """A batch's host tensors on ``device``. For CUDA they are pinned first: a non-blocking copy
    from pageable memory is not asynchronous (the driver stages it through its own pinned buffer
    and may wait for the stream's earlier work, the previous step's optimizer)."""
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    return [t.pin_memory().to(device, non_blocking=True) for t in tensors]


def the_step_sync(stats: torch.Tensor) -> list[Any]:
    """``stats.tolist()``: the step's one host sync (docs/telemetry.md). Under
    ``torch.cuda.set_sync_debug_mode`` it is the one sync allowed, so a step run in "error" mode
    (a GPU test) fails on any other."""
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


def block_iters(args: argparse.Namespace, settings: Any) -> int:
    """Iterations per ``megatron.train`` block: ``--save-interval`` when the run saves, else the
    trace-segment count K (``MEGATRON_OTEL_TRACE_SEGMENT_ITERS``)."""
    if args.save and args.save_interval and args.save_interval > 0:
        return int(args.save_interval)
    return max(1, int(getattr(settings, "trace_segment_iters", None) or 100))


def _maybe_poison(iteration: int, flat_grads: torch.Tensor) -> None:
    """The test hook MLAUNCH_TEST_NAN_AT_ITERATION=k: a NaN gradient at iteration k, before the
    all-reduce, as a real overflow would arrive."""
    at = os.environ.get(envcontract.NAN_AT_ITERATION)
    if at and int(at) == iteration:
        flat_grads[0] = float("nan")


def _maybe_fail(iteration: int, rank: int) -> None:
    """The test hook: MLAUNCH_TEST_FAIL_AT_ITERATION=k (and optionally MLAUNCH_TEST_FAIL_RANK=r)."""
    at = os.environ.get(envcontract.FAIL_AT_ITERATION)
    if not at or int(at) != iteration:
        return
    only = os.environ.get(envcontract.FAIL_RANK)
    if only is None or only == "" or int(only) == rank:
        raise RuntimeError(
            f"injected failure at iteration {iteration} on rank {rank} ({envcontract.FAIL_AT_ITERATION})"
        )


def _maybe_slow(iteration: int, rank: int) -> None:
    """The test hook: MLAUNCH_TEST_SLOW_AT_ITERATION=k (and optionally MLAUNCH_TEST_SLOW_RANK=r)
    makes iteration k sleep 2 s on that rank, for the flight recorder's slow trigger."""
    at = os.environ.get(envcontract.SLOW_AT_ITERATION)
    if not at or int(at) != iteration:
        return
    only = os.environ.get(envcontract.SLOW_RANK)
    if not only or int(only) == rank:
        time.sleep(2.0)


def _maybe_pause() -> None:
    """The test hook MLAUNCH_TEST_ITERATION_PAUSE=S: every iteration sleeps S seconds, so an
    open-ended test job idles between its few ms of compute instead of training flat out."""
    pause = os.environ.get(envcontract.ITERATION_PAUSE)
    if pause:
        time.sleep(float(pause))


def _slow_forward_hook(iteration: int, rank: int) -> Callable[[int], None] | None:
    """The test hook MLAUNCH_TEST_SLOW_FORWARD_AT=k,k,... (and optionally MLAUNCH_TEST_SLOW_RANK=r):
    a 1 s sleep inside the first microbatch's forward of those iterations, so a straggler is late
    in a known phase. None (no call per microbatch) when it does not apply."""
    at = os.environ.get(envcontract.SLOW_FORWARD_AT)
    if not at or iteration not in {int(k) for k in at.split(",") if k.strip()}:
        return None
    only = os.environ.get(envcontract.SLOW_RANK)
    if only and int(only) != rank:
        return None
    return lambda microbatch: time.sleep(1.0) if microbatch == 0 else None


def main(argv: list[str] | None = None) -> int:
    """Entry point: validate, join the job, set up telemetry, train, shut down."""
    args = parse_and_validate(argv)
    settings = load_settings_or_exit(args)
    topo = init_distributed(args.pipeline_model_parallel_size)
    run_id = choose_run_id(settings, topo)
    if settings.run_id != run_id:
        settings = settings.model_copy(update={"run_id": run_id})
    run_dir = envcontract.worker_run_dir(os.environ, run_id)
    run_dir.mkdir(parents=True, exist_ok=True)
    stop = StopFlag(args.preempt_signals)
    stop.install()
    # The job's telemetry: shut down (flushed, what is still open ended as truncated) on every
    # way out of this block, after the error file is written.
    with telemetry.setup(
        settings,
        rank=topo.rank,
        world_size=topo.world_size,
        local_rank=topo.local_rank,
        resource=resource_attributes(args, topo),
        run_dir=run_dir,
        save_interval=args.save_interval if args.save else 0,
    ):
        if topo.device.type == "cuda":
            # Spans over GPU work time the GPU (events), resolved at each step's sync point.
            telemetry.set_event_timer(telemetry.CudaEventTimer())
        profiling.install()  # torch.profiler for `mlaunch trace capture --profiler`
        trainer = Trainer(args, topo, run_dir, stop, block_iters(args, settings))
        try:
            trainer.run()
        except checkpoint.SaveDirNotShared as exc:
            # A setup problem, not a crash: one line, exit 2, the reason in the error file too.
            print(f"{PROG}: error: save: {exc}", file=sys.stderr, flush=True)
            write_error_file(run_dir, topo.rank, exc, None)
            return 2
        except BaseException as exc:
            telemetry.recorder_dump("exception")  # the iterations before it, then the error file
            write_error_file(run_dir, topo.rank, exc, trainer.state.iteration + 1)
            raise
    if topo.distributed and dist.is_initialized():
        dist.destroy_process_group()
    return 0
