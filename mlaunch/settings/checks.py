"""The checks between settings: each value is valid alone, but together they do not make a run
(world layout, batch arithmetic, the export rank, what mlaunch's trainer supports)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlaunch.model.spec import quoted
from mlaunch.settings.problems import Problem
from mlaunch.settings.schema import MAX_WORLD_SIZE, Settings
from mlaunch.settings.values import path_is


def _conflict(field: str, message: str) -> Problem:
    """A problem between settings (each valid alone)."""
    return Problem(field, message, "conflict")


def cross_field_problems(settings: Settings) -> list[Problem]:
    """Every problem between the sections of ``settings``: world layout, batch arithmetic,
    export rank, what mlaunch's trainer supports. Each names the setting the user set with the
    highest-precedence source."""
    p = settings.parallelism
    problems: list[Problem] = []
    world = settings.world_size
    mp = settings.model_parallel_size

    def label(path: str, *others: str) -> str:
        # Of the settings in conflict, name the one set by the highest-precedence source
        # (``--hidden-size 65`` against the file's heads is the flag's fault, not the file's).
        rank = {"flag": 0, "env": 1, "derived": 2, "file": 3, "default": 4}
        path = min((path, *others), key=lambda q: rank[settings.source(q).kind])
        src = settings.source(path)
        return src.name if src.kind != "default" else path

    m = settings.model
    if m.hidden_size % m.num_attention_heads:
        problems.append(
            _conflict(
                label("model.num_attention_heads", "model.hidden_size"),
                f"{m.num_attention_heads} attention heads do not divide hidden size"
                f" {m.hidden_size}",
            )
        )
    if settings.training.min_lr > settings.training.lr:
        problems.append(
            _conflict(
                label("training.min_lr", "training.lr"),
                f"min_lr {settings.training.min_lr} must be <= lr {settings.training.lr}",
            )
        )

    if world > MAX_WORLD_SIZE:
        problems.append(
            _conflict(
                label("launch.nnodes", "launch.nproc_per_node"),
                f"world size {world} (nnodes {settings.launch.nnodes} x nproc_per_node"
                f" {settings.launch.nproc_per_node}) is above mlaunch's limit {MAX_WORLD_SIZE}",
            )
        )
    if world % mp:
        problems.append(
            _conflict(
                label("parallelism.pipeline_model_parallel_size"),
                f"world size {world} (nnodes {settings.launch.nnodes} x nproc_per_node"
                f" {settings.launch.nproc_per_node}) is not divisible by tensor x pipeline"
                f" = {p.tensor_model_parallel_size} x {p.pipeline_model_parallel_size}"
                + (f" x context {p.context_parallel_size}" if p.context_parallel_size > 1 else ""),
            )
        )
    elif p.data_parallel_size is not None and p.data_parallel_size * mp != world:
        problems.append(
            _conflict(
                label("parallelism.data_parallel_size"),
                f"world size {world} != tensor {p.tensor_model_parallel_size} x pipeline"
                f" {p.pipeline_model_parallel_size}"
                + (f" x context {p.context_parallel_size}" if p.context_parallel_size > 1 else "")
                + f" x data {p.data_parallel_size}",
            )
        )
    dp = settings.data_parallel_size
    t = settings.training
    if t.global_batch_size % (t.micro_batch_size * dp):
        problems.append(
            _conflict(
                label("training.global_batch_size"),
                f"global batch {t.global_batch_size} is not divisible by micro batch"
                f" {t.micro_batch_size} x data-parallel size {dp}",
            )
        )
    if settings.model.num_layers % p.pipeline_model_parallel_size:
        problems.append(
            _conflict(
                label("model.num_layers"),
                f"{settings.model.num_layers} layers cannot be split evenly across"
                f" {p.pipeline_model_parallel_size} pipeline stages",
            )
        )
    if settings.telemetry.export_rank >= world:
        problems.append(
            _conflict(
                label("telemetry.export_rank"),
                f"export rank {settings.telemetry.export_rank} is outside the world size {world}"
                f" (ranks 0..{world - 1}; -1 = last rank)",
            )
        )
    if settings.uses_builtin_trainer and p.tensor_model_parallel_size != 1:
        problems.append(
            _conflict(
                label("parallelism.tensor_model_parallel_size"),
                "mlaunch's trainer supports tensor parallel size 1 only;"
                " use --script for a trainer with tensor parallelism",
            )
        )
    if settings.uses_builtin_trainer and p.context_parallel_size != 1:
        problems.append(
            _conflict(
                label("parallelism.context_parallel_size"),
                "mlaunch's trainer supports context parallel size 1 only;"
                " use --script for a trainer with context parallelism",
            )
        )
    if settings.uses_builtin_trainer:
        problems += _trainer_protocol_problems(settings, label)
    if (why := data_path_problem(settings)) is not None:
        problems.append(Problem(settings.label("training.data_path"), why))
    return problems


def data_path_problem(settings: Settings) -> str | None:
    """Why ``data_path`` cannot be used by the run's entry point, or None. mlaunch's trainer
    reads it as a text file or folder; a script gets it as Megatron-LM's ``--data-path``
    (dataset prefixes, checked by Megatron-LM's rules: :func:`megatron_blend_problem`)."""
    value = settings.training.data_path
    if value is None:
        return None
    if not settings.uses_builtin_trainer:
        return megatron_blend_problem(value.split())
    if not path_is(Path.exists, value):
        return f"data_path {quoted(value)} does not exist; give a text file or folder"
    from mlaunch.model.corpus import empty_data_problem

    return empty_data_problem(value)


def _is_weight(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def megatron_blend_problem(tokens: list[str]) -> str | None:
    """Megatron-LM's rule for a ``--data-path`` list (``get_blend_from_list`` in
    ``megatron/core/datasets/utils.py``): an odd count is prefixes only; an even count is
    ``WEIGHT PREFIX`` pairs when every first item of a pair is a number, else prefixes only, and
    Megatron-LM asserts when only some are numbers. Whether the ``.bin``/``.idx`` files exist is
    for the workers to say: they may see a file system the launcher does not (sbatch)."""
    if not tokens:
        return "data_path is empty; give Megatron-LM dataset prefixes"
    if len(tokens) % 2 == 0:
        weights = [_is_weight(t) for t in tokens[0::2]]
        if any(weights) and not all(weights):
            return (
                f"data_path {quoted(' '.join(tokens))} mixes weights and prefixes: Megatron-LM"
                " takes either prefixes only or 'WEIGHT PREFIX' pairs (0.3 /a/prefix 0.7 /b/prefix)"
            )
    elif len(tokens) > 1 and _is_weight(tokens[0]):
        return (
            f"data_path {quoted(' '.join(tokens))} starts with a weight but has an odd number of"
            " items: Megatron-LM would read every item as a prefix; give 'WEIGHT PREFIX' pairs"
        )
    return None


def _trainer_protocol_problems(settings: Settings, label: Any) -> list[Problem]:
    """``http/json`` is the reference's (nemo-lens takes it and sends OTLP/HTTP protobuf, the
    only encoding the Python SDK has); mlaunch's own trainer exports through that same SDK,
    so it refuses the name rather than send protobuf while the summary says JSON."""
    o = settings.telemetry.otel
    out = []
    for fld in ("base_protocol", "traces_protocol", "metrics_protocol_override"):
        if getattr(o, fld) == "http/json":
            out.append(
                _conflict(
                    label(f"telemetry.otel.{fld}"),
                    "http/json is not supported by mlaunch's trainer: it exports through the"
                    " OpenTelemetry Python SDK, which has no OTLP/JSON encoder; use"
                    " http/protobuf (every OTLP/HTTP receiver accepts it), or run a --script"
                    " worker (nemo-lens takes http/json and sends protobuf)",
                )
            )
    return out
