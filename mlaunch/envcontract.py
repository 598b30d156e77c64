"""The one definition of the environment the launcher hands to workers, and of the run-directory
layout that workers, the launcher and ``mlaunch trace`` share.

Workers rebuild their settings from exactly these variables (plus the standard ``OTEL_*`` ones).
"""

from __future__ import annotations

import json
import math
import os
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

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

# Run-directory layout (relative to the run directory). Each name is spelled once, here; writers
# build paths from it and readers derive their globs and parsers from it.


class NumberedName:
    """A run-directory name with one number in it (a rank, a node rank), written as a template
    with one named field (``"error-rank{rank}.json"``): the one spelling from which the writer's
    name, the reader's glob and the reader's parser all derive."""

    __slots__ = ("template", "glob", "_field", "_re")

    def __init__(self, template: str) -> None:
        fields = [
            (f, spec) for _, f, spec, _ in string.Formatter().parse(template) if f is not None
        ]
        if len(fields) != 1 or not fields[0][0]:
            raise ValueError(f"{template!r}: a numbered name has exactly one named field")
        self.template = template
        self._field, spec = fields[0]
        head, _, tail = template.partition("{" + self._field + (f":{spec}" if spec else "") + "}")
        #: The shell pattern of every such name (``error-rank*.json``).
        self.glob = f"{head}*{tail}"
        # A zero-padded field (``{iteration:07d}``) is exactly that many digits, as written.
        padded = re.fullmatch(r"0(\d+)d", spec or "")
        digits = rf"(\d{{{padded.group(1)}}})" if padded else r"(\d+)"
        self._re = re.compile(re.escape(head) + digits + re.escape(tail))

    def name(self, number: int) -> str:
        """The name for ``number``."""
        return self.template.format_map({self._field: number})

    def parse(self, name: str) -> int | None:
        """The number of ``name`` when it is such a name (the whole of it), else None."""
        m = self._re.fullmatch(name)
        return int(m.group(1)) if m else None

    def __repr__(self) -> str:
        return f"NumberedName({self.template!r})"


TELEMETRY_DIR = "telemetry"
LOGS_DIR = "logs"
CHECKPOINTS_DIR = "checkpoints"
PROGRESS_FILE = "progress.jsonl"
RESOLVED_ENV_FILE = "resolved.env"
RESOLVED_JSON_FILE = "resolved.json"
COMMAND_FILE = "command.txt"
#: What the trainer writes when a rank fails (read by the launcher and ``mlaunch status``).
ERROR_FILE = NumberedName("error-rank{rank}.json")
ERROR_FILE_TEMPLATE = ERROR_FILE.template
#: One node's folder of torchrun logs, under :data:`LOGS_DIR`.
NODE_LOG_DIR = NumberedName("node{node}")
#: ``mlaunch sbatch``: the batch script it submitted, and the job it became (id, submit time).
JOB_SCRIPT_FILE = "job.sbatch"
SLURM_JOB_FILE = "slurm-job.json"
#: The batch job's output (``%j``: the job id), appended to by every incarnation of the job.
SLURM_OUTPUT_TEMPLATE = "slurm-%j.out"
#: Every incarnation's batch output in a run directory (:data:`SLURM_OUTPUT_TEMPLATE`'s glob).
SLURM_OUTPUT_GLOB = SLURM_OUTPUT_TEMPLATE.replace("%j", "*")
#: A node other than node 0 of a multi-node run writes its progress view here (under its log dir).
LAUNCHER_LOG = "launcher.log"
#: torchrun's own output (its restarts, a group's failure), under each node's log directory.
TORCHRUN_LOG = "torchrun.log"
#: ``mlaunch trace report``'s page, at the top of the run directory unless ``-o`` says otherwise.
REPORT_FILE = "report.html"
#: Under :data:`TELEMETRY_DIR`: what earlier ``mlaunch trace replay`` runs delivered (per spool
#: file, the byte offset up to which every line was sent), and the lock one replay holds on it.
REPLAY_LEDGER_FILE = "replayed.json"
REPLAY_LOCK_FILE = ".replay.lock"

# Checkpoints (Megatron-LM's layout, ``torch`` format), under ``--save``: the trainer writes them
# (torch) and the launcher reads their manifests before launch (standard library only).

#: The marker naming the newest committed checkpoint, replaced atomically after each commit.
CHECKPOINT_TRACKER_FILE = "latest_checkpointed_iteration.txt"
#: One checkpoint's directory (``iter_0000010``).
CHECKPOINT_ITER_DIR = NumberedName("iter_{iteration:07d}")
#: Written last in a checkpoint's directory: every file's size and sha256.
CHECKPOINT_MANIFEST_FILE = "manifest.json"
#: One pipeline stage's shard, in its ``mp_rank_00[_PPP]`` directory.
CHECKPOINT_MODEL_FILE = "model_optim_rng.pt"
#: Before a checkpoint directory's name while its save is unfinished (nothing reads it as one).
CHECKPOINT_TMP_PREFIX = ".tmp."
#: Every unfinished save's directory.
CHECKPOINT_TMP_GLOB = CHECKPOINT_TMP_PREFIX + CHECKPOINT_ITER_DIR.glob


# Telemetry files, under TELEMETRY_DIR: ``{signal}-{sender}.jsonl`` (OTLP/JSON lines), the sender
# a rank (``rank3``), ``unranked`` or a node's launcher (``launcher-node0``); what could not be
# delivered goes to the same name behind SPOOL_PREFIX.

#: The OTLP signals, in the order a replay sends them.
SIGNALS = ("traces", "metrics", "logs")
#: The file-name word for telemetry the launcher's embedded OTLP receiver got from a process
#: whose resource has no ``dl.rank`` attribute (so it cannot be put in a rank's file).
UNRANKED = "unranked"
#: The sender word of one rank, and of one node's launcher (its job trace).
RANK_SENDER = NumberedName("rank{rank}")
LAUNCHER_SENDER = NumberedName("launcher-node{node}")
#: Before a telemetry file's name: the spool of what could not be delivered to that file's
#: destination (same format as the file exporter's).
SPOOL_PREFIX = "spool-"


def _telemetry_name(signal: str, sender: str, spool: bool = False) -> str:
    return f"{SPOOL_PREFIX if spool else ''}{signal}-{sender}.jsonl"


def telemetry_file_name(
    signal: str, rank: int | None = None, *, launcher_node: int | None = None, spool: bool = False
) -> str:
    """The name of a telemetry file: ``traces-rank3.jsonl``, ``logs-unranked.jsonl`` (``rank``
    None), ``traces-launcher-node0.jsonl`` (``launcher_node``), each behind ``spool-`` for a
    spool."""
    if launcher_node is not None:
        sender = LAUNCHER_SENDER.name(launcher_node)
    else:
        sender = UNRANKED if rank is None else RANK_SENDER.name(rank)
    return _telemetry_name(signal, sender, spool)


#: A rank's flight-recorder dumps (OTLP-JSON lines, read by ``mlaunch trace`` with the traces).
RECORDER_FILE = NumberedName("recorder-rank{rank}.jsonl")

#: A request to the running workers (``mlaunch trace capture``), at the top of the run directory;
#: each worker reads it at most once a second, off its training thread.
CAPTURE_REQUEST_FILE = "capture-request.json"
#: A rank's answer to the latest live capture (under :data:`TELEMETRY_DIR`): scheduled, running,
#: done or missed, with the iterations it covered; ``mlaunch trace capture --wait`` reads it.
CAPTURE_ACK_FILE = NumberedName("capture-ack-rank{rank}.json")
#: The states an ack names, in order: the rank takes requests, has armed a capture, is in its
#: window, has ended it, or got to it too late. The last two are final.
CAPTURE_ACK_STATES = ("listening", "scheduled", "running", "done", "missed")
CAPTURE_FINAL_STATES = frozenset({"done", "missed"})
#: A rank's answer to capture request ``{id}``, under TELEMETRY_DIR (nemo-lens workers: applied or
#: why not, and when the groups were switched and switched back; mlaunch.lens_hook.capture).
LENS_CAPTURE_ACK_TEMPLATE = "capture-ack-rank{rank}-{id}.json"

#: A rank's progress beat, under :data:`HEARTBEAT_DIR`: the iteration it last started and when,
#: rewritten in place (at most once a second, off the training thread) by every process that set
#: up ``mlaunch.telemetry`` under ``mlaunch train``; the launcher's hang watchdog reads it. Not under
#: TELEMETRY_DIR: a run with telemetry off keeps its beat too, and writes no telemetry.
HEARTBEAT_DIR = "heartbeat"
HEARTBEAT_FILE = NumberedName("rank{rank}.json")

#: What a hang leaves (``mlaunch train --hang-timeout``), under the run directory's ``hang/``:
#: each node's launcher writes its ranks' report, the merge of every node's, one file of Python
#: stacks per rank (py-spy, every thread), and each mlaunch worker's open spans.
HANG_DIR = "hang"
HANG_REPORT_FILE = "report.json"
HANG_NODE_REPORT = NumberedName("report-node{node}.json")
HANG_STACKS_FILE = NumberedName("stacks-rank{rank}.txt")
HANG_SPANS_FILE = NumberedName("spans-rank{rank}.json")
#: torch's NCCL flight recorder, set for the workers of a job that may use NCCL unless the user
#: set them: ring size, dump when NCCL's own timeout fires, where dumps go (``<prefix><rank>``),
#: and the prefix of the named pipe (``<prefix><rank>.pipe``) a write to which dumps the ring now.
NCCL_TRACE_BUFFER_SIZE = "TORCH_NCCL_TRACE_BUFFER_SIZE"
NCCL_DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
NCCL_DEBUG_INFO_TEMP_FILE = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
NCCL_DEBUG_INFO_PIPE_FILE = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"
#: The file-name prefixes mlaunch gives those two (under :data:`HANG_DIR`; torch appends the rank).
NCCL_TRACE_PREFIX = "nccl-trace-rank"
NCCL_PIPE_PREFIX = "nccl-pipe-rank"


def heartbeat_file(run_dir: str | Path, rank: int) -> Path:
    """Where one rank's progress beat is (:data:`HEARTBEAT_FILE`)."""
    return Path(run_dir) / HEARTBEAT_DIR / HEARTBEAT_FILE.name(rank)


def hang_dir(run_dir: str | Path) -> Path:
    """The run directory's ``hang/`` folder (:data:`HANG_DIR`)."""
    return Path(run_dir) / HANG_DIR


# ``progress.jsonl`` (:data:`PROGRESS_FILE`): one JSON object per line, appended and flushed by the
# rank that owns the loss, one per iteration and one per evaluation. Its two records are these
# dataclasses (their fields, in order, are the JSON keys): the trainer writes them with
# :func:`progress_line`, readers read them back with :func:`read_progress_record`. Every field may
# read as None: a non-finite float is written as null, and an earlier trainer's line, or a cut
# one, may lack keys, which read as None rather than make the line unreadable.


@dataclass(frozen=True, slots=True)
class ProgressStep:
    """One training iteration's line of ``progress.jsonl``."""

    iteration: int | None
    train_iters: int | None
    loss: float | None
    lr: float | None
    grad_norm: float | None
    tokens_per_sec: float | None
    step_ms: float | None
    #: CPU time of the whole process during the step (steadier than wall time on a shared host).
    cpu_ms: float | None
    skipped: bool | None
    #: Wall clock at the end of the step: a reader can see stalls between steps.
    time: float | None
    #: Data parallelism only (else left out): the step's gradient buckets, and how many of them
    #: the last backward launched itself (all of them when the all-reduce overlaps backward).
    grad_buckets: int | None = None
    grad_buckets_in_backward: int | None = None


@dataclass(frozen=True, slots=True)
class ProgressEval:
    """One evaluation's line of ``progress.jsonl``."""

    iteration: int | None
    eval_loss: float | None
    #: The greedy completion of a held-out prompt (``--sample-tokens``), else left out.
    sample: str | None = None


#: The fields a record leaves out of its line when they are None (they apply to some runs only).
_OPTIONAL_PROGRESS_FIELDS = frozenset({"grad_buckets", "grad_buckets_in_backward", "sample"})


def progress_line(record: ProgressStep | ProgressEval) -> str:
    """``record`` as its line of ``progress.jsonl`` (with the newline); a non-finite float is
    written as ``null`` (JSON has no NaN)."""
    out: dict[str, Any] = {}
    for f in fields(record):
        value = getattr(record, f.name)
        if value is None and f.name in _OPTIONAL_PROGRESS_FIELDS:
            continue
        out[f.name] = None if isinstance(value, float) and not math.isfinite(value) else value
    return json.dumps(out) + "\n"


#: Either record of ``progress.jsonl``.
ProgressRecord = ProgressStep | ProgressEval

_STEP_FIELDS = tuple(f.name for f in fields(ProgressStep))
_EVAL_FIELDS = tuple(f.name for f in fields(ProgressEval))


def read_progress_record(raw: bytes | str) -> ProgressRecord | None:
    """One line of ``progress.jsonl`` as its record: an evaluation's when it has ``eval_loss``,
    else a step's when it has ``loss``; None for a line that is neither, or no JSON object (a
    crash can cut the last line). A key the line lacks reads as None; values are the line's own,
    unchecked (a reader checks the type of what it uses, as it checked the JSON object's), and
    keys no record has are dropped."""
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    if "eval_loss" in record:
        return ProgressEval(**{name: record.get(name) for name in _EVAL_FIELDS})
    if "loss" in record:
        return ProgressStep(**{name: record.get(name) for name in _STEP_FIELDS})
    return None


def read_progress_tail(run_dir: str | Path, limit: int = 64 << 10) -> list[ProgressStep]:
    """The training records in the last ``limit`` bytes of ``run_dir``'s ``progress.jsonl``,
    oldest first ([] when it cannot be read): what a view of a running job needs of a file that
    grows with the run, without reading it whole. The line the cut falls inside is dropped."""
    try:
        with (Path(run_dir) / PROGRESS_FILE).open("rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(max(0, size - limit))
            lines = fh.read().splitlines()
    except OSError:
        return []
    if size > limit:
        lines = lines[1:]
    return [r for r in map(read_progress_record, lines) if isinstance(r, ProgressStep)]


#: The glob of every rank's traces file (what the file exporter writes).
TRACES_FILE_GLOB = _telemetry_name("traces", RANK_SENDER.glob)
#: The glob of every node's launcher job trace (``traces-launcher-node{N}.jsonl``).
LAUNCHER_TRACES_FILE_GLOB = _telemetry_name("traces", LAUNCHER_SENDER.glob)


@dataclass(frozen=True, slots=True)
class TelemetryFile:
    """What a telemetry file's name says (:func:`parse_telemetry_file`)."""

    signal: str
    spool: bool = False
    #: The sending rank; None for ``unranked`` and for a launcher.
    rank: int | None = None
    #: The node of the launcher that sent it (its job trace), else None.
    launcher_node: int | None = None


def parse_telemetry_file(name: str) -> TelemetryFile | None:
    """The signal, spool flag and sender of a telemetry file name (the inverse of
    :func:`telemetry_file_name`), or None when ``name`` is no such name."""
    spool = name.startswith(SPOOL_PREFIX)
    stem = name.removeprefix(SPOOL_PREFIX) if spool else name
    signal, sep, rest = stem.partition("-")
    if not sep or signal not in SIGNALS or not rest.endswith(".jsonl"):
        return None
    sender = rest.removesuffix(".jsonl")
    if sender == UNRANKED:
        return TelemetryFile(signal, spool)
    if (rank := RANK_SENDER.parse(sender)) is not None:
        return TelemetryFile(signal, spool, rank=rank)
    if (node := LAUNCHER_SENDER.parse(sender)) is not None:
        return TelemetryFile(signal, spool, launcher_node=node)
    return None


def spooled(path: Path) -> Path:
    """The spool next to a telemetry file: what could not be delivered to its destination."""
    return path.with_name(SPOOL_PREFIX + path.name)


def recorder_file(run_dir: str | Path, rank: int) -> Path:
    """Where one rank's flight recorder writes its dumps."""
    return Path(run_dir) / TELEMETRY_DIR / RECORDER_FILE.name(rank)


def capture_ack_file(run_dir: str | Path, rank: int) -> Path:
    """Where one rank acknowledges the latest live capture (:data:`CAPTURE_ACK_FILE`)."""
    return Path(run_dir) / TELEMETRY_DIR / CAPTURE_ACK_FILE.name(rank)


def profiler_trace_file(run_dir: str | Path, rank: int, capture_id: str) -> Path:
    """Where a live capture's torch.profiler trace of one rank goes (Chrome trace JSON, beside
    the spans, for HTA and Perfetto)."""
    return Path(run_dir) / TELEMETRY_DIR / f"profiler-rank{rank}-{capture_id}.json"


def lens_capture_ack_file(run_dir: str | Path, rank: int, request_id: str) -> Path:
    """Where ``rank`` answers capture request ``request_id``."""
    return (
        Path(run_dir) / TELEMETRY_DIR / LENS_CAPTURE_ACK_TEMPLATE.format(rank=rank, id=request_id)
    )


def traces_file(run_dir: str | Path, rank: int) -> Path:
    """The file exporter's trace output of one rank (OTLP-JSON lines)."""
    return Path(run_dir) / TELEMETRY_DIR / telemetry_file_name("traces", rank)


def launcher_traces_file(run_dir: str | Path, node_rank: int = 0) -> Path:
    """The launcher's own job trace (``mlaunch.job`` / ``mlaunch.job.attempt``) of one node."""
    return Path(run_dir) / TELEMETRY_DIR / telemetry_file_name("traces", launcher_node=node_rank)


def run_lock_file(run_dir: str | Path, node_rank: int = 0) -> Path:
    """The lock one node's launcher holds on its run directory for its lifetime (``flock``):
    per node, because every node of a multi-node run shares the run directory legitimately."""
    return Path(run_dir) / f".lock-node{node_rank}"


def launcher_record_file(run_dir: str | Path, node_rank: int = 0) -> Path:
    """One node's launcher's record of its launch (pid, host, start, each restart, how it ended),
    rewritten as they happen: what ``mlaunch status`` reads whatever the telemetry settings."""
    return Path(run_dir) / f"launcher-node{node_rank}.json"


def metrics_file(run_dir: str | Path, rank: int) -> Path:
    """The file exporter's metric output of one rank (OTLP-JSON lines)."""
    return Path(run_dir) / TELEMETRY_DIR / telemetry_file_name("metrics", rank)


def spool_file(run_dir: str | Path, rank: int | None, signal: str = "traces") -> Path:
    """Where spans/metrics that could not be delivered are kept (same format as the file exporter).
    ``rank=None``: what the embedded receiver got from a process that did not say its rank."""
    return Path(run_dir) / TELEMETRY_DIR / telemetry_file_name(signal, rank, spool=True)


def received_file(run_dir: str | Path, signal: str, rank: int | None) -> Path:
    """Where the embedded OTLP receiver writes one rank's ``traces``/``metrics``/``logs``: the
    file exporter's names (:func:`traces_file`, :func:`metrics_file`), ``logs-rank{R}.jsonl``,
    and ``{signal}-unranked.jsonl`` for a sender without ``dl.rank``."""
    return Path(run_dir) / TELEMETRY_DIR / telemetry_file_name(signal, rank)


def receiver_stats_file(run_dir: str | Path, node_rank: int = 0) -> Path:
    """The embedded receiver's counts of one node (received, written, rejected, spooled ...)."""
    return Path(run_dir) / TELEMETRY_DIR / f"receiver-node{node_rank}.json"


def span_counts_file(run_dir: str | Path, rank: int) -> Path:
    """Where one rank's telemetry runtime writes, at shutdown, where its spans went (emitted =
    delivered + spooled + dropped): the launcher's end-of-run report reads it."""
    return Path(run_dir) / TELEMETRY_DIR / f"span-counts-rank{rank}.json"


def default_run_dir(run_id: str, cwd: str | Path | None = None) -> Path:
    """``./runs/<run_id>/`` under the current (or given) directory."""
    return Path(cwd or os.getcwd()) / "runs" / run_id


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


def tee_file(run_dir: str | Path, rank: int) -> Path:
    """Where the test-only span tee of one rank goes (see :data:`TEE_SPANS`)."""
    return Path(run_dir) / TELEMETRY_DIR / f"tee-{telemetry_file_name('traces', rank)}"


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
