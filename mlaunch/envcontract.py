"""The one definition of the environment the launcher hands to workers (variable names only: the
run directory's layout and records are :mod:`mlaunch.rundir`'s).

Workers rebuild their settings from exactly these variables (plus the standard ``OTEL_*`` ones).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

# The run directory's default place (its layout and records: mlaunch.rundir, not re-exported).
from mlaunch.rundir.layout import default_run_dir

#: Primary and fallback prefixes of the telemetry keys: a ``MEGATRON_OTEL_*`` variable wins over
#: the ``NEMO_LENS_*`` one of the same key (nemo-lens's spelling, still understood).
PRIMARY_PREFIX = "MEGATRON_OTEL_"
FALLBACK_PREFIX = "NEMO_LENS_"

#: The run directory the launcher created; workers write traces, spools and progress there.
RUN_DIR = "MLAUNCH_RUN_DIR"
#: The run id, as the launcher chose it (also exported as MEGATRON_OTEL_RUN_ID).
RUN_ID = PRIMARY_PREFIX + "RUN_ID"
#: CUDA's hardware work-queue count. Megatron-LM's argument check requires ``1`` with tensor or
#: context parallelism > 1 before Blackwell; ``mlaunch train`` sets it then unless the user did.
CUDA_DEVICE_MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
#: The standard OpenTelemetry variables (the SDK's names) mlaunch reads, sets or checks; each is
#: spelled here once. Every standard variable starts with OTEL_PREFIX.
OTEL_PREFIX = "OTEL_"
OTEL_SERVICE_NAME = "OTEL_SERVICE_NAME"
OTEL_TRACES_SAMPLER = "OTEL_TRACES_SAMPLER"
OTEL_TRACES_SAMPLER_ARG = "OTEL_TRACES_SAMPLER_ARG"
OTEL_RESOURCE_ATTRIBUTES = "OTEL_RESOURCE_ATTRIBUTES"
OTEL_METRIC_EXPORT_INTERVAL = "OTEL_METRIC_EXPORT_INTERVAL"
OTEL_SDK_DISABLED = "OTEL_SDK_DISABLED"
#: The per-signal words of the OTLP exporter variables ("" is the base variable, for all signals).
OTLP_SIGNAL_WORDS = ("", "TRACES_", "METRICS_", "LOGS_")
#: What an OTLP exporter variable may configure (``OTEL_EXPORTER_OTLP_[<SIGNAL>_]<OPTION>``).
OTLP_OPTIONS = (
    "ENDPOINT", "PROTOCOL", "HEADERS", "TIMEOUT", "CERTIFICATE", "COMPRESSION", "INSECURE",
    "CLIENT_KEY", "CLIENT_CERTIFICATE",
)  # fmt: skip


def otlp_var(option: str, signal: str = "") -> str:
    """``OTEL_EXPORTER_OTLP_<OPTION>``, or for a signal (``traces``, ``METRICS_`` ...) the
    per-signal ``OTEL_EXPORTER_OTLP_<SIGNAL>_<OPTION>``, which the SDK reads first."""
    word = signal.upper().rstrip("_")
    return f"OTEL_EXPORTER_OTLP_{word}_{option}" if word else f"OTEL_EXPORTER_OTLP_{option}"


OTLP_ENDPOINT = otlp_var("ENDPOINT")
OTLP_TRACES_ENDPOINT = otlp_var("ENDPOINT", "traces")
OTLP_METRICS_ENDPOINT = otlp_var("ENDPOINT", "metrics")
OTLP_PROTOCOL = otlp_var("PROTOCOL")
OTLP_TRACES_PROTOCOL = otlp_var("PROTOCOL", "traces")
OTLP_METRICS_PROTOCOL = otlp_var("PROTOCOL", "metrics")
OTLP_HEADERS = otlp_var("HEADERS")
OTLP_TIMEOUT = otlp_var("TIMEOUT")
OTLP_TRACES_TIMEOUT = otlp_var("TIMEOUT", "traces")
OTLP_CERTIFICATE = otlp_var("CERTIFICATE")
OTLP_INSECURE = otlp_var("INSECURE")
#: Standard SDK variables mlaunch neither reads nor sets: known so that doctor can tell a typo
#: of a real variable from a variable it has never heard of.
OTEL_SDK_ONLY_VARS = (
    "OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_LOGS_EXPORTER",
    "OTEL_PROPAGATORS", "OTEL_LOG_LEVEL", "OTEL_METRIC_EXPORT_TIMEOUT",
    "OTEL_BSP_SCHEDULE_DELAY", "OTEL_BSP_EXPORT_TIMEOUT", "OTEL_BSP_MAX_QUEUE_SIZE",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT",
    "OTEL_ATTRIBUTE_COUNT_LIMIT", "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT",
    "OTEL_SPAN_EVENT_COUNT_LIMIT", "OTEL_SPAN_LINK_COUNT_LIMIT",
    "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE",
)  # fmt: skip
#: Where an OTLP exporter sends (the SDK reads these). With the launcher's embedded receiver the
#: launcher sets the base endpoint and protocol itself, so the user's values are not inherited.
OTLP_TARGET_VARS: tuple[str, ...] = tuple(
    otlp_var(what, signal) for what in ("ENDPOINT", "PROTOCOL") for signal in OTLP_SIGNAL_WORDS
)
#: The OTLP exporters' header variables (base and per signal; the SDK and nemo-lens read the
#: per-signal one first). Secrets: never printed or written. With the launcher's receiver the
#: workers get only the receiver's token here (the user's headers stay with the launcher).
OTLP_HEADERS_VARS: tuple[str, ...] = tuple(otlp_var("HEADERS", s) for s in OTLP_SIGNAL_WORDS)
#: The header that carries the launcher receiver's per-launch token (``Bearer <token>``), as the
#: OpenTelemetry collector's ``bearertokenauth`` expects it; gRPC metadata keys are lower case.
RECEIVER_AUTH_HEADER = "authorization"
#: ``cuda`` when ``mlaunch train --device cuda`` asked for it (unset otherwise; ``cpu`` hides the
#: GPUs instead): such a worker refuses to start without CUDA or with fewer GPUs than local workers.
DEVICE = "MLAUNCH_DEVICE"
#: ``python -P`` as a variable (Python 3.11+): nothing from the current directory on sys.path.
#: Set for mlaunch's trainer, so a folder named ``mlaunch`` where the job starts never shadows the
#: installed package.
SAFE_PATH = "PYTHONSAFEPATH"
#: W3C trace context of the launcher's ``mlaunch.job.attempt`` span, as the workers receive it
#: (``00-<32 hex trace id>-<16 hex span id>-01``); the trainer links its first span to it.
TRACEPARENT = "TRACEPARENT"
#: Set by torchrun in every worker: 0 for the first worker group, +1 per restart.
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
#: ``<32 hex trace id>:<16 hex base>``: the worker-side entry wrapper
#: (``mlaunch.launcher.attempt_entry``, which keeps a copy of these three names) derives the current
#: attempt's span id from it; set only when the launcher emits a job trace.
ATTEMPT_TRACE = "MLAUNCH_ATTEMPT_TRACE"
#: Megatron-LM's start-up trace reads these where its entry point does (``pretrain_hybrid.py``;
#: ``pretrain_gpt.py`` does not): Unix time in seconds as a decimal (``time.time()``) of the
#: launch script's first line and of the moment it ran ``srun``. With both (START <= PRESRUN <= the
#: worker's first line) ``megatron.startup`` is backdated to START, with children
#: ``megatron.startup.launch_script`` (START -> PRESRUN) and ``.container_load`` (PRESRUN -> the
#: worker's first line); with ``SLURM_JOB_START_TIME`` before START, a ``pre_startup`` span covers
#: the gap. The launcher sets them (unless inherited) to its own start and to the moment it starts
#: torchrun, so a worker's trace begins when ``mlaunch train`` did; the entry wrapper
#: (``mlaunch.launcher.attempt_entry``, which keeps copies of the names) drops them in a restarted
#: attempt, whose start-up began long after them.
LAUNCH_SCRIPT_START_TIME = "LENS_LAUNCH_SCRIPT_START_TIME"
LAUNCH_SCRIPT_PRESRUN_TIME = "LENS_LAUNCH_SCRIPT_PRESRUN_TIME"
#: The launcher's pid, given to torchrun so that it stops when the launcher dies (orphan_guard).
LAUNCHER_PID = "MLAUNCH_LAUNCHER_PID"
#: Test-only fault injection understood by the trainer (never set by the launcher itself).
FAIL_AT_ITERATION = "MLAUNCH_TEST_FAIL_AT_ITERATION"

#: torch's NCCL flight recorder, set for the workers of a job that may use NCCL unless the user
#: set them: ring size, dump when NCCL's own timeout fires, where dumps go (``<prefix><rank>``),
#: and the prefix of the named pipe (``<prefix><rank>.pipe``) a write to which dumps the ring now.
NCCL_TRACE_BUFFER_SIZE = "TORCH_NCCL_TRACE_BUFFER_SIZE"
NCCL_DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
NCCL_DEBUG_INFO_TEMP_FILE = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
NCCL_DEBUG_INFO_PIPE_FILE = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"


def worker_run_dir(environ: Mapping[str, str], run_id: str) -> Path:
    """The run directory a worker uses: ``MLAUNCH_RUN_DIR`` or ``./runs/<run_id>/``."""
    given = environ.get(RUN_DIR, "").strip()
    return Path(given) if given else default_run_dir(run_id)


#: With FAIL_AT_ITERATION: only this rank fails (test-only; unset = every rank).
FAIL_RANK = "MLAUNCH_TEST_FAIL_RANK"
#: Test-only: make the gradients of iteration k non-finite (exercises skip-and-count).
NAN_AT_ITERATION = "MLAUNCH_TEST_NAN_AT_ITERATION"
#: Test-only: the checkpoint writer of iteration k pauses after writing its shard data, before the
#: manifest and the rename (a kill -9 there leaves an unfinished save).
PAUSE_IN_SAVE = "MLAUNCH_TEST_PAUSE_IN_SAVE"
#: Test-only: telemetry also writes every span it hands to the exporter to
#: ``telemetry/tee-traces-rank{R}.jsonl``, so a test knows every span the run produced.
TEE_SPANS = "MLAUNCH_TEST_TEE_SPANS"
#: ``1``: the flight recorder's recorded spans use their pure-Python classes even where the C
#: accelerator (``mlaunch.telemetry._cspan``) is built (the same behaviour, slower; tests run both).
PURE_PYTHON_SPANS = "MLAUNCH_PURE_PYTHON_SPANS"
#: The signals that stop training gracefully (``--preempt-signals`` wins), e.g. ``SIGTERM,SIGUSR1``.
PREEMPT_SIGNALS = "MLAUNCH_PREEMPT_SIGNALS"


#: Test hook: ``MLAUNCH_TEST_SLOW_AT_ITERATION=k`` makes iteration k sleep (on the rank named by
#: ``MLAUNCH_TEST_SLOW_RANK``, else every rank), so the flight recorder's slow trigger can be
#: tested without timing luck.
SLOW_AT_ITERATION = "MLAUNCH_TEST_SLOW_AT_ITERATION"
SLOW_RANK = "MLAUNCH_TEST_SLOW_RANK"
#: Test hook: ``MLAUNCH_TEST_ITERATION_PAUSE=S`` makes every iteration sleep S seconds (every
#: rank, inside its ``megatron.train.iteration`` span): a job that only has to keep running while
#: a test drives it (a capture, a signal, a watch) idles instead of taking the test machine's
#: cores (the tiny model's iteration is a few ms of compute, so an open-ended job otherwise
#: trains flat out on every core it can get).
ITERATION_PAUSE = "MLAUNCH_TEST_ITERATION_PAUSE"
#: Test hook: ``MLAUNCH_TEST_SLOW_FORWARD_AT=k,k,...`` makes the first microbatch's forward of
#: those iterations sleep 1 s (inside its ``megatron.microbatch.forward`` span) on the rank named
#: by ``MLAUNCH_TEST_SLOW_RANK`` (else every rank): a straggler in a known phase, for
#: ``mlaunch trace stragglers``.
SLOW_FORWARD_AT = "MLAUNCH_TEST_SLOW_FORWARD_AT"
