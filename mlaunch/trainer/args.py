"""The trainer's command line: Megatron-LM's argument names and meaning, plus mlaunch's own.

No torch (the parser is built from the settings schema), so the launcher can reuse
:func:`build_parser` and :func:`validate` to check a run before any process starts. Every check
here runs before a process group exists and depends only on the arguments and the world size, so
every rank reaches the same verdict and exits 2 with the same lines.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import typing
from collections.abc import Sequence
from typing import Any

from mlaunch.settings.args import SAME, Arg, training_fields
from mlaunch.settings.problems import Problem

PROG = "python -m mlaunch.trainer"


#: The trainer's ``--help`` groups, in order (a setting's group defaults to its section's name).
GROUPS: tuple[str, ...] = ("model", "training", "data", "checkpointing", "parallelism", "telemetry")


def build_parser() -> argparse.ArgumentParser:
    """The trainer's argument parser (Megatron-LM names; defaults make a tiny CPU-friendly run).

    Every model/training/parallelism setting that mlaunch's trainer takes is generated from the
    settings schema (its flag, type, default and help); only the arguments that are not
    settings (the trainer's own, and its ``--otel-*`` flags) are written here.
    """
    p = argparse.ArgumentParser(prog=PROG, description="mlaunch's instrumented GPT trainer.")
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    for section, name, info, arg in training_fields():
        if isinstance(arg, Arg):
            _add_setting(groups[arg.group or section], name, info, arg)

    train = groups["training"]
    train.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="stop (checkpointing if --save) once the iteration is a multiple of this",
    )
    train.add_argument(
        "--ddp-bucket-size",
        type=int,
        default=None,
        help="elements per data-parallel gradient bucket (default 40M, as Megatron-LM)",
    )
    groups["data"].add_argument(
        "--eval-fraction",
        type=float,
        default=0.05,
        help="share of the corpus held out for evaluation (mlaunch)",
    )
    groups["checkpointing"].add_argument(
        "--preempt-signals",
        default=None,
        help="comma-separated signals that stop training gracefully (finish the iteration, save, "
        "flush telemetry, exit 0); default: $MLAUNCH_PREEMPT_SIGNALS, else SIGTERM "
        "(plus SIGUSR1 under SLURM) (mlaunch)",
    )
    otel = groups["telemetry"]
    otel.add_argument("--otel-enabled", action="store_true", help="turn telemetry on")
    otel.add_argument("--otel-service-name", default=None, help="OTel service.name")
    otel.add_argument(
        "--otel-span-groups", default=None, help="span-group spec, e.g. default,microbatch"
    )
    return p


def _add_setting(group: Any, name: str, info: Any, arg: Arg) -> None:
    """One setting as the trainer's argument(s): a switch per value for a choice, store_true for
    a boolean, else a typed value whose default is the setting's (or the trainer's own)."""
    if arg.choices:
        for value, help_text in arg.choices.items():
            group.add_argument(f"--{value}", action="store_true", help=help_text)
        return
    (flag,) = arg.flags(name)
    if info.annotation is bool:
        group.add_argument(flag, action="store_true", help=arg.help)
        return
    default = info.default if arg.bare_default is SAME else arg.bare_default
    kind = next((t for t in (int, float) if _holds(info.annotation, t)), None)
    group.add_argument(flag, type=kind, default=default, help=arg.help)


def _holds(annotation: Any, kind: type) -> bool:
    """Whether a field annotation is ``kind`` or ``kind | None``."""
    return annotation is kind or kind in typing.get_args(annotation)


def world_size_from_env(environ: dict[str, str] | os._Environ[str] | None = None) -> int:
    """The world size torchrun announces (1 when run as a plain process)."""
    env = os.environ if environ is None else environ
    try:
        return max(1, int(env.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _positive(ns: argparse.Namespace, problems: list[Problem], *names: str) -> None:
    for name in names:
        value = getattr(ns, name)
        if value is not None and value < 1:
            problems.append(Problem(_flag(name), f"must be at least 1, got {value}"))


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def validate(ns: argparse.Namespace, world_size: int) -> list[Problem]:
    """Every problem with a parsed namespace for a job of ``world_size`` processes.

    Also fills in derived defaults (``global_batch_size`` = micro batch x DP when unset).
    Returns an empty list when the arguments are usable.
    """
    problems: list[Problem] = []
    _positive(
        ns,
        problems,
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "micro_batch_size",
        "global_batch_size",
        "train_iters",
        "log_interval",
        "exit_interval",
        "eval_interval",
        "save_interval",
        "pipeline_model_parallel_size",
        "ddp_bucket_size",
    )
    if ns.seq_length < 2:
        problems.append(Problem("--seq-length", f"must be at least 2, got {ns.seq_length}"))
    for name in ("eval_iters", "keep_last", "sample_tokens", "lr_warmup_iters"):
        if getattr(ns, name) < 0:
            problems.append(Problem(_flag(name), f"must be 0 or more, got {getattr(ns, name)}"))
    for name in ("lr", "min_lr", "weight_decay", "clip_grad"):
        # isfinite first: nan passes every comparison, inf passes every lower bound.
        if not math.isfinite(getattr(ns, name)) or getattr(ns, name) < 0:
            problems.append(
                Problem(_flag(name), f"must be a finite number, 0 or more, got {getattr(ns, name)}")
            )
    if not 0 <= ns.seed <= 2**32 - 1:  # torch's generator seed overflows far above this
        problems.append(Problem("--seed", f"must be in [0, 2**32-1], got {ns.seed}"))
    if ns.min_lr > ns.lr:
        problems.append(
            Problem(
                "--min-lr", f"{ns.min_lr} is above --lr {ns.lr}; use a value <= --lr", "conflict"
            )
        )
    if not 0.0 < ns.eval_fraction < 1.0:
        problems.append(
            Problem(
                "--eval-fraction", f"must be between 0 and 1 (exclusive), got {ns.eval_fraction}"
            )
        )
    if ns.tensor_model_parallel_size != 1:
        problems.append(
            Problem(
                "--tensor-model-parallel-size",
                f"only 1 is supported (got {ns.tensor_model_parallel_size}): mlaunch's trainer has no "
                "tensor parallelism; use --pipeline-model-parallel-size and data parallelism instead",
            )
        )
    if ns.bf16 and ns.fp16:
        problems.append(
            Problem("--fp16", "--bf16 and --fp16 exclude each other; pick one", "conflict")
        )
    if ns.save_interval is not None and ns.save is None:
        problems.append(
            Problem("--save-interval", "needs --save DIR to say where checkpoints go", "conflict")
        )
    try:
        from_env = ns.preempt_signals is None
        ns.preempt_signals = preempt_signals(ns.preempt_signals)
    except ValueError as exc:
        from mlaunch.envcontract import PREEMPT_SIGNALS

        # Named after what the user set: the variable when the flag was not given.
        problems.append(Problem(PREEMPT_SIGNALS if from_env else "--preempt-signals", str(exc)))
    if ns.data_path is not None and not os.path.exists(ns.data_path):
        problems.append(
            ("--data-path", f"{ns.data_path!r} does not exist; give a text file or folder")
        )
    elif ns.data_path is not None:
        from mlaunch.model.corpus import empty_data_problem

        if problem := empty_data_problem(ns.data_path):
            problems.append(Problem("--data-path", problem))
    if ns.otel_span_groups is not None:
        from mlaunch.model.spec import SpanSpecError, resolve

        try:
            resolve(ns.otel_span_groups)
        except SpanSpecError as exc:
            problems.append(Problem("--otel-span-groups", str(exc)))

    pp = ns.pipeline_model_parallel_size
    if pp >= 1:
        if world_size % pp:
            problems.append(
                Problem(
                    "--pipeline-model-parallel-size",
                    f"world size {world_size} is not divisible by {pp} pipeline stages; "
                    f"start a multiple of {pp} processes or change the stage count",
                    "conflict",
                )
            )
        if ns.num_layers >= 1 and ns.num_layers % pp:
            problems.append(
                Problem(
                    "--num-layers",
                    f"{ns.num_layers} layers cannot be split evenly over {pp} pipeline stages; "
                    f"use a multiple of {pp}",
                    "conflict",
                )
            )
    if (
        ns.hidden_size >= 1
        and ns.num_attention_heads >= 1
        and ns.hidden_size % ns.num_attention_heads
    ):
        problems.append(
            Problem(
                "--num-attention-heads",
                f"{ns.num_attention_heads} heads do not divide --hidden-size {ns.hidden_size}; "
                "pick a head count that divides the hidden size",
                "conflict",
            )
        )
    dp = world_size // pp if pp >= 1 and world_size % pp == 0 else None
    if dp is not None and ns.micro_batch_size >= 1:
        if ns.global_batch_size is None:
            ns.global_batch_size = ns.micro_batch_size * dp
        elif ns.global_batch_size >= 1 and ns.global_batch_size % (ns.micro_batch_size * dp):
            unit = ns.micro_batch_size * dp
            problems.append(
                Problem(
                    "--global-batch-size",
                    f"{ns.global_batch_size} is not divisible by micro batch size x data-parallel size "
                    f"({ns.micro_batch_size} x {dp} = {unit}); use a multiple of {unit}",
                    "conflict",
                )
            )
    return problems


#: Signals a process cannot catch: naming one as a preemption signal is a mistake.
_UNCATCHABLE = frozenset({"SIGKILL", "SIGSTOP"})


def preempt_signals(
    spec: str | tuple[str, ...] | None, environ: dict[str, str] | os._Environ[str] | None = None
) -> tuple[str, ...]:
    """The graceful-stop signal names: ``spec`` (the flag), else ``$MLAUNCH_PREEMPT_SIGNALS``,
    else SIGTERM, plus SIGUSR1 under SLURM (its warning before the time limit, with
    ``--signal=USR1@<s>``). Names may omit ``SIG`` and any case; raises ValueError naming a bad one."""
    import signal

    from mlaunch.envcontract import PREEMPT_SIGNALS

    if isinstance(spec, tuple):  # already parsed (validate may run twice on one namespace)
        return spec
    env = os.environ if environ is None else environ
    text = spec if spec is not None else env.get(PREEMPT_SIGNALS, "").strip()
    if not text:
        return ("SIGTERM", "SIGUSR1") if env.get("SLURM_JOB_ID") else ("SIGTERM",)
    names: list[str] = []
    for part in text.split(","):
        word = part.strip().upper()
        if not word:
            continue
        name = word if word.startswith("SIG") else "SIG" + word
        if name in _UNCATCHABLE:
            raise ValueError(
                f"{part.strip()!r} cannot be caught by a process; use e.g. SIGTERM,SIGUSR1"
            )
        if not isinstance(getattr(signal, name, None), signal.Signals) or name.startswith("SIG_"):
            raise ValueError(f"{part.strip()!r} is not a signal name; use e.g. SIGTERM,SIGUSR1")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"{text!r} names no signal; use e.g. SIGTERM,SIGUSR1")
    return tuple(names)


def parse_and_validate(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` and validate it for this process's world size; on a problem print one line
    per problem to stderr and exit 2 (no traceback, no process group)."""
    ns = build_parser().parse_args(argv)
    problems = validate(ns, world_size_from_env())
    if problems:
        for arg, message in problems:
            print(f"{PROG}: error: {arg}: {message}", file=sys.stderr)
        raise SystemExit(2)
    return ns
