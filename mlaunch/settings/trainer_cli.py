"""The trainer's command line: Megatron-LM's argument names and meaning, plus mlaunch's own.

It lives with the settings, not the trainer, because it is built from the settings schema alone
(no torch) and the launcher runs :func:`build_parser` and :func:`validate` to check a run before
any process starts: below both, neither imports the other. The
arguments that are settings are checked by the settings' own rules (one definition, one wording);
only the trainer's own arguments have checks here. Every check runs before a process group exists
and depends only on the arguments and the world size, so every rank reaches the same verdict and
exits 2 with the same lines.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from collections.abc import Sequence
from typing import Any

from mlaunch.settings.arg_tables import training_fields
from mlaunch.settings.args import SAME, Arg
from mlaunch.settings.loading import check_layers
from mlaunch.settings.problems import Problem
from mlaunch.settings.schema import MAX_NPROC_PER_NODE, Source
from mlaunch.settings.sources import FlagSource, Layer
from mlaunch.settings.values import preempt_signals

PROG = "python -m mlaunch.trainer"


#: The trainer's ``--help`` groups, in order (a setting's group defaults to its section's name).
GROUPS: tuple[str, ...] = ("model", "training", "data", "checkpointing", "parallelism", "telemetry")


def build_parser() -> argparse.ArgumentParser:
    """The trainer's argument parser (Megatron-LM names; defaults make a tiny CPU-friendly run).

    Every model/training/parallelism setting that mlaunch's trainer takes is generated from the
    settings schema (its flag, type, default and help); only the arguments that are not
    settings (the trainer's own, and its ``--otel-*`` flags) are written here.
    """
    # allow_abbrev=False, as Megatron-LM's own parser: a prefix (``--train-iter 5``) would
    # otherwise reach a setting behind the launcher's check of the arguments after ``--``.
    p = argparse.ArgumentParser(
        prog=PROG, description="mlaunch's instrumented GPT trainer.", allow_abbrev=False
    )
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
    train.add_argument(
        "--hidden-dropout",
        type=float,
        default=0.0,
        help="dropout on each block's attention and MLP output, as Megatron-LM's (default 0 "
        "here; Megatron-LM's is 0.1); it draws from the device RNG a checkpoint restores",
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


def _local_world_size_from_env() -> int | None:
    """The processes per node torchrun announces (None when run as a plain process)."""
    try:
        return max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
    except (KeyError, ValueError):
        return None


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


#: The least value of the trainer's arguments that the settings do not check: its own, and
#: settings whose range is wider in the settings (eval_interval 0 = never, save_interval 0 = at
#: the end: the launcher leaves those out) or narrower (keep_last 0 = keep all here).
_LEAST: dict[str, int] = {
    "exit_interval": 1,
    "ddp_bucket_size": 1,
    "eval_interval": 1,
    "save_interval": 1,
    "keep_last": 0,
}


def _trainer_only_problems(ns: argparse.Namespace) -> list[Problem]:
    """The checks of arguments the settings do not have, or have with another meaning."""
    problems: list[Problem] = []
    for name, least in _LEAST.items():
        value = getattr(ns, name)
        if value is not None and value < least:
            must = "must be at least 1" if least == 1 else "must be 0 or more"
            problems.append(Problem(_flag(name), f"{must}, got {value}"))
    if not 0.0 < ns.eval_fraction < 1.0:
        problems.append(
            Problem(
                "--eval-fraction", f"must be between 0 and 1 (exclusive), got {ns.eval_fraction}"
            )
        )
    if not 0.0 <= ns.hidden_dropout < 1.0:
        problems.append(
            Problem("--hidden-dropout", f"must be at least 0 and below 1, got {ns.hidden_dropout}")
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
    return problems


def _setting_values(ns: argparse.Namespace, world_size: int) -> dict[str, Any]:
    """The parsed arguments as settings values (dotted path -> value), for the settings' own
    checks. Left out (the setting's default stands in): an unset value, a trainer-only value
    (``bare_default``, e.g. keep_last 0) and a value below the trainer's own least (reported by
    :func:`_trainer_only_problems` alone). An unset global batch is derived: micro batch x
    data-parallel size."""
    values: dict[str, Any] = {}
    for section, name, _, arg in training_fields():
        if not isinstance(arg, Arg):
            continue
        path = f"{section}.{name}"
        if arg.choices:  # one switch per value; both given is the trainer's own conflict
            values[path] = next((v for v in arg.choices if getattr(ns, v)), None)
            continue
        value = getattr(ns, name)
        if arg.bare_default is not SAME and value == arg.bare_default:
            continue
        if name in _LEAST and value is not None and value < _LEAST[name]:
            continue
        values[path] = value
    tp, pp, micro = (
        ns.tensor_model_parallel_size,
        ns.pipeline_model_parallel_size,
        ns.micro_batch_size,
    )
    if ns.global_batch_size is None and min(tp, pp, micro) >= 1:
        # The settings' data-parallel size: the world over the model-parallel ranks.
        values["training.global_batch_size"] = micro * max(1, world_size // (tp * pp))
    values["telemetry.span_groups"] = ns.otel_span_groups
    return values


def _world_layer(world_size: int, nproc_per_node: int | None) -> Layer:
    """The launch layout torchrun gave this job, as settings named after ``WORLD_SIZE``."""
    local = nproc_per_node or world_size
    if world_size % local or local > MAX_NPROC_PER_NODE:
        local = 1
    layer = Layer()
    layer.set("launch.nnodes", world_size // local, Source("env", "WORLD_SIZE"))
    layer.set("launch.nproc_per_node", local, Source("env", "WORLD_SIZE"))
    return layer


def validate(
    ns: argparse.Namespace, world_size: int, nproc_per_node: int | None = None
) -> list[Problem]:
    """Every problem with a parsed namespace for a job of ``world_size`` processes
    (``nproc_per_node`` per node; default: all on one node).

    The model, training and parallelism arguments are checked by the settings themselves (each
    field's range and the checks between sections, named by the trainer's flags), so a rule
    has one definition; only the trainer's own arguments are checked here. Also fills in
    derived defaults (``global_batch_size`` = micro batch x DP when unset). Returns an empty
    list when the arguments are usable.
    """
    values = _setting_values(ns, world_size)
    settings, problems = check_layers(FlagSource(values), _world_layer(world_size, nproc_per_node))
    problems += _trainer_only_problems(ns)
    if settings is not None and ns.global_batch_size is None:
        ns.global_batch_size = settings.training.global_batch_size
    return problems


def parse_and_validate(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` and validate it for this process's world size; on a problem print one line
    per problem to stderr and exit 2 (no traceback, no process group)."""
    ns = build_parser().parse_args(argv)
    problems = validate(ns, world_size_from_env(), _local_world_size_from_env())
    if problems:
        for arg, message in problems:
            print(f"{PROG}: error: {arg}: {message}", file=sys.stderr)
        raise SystemExit(2)
    return ns
