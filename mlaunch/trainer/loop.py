"""The training recipe, top to bottom: start-up (model, data, resume: the ``megatron.startup``
trace), the loop (train step, its record, evaluation, checkpoints), and ``main``, which sets the
process up (:mod:`mlaunch.trainer.setup`), trains and shuts down.

Telemetry is reached only through :mod:`mlaunch.telemetry`'s public API; with a group off, each
``with telemetry.span(...)`` costs a set lookup.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from mlaunch import telemetry
from mlaunch.model.gpt_shape import gpt_config, train_flops_per_token
from mlaunch.model.groups import SpanGroup as G
from mlaunch.model.segments import train_block
from mlaunch.model.spans import Attr, SpanName
from mlaunch.rundir import layout as lay
from mlaunch.settings.trainer_cli import PROG, parse_and_validate
from mlaunch.trainer import checkpoint, testhooks
from mlaunch.trainer.data import TokenData, load_corpus
from mlaunch.trainer.device import batch_to_device, peak_memory_gb, step_sync
from mlaunch.trainer.metrics import Progress, StepRecord, report_eval, report_step
from mlaunch.trainer.model import GPTStage
from mlaunch.trainer.offload import ParameterFilter
from mlaunch.trainer.optim import build_optimizer, lr_at
from mlaunch.trainer.parallel import P2P, GradBuffer, Topology
from mlaunch.trainer.pipeline import StepContext, forward_backward_1f1b, forward_only
from mlaunch.trainer.sample import complete
from mlaunch.trainer.setup import (
    StopFlag,
    block_iters,
    install_step_hooks,
    join_job,
    log,
    resource_attributes,
    write_error_file,
)
from mlaunch.trainer.state import TrainState, checkpoint_state, restore_checkpoint_state

MODEL_TYPE = "gpt"
_NULL = contextlib.nullcontext()
# Why training ends after an iteration: a preemption signal, or ``--exit-interval``.
ExitReason = Literal["signal", "exit_interval"]


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool
    stop_requested: bool  # some rank's stop flag was set (the all-rank vote of this step)


# ----------------------------------------------------------------------------------------------
# The trainer


class Trainer:
    """One process's model, optimizer, data and state. Constructing it is the start-up (its own
    trace, as Megatron-LM's ``megatron.startup``); :meth:`train` is the loop."""

    def __init__(
        self,
        args: argparse.Namespace,
        topo: Topology,
        run_dir: Path,
        stop_flag: StopFlag,
        block_iters: int = 100,
        state: TrainState | None = None,
    ) -> None:
        self.args, self.topo, self.run_dir, self.stop_flag = args, topo, run_dir, stop_flag
        self.block_iters = block_iters  # iterations per megatron.train block
        self.num_micro = args.global_batch_size // (args.micro_batch_size * topo.dp)
        self.cfg = gpt_config(args, hidden_dropout=args.hidden_dropout)
        # main passes its own, so that the error file of a failed start-up names the iteration.
        self.state = state if state is not None else TrainState.fresh(args)
        self.last_saved = -1
        self._stop_vote: torch.Tensor | None = None  # this rank's stop flag, on the device
        self._slow_vote: torch.Tensor | None = None  # the recorder's slow flag, likewise
        # Flight recorder: this rank's last iteration was slow (sent with the next step's stats
        # reduce), and a dump every rank owes after the step whose reduce said some rank was.
        self.recorder_slow = False
        self.recorder_trigger: str | None = None
        self.tokens_per_iter = args.global_batch_size * args.seq_length
        self.flops_per_iter = self.tokens_per_iter * train_flops_per_token(self.cfg)

        if args.save:
            checkpoint.check_shared(args.save, topo)  # before anything is saved or resumed
        with telemetry.span(G.JOB, SpanName.STARTUP, {Attr.MODEL_TYPE: MODEL_TYPE}):
            with telemetry.span(G.MODEL_INIT, SpanName.MODEL_INIT):
                self.build_model()
            with telemetry.span(G.DATA_LOADING, SpanName.DATALOADER):
                self.setup_data()
            load = args.load or checkpoint.resume_from_save(args.save, topo, lambda m: log(topo, m))
            if load:
                with telemetry.span(G.LOAD_CHECKPOINT, SpanName.CHECKPOINT_LOAD) as load_span:
                    iteration, ckpt = checkpoint.load_checkpoint(load, topo, lambda m: log(topo, m))
                    if ckpt is not None:
                        restore_checkpoint_state(
                            ckpt, load, self.state, self.model, self.optimizer, args, topo,
                            lambda m: log(topo, m),
                        )  # fmt: skip
                        self.last_saved = self.state.iteration
                    load_span.set_attribute(Attr.ITERATION, iteration)

    # -- start-up: model, optimizer, data ---------------------------------------------------
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
        self.optimizer = build_optimizer(params, args)
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

    # -- the loop ---------------------------------------------------------------------------
    def train(self) -> None:
        """Iterations in ``megatron.train`` blocks of ``block_iters``, each the root of a trace of
        its own, opened before its first iteration and ended after its last.
        Saves, evaluation and the final save happen inside the block of the iteration they
        follow. No span covers the whole run (a SIGKILL would lose it): the launcher's job trace
        does.

        The loop opens and ends each block's span itself rather than keep one ``megatron.train``
        open for telemetry to re-root at each block (``set_iteration``): that re-roots only an
        exported span (a flight-recorded one would cover every block), and the ``with`` yields
        the first block's span, where a preempted run's truncation mark would be lost."""
        args, s = self.args, self.state
        progress = Progress(self.run_dir / lay.PROGRESS_FILE if self.topo.owns_loss else None)
        first = True
        train_span: Any = None
        try:
            with contextlib.ExitStack() as block:
                while s.iteration < args.train_iters:
                    if train_span is None:  # a block begins: telemetry switches trace first
                        telemetry.set_iteration(s.iteration + 1)
                        # Entered by hand, not with enter_context: that looks __enter__ up on
                        # the type, and the null span's is a C callable of the instance's own.
                        block_cm = telemetry.span(G.JOB, SpanName.TRAIN)
                        train_span = block_cm.__enter__()
                        block.push(block_cm)  # its __exit__, with the exception if one ends it
                    exit_reason = self.iteration(progress, first=first)
                    first = False
                    if exit_reason is not None or s.iteration >= args.train_iters:
                        if args.save and self.last_saved != s.iteration:
                            self.save()  # the final save, inside the last block
                        if exit_reason == "signal":
                            # The job was cut short: the block is marked truncated, as a block
                            # still open at shutdown is, so a reader can tell a preempted run
                            # from a finished one.
                            train_span.set_attribute(Attr.TRUNCATED, True)
                        break
                    if train_block(s.iteration + 1, self.block_iters) != train_block(
                        s.iteration, self.block_iters
                    ):
                        block.close()  # the block's last iteration: its span ends
                        train_span = None
        finally:
            progress.close()

    def iteration(self, progress: Progress, *, first: bool) -> ExitReason | None:
        """One iteration with its metrics, progress line, evaluation and periodic save. Returns
        why training ends after it, or None to go on."""
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
        cpu_ms = (time.process_time() - cpu0) * 1e3
        s.iteration = iteration
        if self.recorder_trigger is not None:
            # Every rank learnt from the same reduce: each writes the same iterations.
            telemetry.recorder_dump(self.recorder_trigger)
            self.recorder_trigger = None
        self.recorder_slow = telemetry.recorder_active() and telemetry.recorder_step(step_s * 1e3)

        dp = topo.dp > 1
        step = StepRecord(
            iteration=iteration,
            train_iters=args.train_iters,
            loss=result.loss,
            grad_norm=result.grad_norm,
            lr=lr_at(args, iteration),
            skipped=result.skipped,
            skipped_iters=s.skipped_iters,
            step_ms=step_s * 1e3,
            cpu_ms=cpu_ms,
            tokens_per_sec=self.tokens_per_iter / step_s,
            tflops=self.flops_per_iter / step_s / topo.world_size / 1e12,
            memory_gb=peak_memory_gb(topo.device),
            time=time.time(),
            grad_buckets=len(self.grads.buckets) if dp else None,
            grad_buckets_in_backward=self.grads.launched_in_backward if dp else None,
        )
        report_step(step, progress, topo, args.log_interval)

        if args.eval_iters > 0 and iteration % args.eval_interval == 0:
            self.evaluate(iteration, progress)
        at_exit_interval = bool(args.exit_interval) and iteration % args.exit_interval == 0
        if result.stop_requested:
            telemetry.recorder_dump("signal")  # before the save, which may take long
        if args.save and (
            result.stop_requested
            or at_exit_interval
            or (args.save_interval and iteration % args.save_interval == 0)
        ):
            self.save()
        if result.stop_requested or at_exit_interval:
            why = "stop requested by signal" if result.stop_requested else "--exit-interval reached"
            log(topo, f"{why}: stopped after iteration {iteration}")
            return "signal" if result.stop_requested else "exit_interval"
        return None

    # -- one iteration ----------------------------------------------------------------------
    def train_step(self, iteration: int) -> StepResult:
        args, topo, s = self.args, self.topo, self.state
        with telemetry.span(G.STEP, SpanName.ITERATION, {Attr.ITERATION: iteration}) as step_span:
            testhooks._maybe_fail(iteration, topo.rank)
            testhooks._maybe_slow(iteration, topo.rank)
            testhooks._maybe_pause()
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
            self.ctx.in_forward = testhooks._slow_forward_hook(iteration, topo.rank)
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
            grad_norm, loss_value, stop_requested = self._reduce_stats(loss)
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
                if args.fp16:
                    s.update_loss_scale(skipped)
                opt_span.set_attribute(Attr.GRAD_NORM, grad_norm)
                opt_span.set_attribute(Attr.UPDATE_SUCCESSFUL, not skipped)
            step_span.set_attribute(Attr.LOSS, loss_value)
            step_span.set_attribute(Attr.GRAD_NORM, grad_norm)
            step_span.set_attribute(Attr.SKIPPED, skipped)
        s.consumed_samples += args.global_batch_size
        return StepResult(loss_value, grad_norm, skipped, stop_requested)

    def _before_last_backward(self, iteration: int) -> None:
        """The test hook's NaN goes in before the last backward (accumulation keeps it), then the
        gradient buckets are armed so the all-reduce overlaps that backward."""
        testhooks._maybe_poison(iteration, self.grads.flat)
        if self.topo.dp > 1:
            self.grads.arm(self.topo.dp_group)

    def _reduce_stats(self, loss: torch.Tensor | None) -> tuple[float, float, bool]:
        """Global gradient norm, data-parallel mean loss and the stop-flag vote, in one small
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
        vote = self._stop_vote.fill_(float(self.stop_flag.requested))
        slow = self._slow_vote.fill_(float(self.recorder_slow))
        stats = torch.stack([sq, loss_t, vote, slow])
        if topo.distributed and topo.world_size > 1:
            dist.all_reduce(stats)
        # The step's CPU-GPU sync point: the skip / clip decision needs the norm on the host.
        total_sq, loss_sum, votes, slow_votes = step_sync(stats, self.ctx.p2p)
        if slow_votes > 0:
            self.recorder_trigger = "slow_iteration"
        # Data-parallel replicas hold identical (averaged) gradients: each stage is counted dp times.
        return math.sqrt(total_sq / topo.dp), loss_sum / topo.dp, votes > 0

    # -- evaluation and sampling ------------------------------------------------------------
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
            sample = (
                complete(self.model, self.gen_p2p, self.autocast, self.data, args, topo)
                if args.sample_tokens > 0
                else None
            )
            self.model.train()
        report_eval(iteration, eval_loss, sample, progress, topo)

    # -- checkpoints ------------------------------------------------------------------------
    def save(self) -> None:
        checkpoint.save_checkpoint(
            self.args.save,
            self.state.iteration,
            self.topo,
            lambda: checkpoint_state(self.state, self.model, self.optimizer, self.args, self.topo),
            keep_last=self.args.keep_last,
            log=lambda m: log(self.topo, m),
        )
        self.last_saved = self.state.iteration


def main(argv: list[str] | None = None) -> int:
    """Entry point: validate, join the job, set up telemetry, train, shut down."""
    args = parse_and_validate(argv)
    settings, topo, run_dir, stop_flag = join_job(args)
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
        install_step_hooks(topo)
        # The state is main's, so that an error file names the iteration even when start-up fails.
        state = TrainState.fresh(args)
        try:
            Trainer(args, topo, run_dir, stop_flag, block_iters(args, settings), state).train()
        except checkpoint.SaveDirNotShared as exc:
            # A setup problem, not a crash: one line, exit 2, the reason in the error file too.
            print(f"{PROG}: error: save: {exc}", file=sys.stderr, flush=True)
            write_error_file(run_dir, topo.rank, exc, None)
            return 2
        except BaseException as exc:
            telemetry.recorder_dump("exception")  # the iterations before it, then the error file
            write_error_file(run_dir, topo.rank, exc, state.iteration + 1)
            raise
    if topo.distributed and dist.is_initialized():
        dist.destroy_process_group()
    return 0
