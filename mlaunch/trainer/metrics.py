"""Where a step's numbers go: measured once into a :class:`StepRecord`, then fanned out once by
:func:`report_step` to telemetry's metrics, ``progress.jsonl`` (the launcher follows it) and the
log line, as torchtitan's ``MetricsProcessor.log``. An evaluation likewise (:func:`report_eval`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlaunch import telemetry
from mlaunch.rundir.records import ProgressEval, ProgressStep, progress_line
from mlaunch.trainer.parallel import Topology
from mlaunch.trainer.setup import log


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One training iteration, as measured."""

    iteration: int
    train_iters: int
    loss: float
    grad_norm: float
    lr: float
    skipped: bool
    #: Iterations skipped so far (non-finite gradients), this one included.
    skipped_iters: int
    step_ms: float
    #: CPU time of the whole process (telemetry's export thread included): on a shared machine it
    #: measures the step's work far more steadily than wall time.
    cpu_ms: float
    tokens_per_sec: float
    tflops: float
    #: The accelerator memory peak of the step (None on CPU: no gauge is recorded).
    memory_gb: float | None
    #: Wall clock at the end of the step: a reader can see stalls between steps.
    time: float
    #: Data parallelism only: the gradient buckets, and how many of them the step's last backward
    #: launched itself (all of them when the all-reduce overlaps backward; a GPU test reads it).
    grad_buckets: int | None = None
    grad_buckets_in_backward: int | None = None


class Progress:
    """``progress.jsonl``: one JSON line per iteration (and per evaluation), flushed at once, so
    the launcher can follow it. Only the rank that owns the loss writes (``path`` None: nothing)."""

    def __init__(self, path: Path | None) -> None:
        self.file = open(path, "a", buffering=1) if path is not None else None  # noqa: SIM115

    def write(self, record: ProgressStep | ProgressEval) -> None:
        if self.file is not None:
            self.file.write(progress_line(record))
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def report_step(step: StepRecord, progress: Progress, topo: Topology, log_interval: int) -> None:
    """The step's metrics, its progress line and (every ``log_interval`` iterations, and the
    first) its log line, from the rank that owns the loss."""
    telemetry.record_step(
        step.iteration,
        step_ms=step.step_ms,
        loss=step.loss,
        grad_norm=step.grad_norm,
        learning_rate=step.lr,
        tokens_per_sec=step.tokens_per_sec,
        tflops=step.tflops,
        skipped=step.skipped,
        memory_gb=step.memory_gb,
    )
    progress.write(
        ProgressStep(
            iteration=step.iteration,
            train_iters=step.train_iters,
            loss=step.loss,
            lr=step.lr,
            grad_norm=step.grad_norm,
            tokens_per_sec=step.tokens_per_sec,
            step_ms=step.step_ms,
            cpu_ms=step.cpu_ms,
            skipped=step.skipped,
            time=step.time,
            grad_buckets=step.grad_buckets,
            grad_buckets_in_backward=step.grad_buckets_in_backward,
        )
    )
    if topo.owns_loss and (step.iteration % log_interval == 0 or step.iteration == 1):
        log(
            topo,
            f"iteration {step.iteration}/{step.train_iters} | loss {step.loss:.4f} | "
            f"lr {step.lr:.3e} | grad norm {step.grad_norm:.3f} | "
            f"{step.tokens_per_sec:.0f} tokens/s | {step.step_ms:.1f} ms | "
            f"skipped {step.skipped_iters}",
            all_ranks=True,
        )


def report_eval(
    iteration: int, eval_loss: float, sample: str | None, progress: Progress, topo: Topology
) -> None:
    """An evaluation's progress line and log line, from the rank that owns the loss."""
    if not topo.owns_loss:
        return
    progress.write(ProgressEval(iteration, eval_loss, sample))
    log(
        topo,
        f"iteration {iteration} | eval loss {eval_loss:.4f}"
        + (f" | sample {sample!r}" if sample is not None else ""),
        all_ranks=True,
    )
