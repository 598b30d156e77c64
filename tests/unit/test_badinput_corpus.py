"""The bad-input corpus: every entry is a way a user can get a run wrong, through a flag, an
environment variable, a config file or a span spec, and each must end the same way: exit 2, a
message that names what the user typed, no traceback, and nothing created or started (the spawn
function is never called, no ``runs/`` and no ``--run-dir`` appear).

Which empty values are errors (decided here, pinned below):

* errors: an empty path or name (``--config``, ``--script``, ``--module``, ``--run-dir``,
  ``--save``, ``--load``, ``--data-path``, ``--rdzv-id``, ``--otel-run-id``,
  ``--otel-service-name``, ``--otel-export-strategy``) and an empty number (``--train-iters ""``);
* valid: ``--otel-span-groups ""`` (tracing on, no groups: what an all-excluding spec gives),
  ``--otel-user-id ""`` (the default), and any variable set to an empty or blank value, which counts
  as unset (a source counts only with a non-empty, stripped value).

Everything runs in-process through Typer's CliRunner; the subprocess proof that no process starts
is ``tests/integration/test_badinput_noprocess.py``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlaunch.cli import build_app
from mlaunch.launcher import run as lrun

PREFIXES = ("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_", "SLURM_", "MLAUNCH_", "TORCHELASTIC_")
#: Where every ``mlaunch train`` case points ``--run-dir`` unless the case sets its own.
RUN_DIR = "out"


def _trace_line(**span_changes: object) -> str:
    """One OTLP/JSON traces line holding one step span, with ``span_changes`` applied."""
    span = {"traceId": "0af7651916cd43dd8448eb211c80319c", "spanId": "00f067aa0ba902b7",
            "name": "megatron.train.iteration", "startTimeUnixNano": "1000",
            "endTimeUnixNano": "2000", "attributes": []}  # fmt: skip
    span.update(span_changes)
    return json.dumps({"resourceSpans": [{"resource": {"attributes": []},
                                          "scopeSpans": [{"spans": [span]}]}]}) + "\n"  # fmt: skip


#: Files each test's working directory holds; cases refer to them by name (a name with a "/"
#: is created with its directories).
FILES: dict[str, str | bytes | None] = {
    "unknown_key.toml": "[training]\ntrain_iterz = 3\n",
    "unknown_section.toml": "[modle]\nnum_layers = 2\n",
    "wrong_type.toml": "[training]\ntrain_iters = 'abc'\n",
    "bool_for_int.toml": "[training]\ntrain_iters = true\n",
    "bool_for_float.toml": "[training]\nlr = false\n",
    "wrong_bool.toml": "[telemetry]\nenabled = 'maybe'\n",
    "spec_int.toml": "[telemetry]\nspan_groups = 5\n",
    "section_scalar.toml": "launch = 3\n",
    "bad_spec.toml": "[telemetry]\nspan_groups = 'per_stepp'\n",
    "full_spec.toml": "[telemetry]\nspan_groups = 'full'\n",
    "bad_header.toml": "[telemetry.otel]\nheaders = 'abc'\n",
    "ranks_filter_word.toml": "[launch]\nlocal_ranks_filter = 'first'\n",
    "tee_maybe.toml": "[launch]\ntee = 'maybe'\n",
    "array_value.toml": "[model]\nnum_layers = [2, 4]\n",
    "not_toml.toml": "this is not toml {{{\n",
    "binary.toml": b"\x00\xff\xfe\x80garbage\x00",
    "config_dir.toml": None,  # a directory
    "afile": "a regular file\n",
    "x.py": "print('hi')\n",
    "run_dir_under_file.toml": "[launch]\nrun_dir = 'afile/run'\n",
    "not_traces.jsonl": "not json\n",
    # Config values of the wrong type or past int64, and inputs with no text in them.
    "quoted_number.toml": '[training]\ntrain_iters = "30"\n',
    "quoted_float.toml": "[training]\nlr = '0.001'\n",
    "huge_int.toml": f"[training]\ntrain_iters = {2**63}\n",
    "fraction_for_int.toml": "[training]\ntrain_iters = 2.5\n",
    "empty.txt": "",
    "no_text_dir": None,  # a directory (no text file in it)
    # A finished PP=1 run's checkpoint (resumed with another pipeline layout).
    "pp1run/checkpoints/iter_0000010/manifest.json": '{"pipeline_stages": 1, "files": []}',
    "pp1run/checkpoints/latest_checkpointed_iteration.txt": "10\n",
    "pp1ckpt/iter_0000010/manifest.json": '{"pipeline_stages": 1, "files": []}',
    "runx/telemetry/traces-rank0.jsonl": _trace_line(),
    "runx/progress.jsonl": '{"iteration": 1}\n',
    "runy/telemetry/traces-rank0.jsonl": None,  # a directory where a trace file belongs
    "chrome.json": '{"displayTimeUnit":"ms","otherData":{},"traceEvents":[\n{"ph":"X"}\n]}\n',
    "name_is_a_number.jsonl": _trace_line(name=42),
    "attributes_a_string.jsonl": _trace_line(attributes="iteration=3"),
}


@dataclass(frozen=True)
class Bad:
    """One bad input: the command line after ``mlaunch``, the environment, and the words the
    message must contain (the first names the input: a flag, a variable or a file key)."""

    argv: tuple[str, ...]
    names: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


def train(
    *args: str,
    names: tuple[str, ...] | str,
    env: dict[str, str] | None = None,
    add_run_dir: bool = True,
) -> Bad:
    """A ``mlaunch train`` case (``--run-dir out`` added unless the case names its own or the
    run directory under test comes from a config file)."""
    run_dir = () if "--run-dir" in args or not add_run_dir else ("--run-dir", RUN_DIR)
    names = (names,) if isinstance(names, str) else names
    return Bad(("train", *run_dir, *args), names, env or {})


LONG_SPEC = "x" * 10_000
#: A file name longer than any file system allows (stat itself fails with ENAMETOOLONG).
LONG_NAME = "n" * 5_000

TRAIN: dict[str, Bad] = {
    # ---- flags: wrong types, out of range ---------------------------------------------------
    "train-iters=0": train("--train-iters", "0", names=("--train-iters", "'0'")),
    "train-iters=abc": train("--train-iters", "abc", names=("--train-iters", "'abc'")),
    "train-iters=3.5": train("--train-iters", "3.5", names="--train-iters"),
    "train-iters=empty": train("--train-iters", "", names="--train-iters"),
    "train-iters=fullwidth-digit": train("--train-iters", "４", names="--train-iters"),
    "train-iters=missing-value": train("--train-iters", names="--train-iters"),
    "lr=-1": train("--lr", "-1", names=("--lr", "'-1'")),
    "lr=inf": train("--lr", "inf", names=("--lr", "finite")),
    "lr=nan": train("--lr", "nan", names=("--lr", "finite")),
    "lr-below-min-lr": train("--lr", "0.0001", names=("--lr", "min_lr")),
    "min-lr-above-lr": train("--min-lr", "1", "--lr", "0.1", names="--min-lr"),
    "nproc-per-node=0": train("--nproc-per-node", "0", names="--nproc-per-node"),
    "nnodes=0": train("--nnodes", "0", names="--nnodes"),
    "nnodes=huge": train("--nnodes", "99999999999", names="--nnodes"),
    "seed=huge": train("--seed", str(2**70), names="--seed"),
    # Out of range: every integer setting becomes an OTel attribute (int64)
    "train-iters=2**70": train("--train-iters", str(2**70), names=("--train-iters", "64 bits")),
    "save-interval=2**63": train("--save-interval", str(2**63), names=("--save-interval", "64")),
    "env:EXPORT_RANK=2**70": train(
        names=("MEGATRON_OTEL_EXPORT_RANK", "64 bits"),
        env={"MEGATRON_OTEL_EXPORT_RANK": str(2**70)},
    ),
    "data-path=empty-file": train("--data-path", "empty.txt", names=("--data-path", "empty")),
    "data-path=folder-without-text": train(
        "--data-path", "no_text_dir", names=("--data-path", "no non-empty text file")
    ),
    "env:MLAUNCH_PREEMPT_SIGNALS=SIGFOO": train(
        names=("MLAUNCH_PREEMPT_SIGNALS", "SIGFOO"), env={"MLAUNCH_PREEMPT_SIGNALS": "SIGFOO"}
    ),
    "env:MLAUNCH_PREEMPT_SIGNALS=SIGKILL": train(
        names=("MLAUNCH_PREEMPT_SIGNALS", "cannot be caught"),
        env={"MLAUNCH_PREEMPT_SIGNALS": "SIGKILL"},
    ),
    "max-restarts=-1": train("--max-restarts", "-1", names="--max-restarts"),
    "seq-length=1": train("--seq-length", "1", names="--seq-length"),
    "hidden-size=65-not-divisible-by-heads": train("--hidden-size", "65", names="--hidden-size"),
    "precision=fp8": train("--precision", "fp8", names=("--precision", "fp8")),
    "device=tpu": train("--device", "tpu", names=("--device", "tpu")),
    "global-batch-size=7": train("--global-batch-size", "7", names=("--global-batch-size", "7")),
    "num-layers=3-pp=2": train(
        "--num-layers", "3", "--pipeline-model-parallel-size", "2", names="--num-layers"
    ),
    "tensor-parallel=2": train("--tensor-model-parallel-size", "2", names="--tensor-model"),
    "data-parallel-size=3": train("--data-parallel-size", "3", names="--data-parallel-size"),
    "unknown-flag": train("--num-layer", "3", names=("--num-layer", "no such option")),
    # ---- flags: telemetry --------------------------------------------------------------------
    "span-groups=per_stepp": train(
        "--otel-span-groups", "per_stepp", names=("--otel-span-groups", "per_stepp", "per_step")
    ),
    # Megatron-LM's own --otel-span-groups help names a preset `full` that does not exist.
    "span-groups=full": train(
        "--otel-span-groups", "full", names=("--otel-span-groups", "'full'", "did you mean 'all'")
    ),
    "span-groups=full-for-a-script": train(
        "--script",
        "x.py",
        "--otel-enabled",
        "--otel-span-groups",
        "per_step,-full",
        names=("--otel-span-groups", "'-full'", "did you mean 'all'"),
    ),  # fmt: skip
    "span-groups=dash-only": train("--otel-span-groups", "-", names=("--otel-span-groups", "'-'")),
    "span-groups=unicode-défault": train(
        "--otel-span-groups", "défault", names=("--otel-span-groups", "défault", "'default'")
    ),
    "span-groups=zero-width-space": train(
        "--otel-span-groups", "all,-layer,\u200b", names="--otel-span-groups"
    ),
    "span-groups=10000-chars": train(
        "--otel-span-groups", LONG_SPEC, names=("--otel-span-groups", "10000 characters")
    ),
    "export-strategy=nope:fn": train(
        "--otel-export-strategy", "nope:fn", names=("--otel-export-strategy", "nope")
    ),
    "export-strategy=singel_rank": train(
        "--otel-export-strategy", "singel_rank", names=("--otel-export-strategy", "single_rank")
    ),
    "export-strategy=empty": train("--otel-export-strategy", "", names="--otel-export-strategy"),
    # A custom strategy is user code: checked for one argument, never called before launch.
    "export-strategy=takes-no-argument": train(
        "--otel-enabled",
        "--otel-export-strategy",
        "os:getcwd",
        names=("--otel-export-strategy", "cannot be called with one RankInfo"),
    ),
    "export-sample-rate=1.5": train(
        "--otel-export-sample-rate", "1.5", names="--otel-export-sample-rate"
    ),
    "export-rank=99": train("--otel-export-rank", "99", names=("--otel-export-rank", "99")),
    "export-rank=-2": train("--otel-export-rank", "-2", names="--otel-export-rank"),
    "run-id=empty": train("--otel-run-id", "", names="--otel-run-id"),
    "run-id=10000-chars": train(
        "--otel-run-id", "r" * 10_000, names=("--otel-run-id", "10000 characters")
    ),
    "service-name=empty": train("--otel-service-name", "", names="--otel-service-name"),
    "otlp-endpoint=no-scheme": train("--otlp-endpoint", "localhost:4317", names="--otlp-endpoint"),
    "otlp-endpoint=bad-port": train("--otlp-endpoint", "http://h:99999", names="--otlp-endpoint"),
    "otlp-headers=no-equals": train("--otlp-headers", "abc", names=("--otlp-headers", "#1")),
    "otlp-timeout-s=0": train("--otlp-timeout-s", "0", names="--otlp-timeout-s"),
    "shutdown-timeout=9999": train("--otel-shutdown-timeout-s", "9999", names="--otel-shutdown"),
    # ---- flags: launch and paths -------------------------------------------------------------
    "config=missing.toml": train("--config", "missing.toml", names=("--config", "missing.toml")),
    "config=empty": train("--config", "", names="--config"),
    "config=5000-char-name": train("--config", LONG_NAME, names=("--config", "5000 characters")),
    "run-dir=5000-char-name": train("--run-dir", LONG_NAME, names=("--run-dir", "too long")),
    "save=5000-char-name": train(
        "--save", LONG_NAME, "--save-interval", "5", names=("--save", "too long")
    ),
    "data-path=5000-char-name": train("--data-path", LONG_NAME, names=("--data-path", "5000")),
    "script=5000-char-name": train("--script", LONG_NAME, names=("--script", "5000")),
    "config=directory": train("--config", "config_dir.toml", names=("--config", "directory")),
    "run-dir=under-a-regular-file": train(
        "--run-dir", "afile/run", names=("--run-dir", "is a file")
    ),
    "run-dir=a-regular-file": train("--run-dir", "afile", names=("--run-dir", "not a directory")),
    "run-dir=empty": train("--run-dir", "", names="--run-dir"),
    "save=under-a-regular-file": train(
        "--save", "afile/ckpt", "--save-interval", "5", names=("--save", "is a file")
    ),
    "save=empty": train("--save", "", names="--save"),
    "load=empty": train("--load", "", names="--load"),
    "run-dir=checkpoint-of-another-pipeline-size": train(
        "--config",
        "pp2",
        "--run-dir",
        "pp1run",
        "--save-interval",
        "5",
        names=("--run-dir", "--pipeline-model-parallel-size 1 (now 2)"),
    ),
    "load=checkpoint-of-another-pipeline-size": train(
        "--config", "pp2", "--load", "pp1ckpt", names=("--load", "pipeline-model-parallel-size 1")
    ),
    "save=checkpoint-of-another-pipeline-size": train(
        "--config", "pp2", "--save", "pp1ckpt", names=("--save", "empty directory")
    ),
    "data-path=/nonexistent": train(
        "--data-path", "/nonexistent", names=("--data-path", "/nonexistent")
    ),
    "data-path=empty": train("--data-path", "", names="--data-path"),
    "script=missing.py": train("--script", "missing.py", names=("--script", "missing.py")),
    "script=empty": train("--script", "", names="--script"),
    "script-and-module": train("--script", "x.py", "--module", "y", names="--module"),
    "module=blank": train("--module", "  ", names="--module"),
    # --module was not checked before launch (--script's file is): torchrun started, and every
    # worker failed with "No module named".
    "module=missing": train("--module", "no_such_mod", names=("--module", "'no_such_mod'")),
    "module=not-a-name": train("--module", "a-b", names=("--module", "'a-b'")),
    "module=package-without-main": train("--module", "json", names=("--module", "__main__")),
    "node-rank=2-nnodes=2": train(
        "--node-rank",
        "2",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        "h:29500",
        "--rdzv-id",
        "j",
        names="--node-rank",
    ),
    "rdzv-endpoint=nohost": train("--rdzv-endpoint", "nohost", names=("--rdzv-endpoint", "nohost")),
    "rdzv-endpoint=port-0": train("--rdzv-endpoint", "h:0", names="--rdzv-endpoint"),
    "rdzv-id=empty": train("--rdzv-id", "", names="--rdzv-id"),
    "nnodes=2-without-endpoint": train("--nnodes", "2", names="--rdzv-endpoint"),
    # ---- flags: the workers' output on the console (--tee, --local-ranks-filter) -------------
    "local-ranks-filter=2-of-2-ranks": train(
        "--local-ranks-filter", "2", names=("--local-ranks-filter", "rank 2", "0..1")
    ),
    "local-ranks-filter=4-of-2x2-ranks": train(
        "--local-ranks-filter",
        "0,4",
        "--nproc-per-node",
        "2",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        "h:29500",
        names=("--local-ranks-filter", "rank 4", "0..3"),
    ),  # fmt: skip
    "local-ranks-filter=word": train(
        "--local-ranks-filter", "one", names=("--local-ranks-filter", "'one' is not a rank")
    ),
    "local-ranks-filter=-1": train(
        "--local-ranks-filter", "-1", names=("--local-ranks-filter", "'-1' is not a rank")
    ),
    "local-ranks-filter=1.5": train(
        "--local-ranks-filter", "1.5", names=("--local-ranks-filter", "'1.5'")
    ),
    "local-ranks-filter=empty": train(
        "--local-ranks-filter", "", names=("--local-ranks-filter", "missing")
    ),
    "local-ranks-filter=empty-item": train(
        "--local-ranks-filter", "0,,1", names=("--local-ranks-filter", "missing")
    ),
    "local-ranks-filter=space-separated": train(
        "--local-ranks-filter", "0 1", names=("--local-ranks-filter", "'0 1'", "R[,R...]")
    ),
    "local-ranks-filter-with-no-tee": train(
        "--local-ranks-filter", "1", "--no-tee", names=("--local-ranks-filter", "--no-tee")
    ),
    "tee-and-no-tee": train("--tee", "--no-tee", names=("--tee", "--no-tee")),
    "config:local-ranks-filter=word": train(
        "--config", "ranks_filter_word.toml", names=("[launch] local_ranks_filter", "'first'")
    ),
    "config:tee=maybe": train("--config", "tee_maybe.toml", names=("[launch] tee", "maybe")),
    # ---- pass-through arguments the trainer rejects ------------------------------------------
    "passthrough=unknown-arg": train("--", "--bogus", names=("-- ARGS", "--bogus")),
    "passthrough=bad-int": train("--", "--num-layers", "x", names=("-- ARGS", "--num-layers")),
    "passthrough=bf16-and-fp16": train("--", "--bf16", "--fp16", names="--fp16"),
    "passthrough=eval-fraction=2": train("--", "--eval-fraction", "2", names="--eval-fraction"),
    "passthrough=lr-nan": train("--", "--lr", "nan", names=("--lr", "finite")),
    "passthrough=seed-huge": train("--", "--seed", str(2**70), names="--seed"),
    "bool-flag-given-a-value": train("--otel-enabled", "maybe", names=("-- ARGS", "maybe")),
    # ---- environment variables ---------------------------------------------------------------
    "env:ENABLED=maybe": train(
        names=("MEGATRON_OTEL_ENABLED", "maybe"), env={"MEGATRON_OTEL_ENABLED": "maybe"}
    ),
    "env:ENABLED=fullwidth-true": train(
        names="NEMO_LENS_ENABLED", env={"NEMO_LENS_ENABLED": "ｔｒｕｅ"}
    ),
    "env:SPAN_GROUP-typo": train(
        names=("MEGATRON_OTEL_SPAN_GROUP", "MEGATRON_OTEL_SPAN_GROUPS"),
        env={"MEGATRON_OTEL_SPAN_GROUP": "all"},
    ),
    "env:NEMO_LENS_EXPORTR-typo": train(
        names=("NEMO_LENS_EXPORTR", "NEMO_LENS_EXPORTER"), env={"NEMO_LENS_EXPORTR": "file"}
    ),
    "env:SPAN_GROUPS=full": train(
        names=("MEGATRON_OTEL_SPAN_GROUPS", "did you mean 'all'"),
        env={"MEGATRON_OTEL_SPAN_GROUPS": "full"},
    ),
    "env:SPAN_GROUPS=per_stepp": train(
        names="NEMO_LENS_SPAN_GROUPS", env={"NEMO_LENS_SPAN_GROUPS": "per_stepp"}
    ),
    "env:EXPORT_STRATEGY-conflicts-with-RANK_STRATEGY": train(
        names=("MEGATRON_OTEL_EXPORT_STRATEGY", "MEGATRON_OTEL_RANK_STRATEGY"),
        env={
            "MEGATRON_OTEL_EXPORT_STRATEGY": "all_ranks",
            "MEGATRON_OTEL_RANK_STRATEGY": "sampled",
        },
    ),
    "env:SAMPLING_STRATEGY-conflicts-with-SAMPLER_ENABLED": train(
        names="MEGATRON_OTEL_SAMPLING_STRATEGY",
        env={"MEGATRON_OTEL_SAMPLING_STRATEGY": "rank_aware", "MEGATRON_OTEL_SAMPLER_ENABLED": "0"},
    ),
    "env:SAMPLING_STRATEGY=weird": train(
        names="MEGATRON_OTEL_SAMPLING_STRATEGY", env={"MEGATRON_OTEL_SAMPLING_STRATEGY": "weird"}
    ),
    "env:EXPORT_RANK=abc": train(
        names="MEGATRON_OTEL_EXPORT_RANK", env={"MEGATRON_OTEL_EXPORT_RANK": "abc"}
    ),
    "env:EXPORTER=kafka": train(
        names=("MEGATRON_OTEL_EXPORTER", "kafka"), env={"MEGATRON_OTEL_EXPORTER": "kafka"}
    ),
    "env:RUN_ID=../../etc": train(
        names=("MEGATRON_OTEL_RUN_ID", "../../etc"), env={"MEGATRON_OTEL_RUN_ID": "../../etc"}
    ),
    "env:RUN_ID=unicode-rün": train(
        names="MEGATRON_OTEL_RUN_ID", env={"MEGATRON_OTEL_RUN_ID": "rün"}
    ),
    "env:OTEL_TRACES_SAMPLER=always-on": train(
        names=("OTEL_TRACES_SAMPLER", "always_on"), env={"OTEL_TRACES_SAMPLER": "always-on"}
    ),
    "env:OTEL_TRACES_SAMPLER_ARG=1.5-traceidratio": train(
        names="OTEL_TRACES_SAMPLER_ARG",
        env={"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"},
    ),
    "env:OTEL_EXPORTER_OTLP_PROTOCOL=http/json": train(
        names=("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
        env={"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
    ),
    "env:OTEL_EXPORTER_OTLP_ENDPOINT=localhost:4317": train(
        names="OTEL_EXPORTER_OTLP_ENDPOINT", env={"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost:4317"}
    ),
    "env:OTEL_EXPORTER_OTLP_HEADERS-without-equals": train(
        names="OTEL_EXPORTER_OTLP_HEADERS", env={"OTEL_EXPORTER_OTLP_HEADERS": "authorization"}
    ),
    "env:OTEL_RESOURCE_ATTRIBUTES-without-equals": train(
        names="OTEL_RESOURCE_ATTRIBUTES", env={"OTEL_RESOURCE_ATTRIBUTES": "a=1,b"}
    ),
    "env:OTEL_SDK_DISABLED=maybe": train(
        names="OTEL_SDK_DISABLED", env={"OTEL_SDK_DISABLED": "maybe"}
    ),
    "env:OTEL_METRIC_EXPORT_INTERVAL=-5": train(
        names="OTEL_METRIC_EXPORT_INTERVAL", env={"OTEL_METRIC_EXPORT_INTERVAL": "-5"}
    ),
    "env:EXPORT_STRATEGY-takes-two-arguments": train(
        names=("MEGATRON_OTEL_EXPORT_STRATEGY", "cannot be called with one RankInfo"),
        env={
            "MEGATRON_OTEL_ENABLED": "1",
            "MEGATRON_OTEL_EXPORT_STRATEGY": "os:rename",
        },
    ),
    "env:SHUTDOWN_TIMEOUT=inf": train(
        names="MEGATRON_OTEL_SHUTDOWN_TIMEOUT", env={"MEGATRON_OTEL_SHUTDOWN_TIMEOUT": "inf"}
    ),
    # ---- config files ------------------------------------------------------------------------
    "config:unknown-key": train(
        "--config", "unknown_key.toml", names=("train_iterz", "train_iters")
    ),
    "config:unknown-section": train("--config", "unknown_section.toml", names=("modle", "model")),
    "config:wrong-type": train("--config", "wrong_type.toml", names=("[training] train_iters",)),
    "config:boolean-for-an-int": train(
        "--config", "bool_for_int.toml", names=("[training] train_iters", "boolean")
    ),
    "config:boolean-for-a-float": train(
        "--config", "bool_for_float.toml", names=("[training] lr", "boolean")
    ),
    "config:wrong-bool": train("--config", "wrong_bool.toml", names=("[telemetry] enabled",)),
    "config:spec-is-an-int": train("--config", "spec_int.toml", names=("[telemetry] span_groups",)),
    "config:section-is-a-scalar": train(
        "--config", "section_scalar.toml", names=("[launch]", "table")
    ),
    "config:bad-spec": train("--config", "bad_spec.toml", names=("[telemetry] span_groups",)),
    "config:spec-full": train(
        "--config", "full_spec.toml", names=("[telemetry] span_groups", "did you mean 'all'")
    ),
    "config:bad-header": train("--config", "bad_header.toml", names=("[telemetry.otel] headers",)),
    "config:array-value": train("--config", "array_value.toml", names=("[model] num_layers",)),
    "config:run-dir-under-a-regular-file": train(
        "--config",
        "run_dir_under_file.toml",
        names=("[launch] run_dir", "is a file"),
        add_run_dir=False,
    ),
    "config:quoted-number": train(
        "--config", "quoted_number.toml", names=("[training] train_iters", "train_iters = 30")
    ),
    "config:quoted-float": train(
        "--config", "quoted_float.toml", names=("[training] lr", "lr = 0.001")
    ),
    "config:int-beyond-int64": train(
        "--config", "huge_int.toml", names=("[training] train_iters", "64 bits")
    ),
    "config:fraction-for-an-int": train(
        "--config", "fraction_for_int.toml", names=("[training] train_iters", "got 2.5")
    ),
    "config=tny-did-you-mean": train("--config", "tny", names=("--config", "'tiny'")),
    "otel-run-id=-rf": train("--otel-run-id=-rf", names=("--otel-run-id", "start")),
    "otel-run-id=.hidden": train("--otel-run-id", ".hidden", names=("--otel-run-id", "start")),
    "config:not-toml": train("--config", "not_toml.toml", names=("not_toml.toml", "TOML")),
    "config:binary": train("--config", "binary.toml", names=("binary.toml", "cannot read")),
}

OTHER: dict[str, Bad] = {
    # The other commands: misspelt names, bad specs and shapes, missing or unreadable traces.
    "unknown-command": Bad(("trian",), ("no such command", "'train'")),
    "unknown-trace-command": Bad(("trace", "sumary", "x"), ("no such command", "'summary'")),
    "groups-resolve=-layer-before-dashes": Bad(("groups", "resolve", "-layer"), ("-- -layer",)),
    "groups-resolve=per_stepp": Bad(("groups", "resolve", "per_stepp"), ("SPEC", "per_step")),
    "groups-resolve=full": Bad(("groups", "resolve", "full"), ("SPEC", "did you mean 'all'")),
    "capture-groups=full": Bad(
        ("trace", "capture", "runx", "--groups", "full", "--iterations", "2"),
        ("--groups", "'full'", "did you mean 'all'"),
    ),
    "groups-resolve=dash-only": Bad(("groups", "resolve", "-"), ("SPEC", "'-'")),
    "groups-resolve=unicode-défault": Bad(("groups", "resolve", "défault"), ("SPEC", "défault")),
    "groups-resolve=10000-chars": Bad(("groups", "resolve", LONG_SPEC), ("SPEC", "10000")),
    "groups-resolve=layers-not-divisible": Bad(
        ("groups", "resolve", "all", "--layers", "3", "--pp", "2"), ("--layers",)
    ),
    "groups-resolve=pp-0": Bad(("groups", "resolve", "all", "--pp", "0"), ("--pp",)),
    "groups-resolve=env-SPAN_GROUPS-typo": Bad(
        ("groups", "resolve"), ("MEGATRON_OTEL_SPAN_GROUPS",), {"MEGATRON_OTEL_SPAN_GROUPS": "al"}
    ),
    "groups-resolve=env-unknown-variable": Bad(
        ("groups", "resolve"), ("NEMO_LENS_SPAN_GROUP",), {"NEMO_LENS_SPAN_GROUP": "all"}
    ),
    "trace-summary=missing-path": Bad(("trace", "summary", "nope"), ("nope", "no such file")),
    "trace-goodput=missing-path": Bad(("trace", "goodput", "nope"), ("nope", "no such file")),
    "trace-summary=empty-directory": Bad(("trace", "summary", "config_dir.toml"), ("config_dir",)),
    "trace-summary=not-json": Bad(("trace", "summary", "not_traces.jsonl"), ("not_traces.jsonl",)),
    "trace-summary=5000-char-path": Bad(("trace", "summary", LONG_NAME), ("5000 characters",)),
    "trace-export=5000-char-output": Bad(
        ("trace", "export", "not_traces.jsonl", "-o", LONG_NAME), ("cannot write",)
    ),
    "trace-export=missing-path": Bad(
        ("trace", "export", "nope", "-o", "t.json"), ("nope", "no such file")
    ),
    "trace-export=unknown-format": Bad(
        ("trace", "export", "nope", "-o", "t.json", "--format", "svg"), ("--format", "svg")
    ),
    # ---- outputs never destroy what is there; hostile trace inputs ------------------------
    "trace-export=output-is-the-input-trace": Bad(
        ("trace", "export", "runx", "-o", "runx/telemetry/traces-rank0.jsonl"),
        ("--output", "traces-rank0.jsonl", "input trace file"),
    ),
    "trace-report=output-is-the-input-trace": Bad(
        (
            "trace",
            "report",
            "runx/telemetry/traces-rank0.jsonl",
            "-o",
            "runx/telemetry/traces-rank0.jsonl",
        ),
        ("--output", "input trace file"),
    ),  # fmt: skip
    "trace-export=output-is-a-run-file": Bad(
        ("trace", "export", "runx", "-o", "runx/progress.jsonl"),
        ("--output", "progress.jsonl", "run directory"),
    ),
    "trace-report=output-is-a-run-file": Bad(
        ("trace", "report", "runx", "-o", "runx/progress.jsonl"), ("--output", "run directory")
    ),
    "trace-export=output-is-a-directory": Bad(
        ("trace", "export", "runx", "-o", "config_dir.toml"), ("--output", "is a directory")
    ),
    "trace-report=output-is-a-directory": Bad(
        ("trace", "report", "runx", "-o", "config_dir.toml"), ("--output", "is a directory")
    ),
    "trace-summary=trace-file-is-a-directory": Bad(
        ("trace", "summary", "runy"), ("traces-rank0.jsonl", "is a directory, not a trace file")
    ),
    "trace-goodput=a-device": Bad(("trace", "goodput", "/dev/null"), ("/dev/null", "regular")),
    "trace-summary=chrome-trace": Bad(
        ("trace", "summary", "chrome.json"), ("chrome.json", "Chrome trace-event", "traces-rank")
    ),
    "trace-goodput=chrome-trace-skip-invalid": Bad(
        ("trace", "goodput", "chrome.json", "--skip-invalid"), ("chrome.json", "Chrome")
    ),
    "trace-summary=span-name-a-number": Bad(
        ("trace", "summary", "name_is_a_number.jsonl"), ("name_is_a_number.jsonl:1:", "'name'")
    ),
    "trace-goodput=span-attributes-a-string": Bad(
        ("trace", "goodput", "attributes_a_string.jsonl"),
        ("attributes_a_string.jsonl:1:", "'attributes' is not a list"),
    ),
    "trace-export=span-attributes-a-string": Bad(
        ("trace", "export", "attributes_a_string.jsonl", "-o", "t.json"),
        ("attributes_a_string.jsonl:1:", "malformed span"),
    ),
    "doctor-config=missing": Bad(("doctor", "--config", "missing.toml"), ("missing.toml",)),
    "doctor-config=5000-char-name": Bad(("doctor", "--config", LONG_NAME), ("--config", "5000")),
    "doctor-config=directory": Bad(("doctor", "--config", "config_dir.toml"), ("config_dir.toml",)),
}


@pytest.fixture(autouse=True)
def workdir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty working directory holding :data:`FILES`, and no telemetry/SLURM variables."""
    for name in list(os.environ):
        if name.startswith(PREFIXES):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    for name, content in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            (tmp_path / name).mkdir()
        elif isinstance(content, bytes):
            (tmp_path / name).write_bytes(content)
        else:
            (tmp_path / name).write_text(content, encoding="utf-8")
    return tmp_path


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], dict[str, str]]]:
    """The spawn function, patched to record calls (and fail loudly if one happens)."""
    calls: list[tuple[list[str], dict[str, str]]] = []

    def fake_spawn(argv: list[str], env: dict[str, str], log: object) -> object:
        calls.append((argv, env))
        raise AssertionError("a process was started for bad input")

    monkeypatch.setattr(lrun, "spawn", fake_spawn)
    return calls


def invoke(argv: tuple[str, ...], env: dict[str, str]):  # noqa: ANN201 - click's Result
    """Run ``mlaunch ARGV`` in-process, as the console script builds it."""
    return CliRunner().invoke(build_app(argv[0]), list(argv), env=env)


def test_corpus_is_large_and_covers_every_source() -> None:
    ids = list(TRAIN) + list(OTHER)
    assert len(ids) >= 50 and len(set(ids)) == len(ids)
    assert sum(i.startswith("env:") for i in TRAIN) >= 15
    assert sum(i.startswith("config:") for i in TRAIN) >= 10


@pytest.mark.parametrize("case", list(TRAIN.values()) + list(OTHER.values()), ids=[*TRAIN, *OTHER])
def test_bad_input_exits_2_naming_it_and_creates_and_starts_nothing(
    case: Bad, workdir: Path, spawned: list[tuple[list[str], dict[str, str]]]
) -> None:
    before = sorted(p.name for p in workdir.iterdir())
    result = invoke(case.argv, case.env)
    output = result.output  # stdout and stderr together: the user sees both
    assert result.exit_code == 2, output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert "Traceback" not in output
    flat = " ".join(output.split())  # Rich may wrap long lines in a narrow terminal
    for word in case.names:
        assert word in output or word in flat, f"{word!r} not in:\n{output}"
    assert spawned == []
    assert not (workdir / "runs").exists()
    assert not (workdir / RUN_DIR).exists()
    assert sorted(p.name for p in workdir.iterdir()) == before  # nothing else appeared either


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(("--otel-span-groups", ""), id="span-groups=empty-means-no-groups"),
        pytest.param(("--otel-span-groups", " , ,"), id="span-groups=only-empty-parts"),
        pytest.param(("--otel-user-id", ""), id="user-id=empty-is-the-default"),
    ],
)
def test_empty_values_that_are_valid(args: tuple[str, ...], spawned: list) -> None:
    result = invoke(("train", "--dry-run", *args), {})
    assert result.exit_code == 0, result.output
    assert spawned == []


@pytest.mark.parametrize(
    "var", ["MEGATRON_OTEL_SPAN_GROUPS", "MEGATRON_OTEL_RUN_ID", "OTEL_TRACES_SAMPLER"]
)
def test_an_empty_or_blank_variable_counts_as_unset(var: str, spawned: list) -> None:
    result = invoke(("train", "--dry-run"), {var: "  "})
    assert result.exit_code == 0, result.output
