"""The run directory's layout: every path in it named once.

Writers build paths from these names and functions; readers derive their globs and parsers from
the same spelling (:class:`NumberedName`). The environment variable names that point workers at a
run directory stay in :mod:`mlaunch.envcontract`.
"""

from __future__ import annotations

import os
import re
import string
from dataclasses import dataclass
from pathlib import Path

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
#: ``mlaunch trainjob``: the Kubeflow Trainer TrainJob it created (``kubectl apply -f``-able).
TRAINJOB_FILE = "trainjob.yaml"
#: ... and the TrainJob it became (name, namespace, API server, run id): ``status RUN_DIR`` asks it.
TRAINJOB_RECORD_FILE = "trainjob.json"
#: The batch job's output (``%j``: the job id), appended to by every incarnation of the job.
SLURM_OUTPUT_TEMPLATE = "slurm-%j.out"
#: Every incarnation's batch output in a run directory (:data:`SLURM_OUTPUT_TEMPLATE`'s glob).
SLURM_OUTPUT_GLOB = SLURM_OUTPUT_TEMPLATE.replace("%j", "*")
#: A node other than node 0 of a multi-node run writes its progress view here (under its log dir).
LAUNCHER_LOG = "launcher.log"
#: torchrun's own output (its restarts, a group's failure), under each node's log directory.
TORCHRUN_LOG = "torchrun.log"
#: A worker's stdout and stderr in its local rank's folder of a torchrun attempt
#: (``<log-dir>/<id>/attempt_<N>/<local rank>/``; torch's names, ``--redirects 3``).
WORKER_STDOUT_LOG = "stdout.log"
WORKER_STDERR_LOG = "stderr.log"
#: Under a node's log directory, torchrun makes one ``<rdzv id>_<random>`` folder per launch and
#: in it one folder per attempt (restart), in which each local rank's folder holds its output
#: (torchrun's names; :mod:`mlaunch.rundir.worker_logs` reads them).
TORCHRUN_ATTEMPT_DIR = NumberedName("attempt_{attempt}")
#: A worker's output files in its local rank's folder (``--redirects 3``), in the order shown.
WORKER_STREAMS = (WORKER_STDOUT_LOG, WORKER_STDERR_LOG)
#: Beside them: the worker's global rank, written by mlaunch's wrapper as the worker starts
#: (torchrun's rendezvous may number a node's ranks otherwise than its node rank says).
WORKER_RANK_FILE = "rank"
#: What torchelastic's ``@record`` leaves in a failed worker's log folder (torch's name).
TORCHELASTIC_ERROR_FILE = "error.json"
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
#: One line per dump of a rank's flight recorder (rank, seq, trigger, time, spans, the iterations
#: its ring held), appended after the dump itself: what ``mlaunch status`` and the report's window
#: read instead of the dumps' spans.
RECORDER_INDEX_FILE = NumberedName("recorder-dumps-rank{rank}.jsonl")

#: A request to the running workers (``mlaunch trace capture``), at the top of the run directory;
#: each worker reads it at most once a second, off its training thread.
CAPTURE_REQUEST_FILE = "capture-request.json"
#: The user's request to stop the run (``mlaunch stop``), at the top of the run directory: who asked,
#: when, and whether without a save (``--now``). Written before the launchers get their signal:
#: the launcher reads it to tell ``--now`` from a graceful stop, a SLURM job's batch script to not
#: requeue a stop the user asked for, and ``mlaunch status`` to say stopped, not preempted.
STOP_REQUEST_FILE = "stop-request.json"
#: One line per capture request the newest one replaced (``mlaunch trace capture`` appends it
#: before writing the next): its id, final phase, groups, iterations and ranks, so the run model
#: keeps every capture of the run although the request file and the acks hold the latest only.
CAPTURES_LOG_FILE = "captures.jsonl"
#: A rank's answer to the latest live capture (under :data:`TELEMETRY_DIR`): scheduled, running,
#: done or missed, with the iterations it covered; ``mlaunch trace capture --wait`` reads it.
CAPTURE_ACK_FILE = NumberedName("capture-ack-rank{rank}.json")
#: The states an ack names, in order: the rank takes requests, has armed a capture, is in its
#: window, has ended it, or got to it too late (those two are final); ``ended``: the rank's
#: telemetry shut down with no capture under way (it no longer listens).
CAPTURE_ACK_STATES = ("listening", "scheduled", "running", "done", "missed", "ended")
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

#: The file-name prefixes mlaunch gives those two (under :data:`HANG_DIR`; torch appends the rank).
NCCL_TRACE_PREFIX = "nccl-trace-rank"
NCCL_PIPE_PREFIX = "nccl-pipe-rank"


def heartbeat_file(run_dir: str | Path, rank: int) -> Path:
    """Where one rank's progress beat is (:data:`HEARTBEAT_FILE`)."""
    return Path(run_dir) / HEARTBEAT_DIR / HEARTBEAT_FILE.name(rank)


def hang_dir(run_dir: str | Path) -> Path:
    """The run directory's ``hang/`` folder (:data:`HANG_DIR`)."""
    return Path(run_dir) / HANG_DIR


#: The glob of every rank's traces file (what the file exporter writes).
TRACES_FILE_GLOB = _telemetry_name("traces", RANK_SENDER.glob)
#: The glob of every rank's metrics file.
METRICS_FILE_GLOB = _telemetry_name("metrics", RANK_SENDER.glob)
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


def recorder_index_file(run_dir: str | Path, rank: int) -> Path:
    """Where one rank's recorder lists its dumps (:data:`RECORDER_INDEX_FILE`)."""
    return Path(run_dir) / TELEMETRY_DIR / RECORDER_INDEX_FILE.name(rank)


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


#: The lock of one node's launcher (:func:`run_lock_file`) and its record
#: (:func:`launcher_record_file`), every node's found by their globs.
RUN_LOCK_FILE = NumberedName(".lock-node{node}")
LAUNCHER_RECORD_FILE = NumberedName("launcher-node{node}.json")


def run_lock_file(run_dir: str | Path, node_rank: int = 0) -> Path:
    """The lock one node's launcher holds on its run directory for its lifetime (``flock``):
    per node, because every node of a multi-node run shares the run directory legitimately."""
    return Path(run_dir) / RUN_LOCK_FILE.name(node_rank)


def launcher_record_file(run_dir: str | Path, node_rank: int = 0) -> Path:
    """One node's launcher's record of its launch (pid, host, start, each restart, how it ended),
    rewritten as they happen: what ``mlaunch status`` reads whatever the telemetry settings."""
    return Path(run_dir) / LAUNCHER_RECORD_FILE.name(node_rank)


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


def is_run_dir(path: str | Path) -> bool:
    """Whether ``path`` holds what ``mlaunch train`` or ``mlaunch sbatch`` leave in every run
    directory (its resolved settings, node 0's launcher record, the SLURM job, or worker logs)."""
    path = Path(path)
    return (
        (path / RESOLVED_JSON_FILE).is_file()
        or launcher_record_file(path).is_file()
        or (path / SLURM_JOB_FILE).is_file()
        or (path / LOGS_DIR).is_dir()
    )


def default_run_dir(run_id: str, cwd: str | Path | None = None) -> Path:
    """``./runs/<run_id>/`` under the current (or given) directory."""
    return Path(cwd or os.getcwd()) / "runs" / run_id


def tee_file(run_dir: str | Path, rank: int) -> Path:
    """Where the test-only span tee of one rank goes (see :data:`TEE_SPANS`)."""
    return Path(run_dir) / TELEMETRY_DIR / f"tee-{telemetry_file_name('traces', rank)}"


__all__ = [
    "METRICS_FILE_GLOB",
    "TORCHELASTIC_ERROR_FILE",
    "CAPTURES_LOG_FILE",
    "RECORDER_INDEX_FILE",
    "recorder_index_file",
    "NumberedName",
    "TELEMETRY_DIR",
    "LOGS_DIR",
    "CHECKPOINTS_DIR",
    "PROGRESS_FILE",
    "RESOLVED_ENV_FILE",
    "RESOLVED_JSON_FILE",
    "COMMAND_FILE",
    "ERROR_FILE",
    "ERROR_FILE_TEMPLATE",
    "NODE_LOG_DIR",
    "JOB_SCRIPT_FILE",
    "SLURM_JOB_FILE",
    "TRAINJOB_FILE",
    "TRAINJOB_RECORD_FILE",
    "SLURM_OUTPUT_TEMPLATE",
    "SLURM_OUTPUT_GLOB",
    "LAUNCHER_LOG",
    "TORCHRUN_LOG",
    "WORKER_STDOUT_LOG",
    "WORKER_STDERR_LOG",
    "TORCHRUN_ATTEMPT_DIR",
    "WORKER_STREAMS",
    "WORKER_RANK_FILE",
    "REPORT_FILE",
    "REPLAY_LEDGER_FILE",
    "REPLAY_LOCK_FILE",
    "CHECKPOINT_TRACKER_FILE",
    "CHECKPOINT_ITER_DIR",
    "CHECKPOINT_MANIFEST_FILE",
    "CHECKPOINT_MODEL_FILE",
    "CHECKPOINT_TMP_PREFIX",
    "CHECKPOINT_TMP_GLOB",
    "SIGNALS",
    "UNRANKED",
    "RANK_SENDER",
    "LAUNCHER_SENDER",
    "SPOOL_PREFIX",
    "telemetry_file_name",
    "RECORDER_FILE",
    "CAPTURE_REQUEST_FILE",
    "STOP_REQUEST_FILE",
    "RUN_LOCK_FILE",
    "LAUNCHER_RECORD_FILE",
    "CAPTURE_ACK_FILE",
    "CAPTURE_ACK_STATES",
    "CAPTURE_FINAL_STATES",
    "LENS_CAPTURE_ACK_TEMPLATE",
    "HEARTBEAT_DIR",
    "HEARTBEAT_FILE",
    "HANG_DIR",
    "HANG_REPORT_FILE",
    "HANG_NODE_REPORT",
    "HANG_STACKS_FILE",
    "HANG_SPANS_FILE",
    "NCCL_TRACE_PREFIX",
    "NCCL_PIPE_PREFIX",
    "heartbeat_file",
    "hang_dir",
    "TRACES_FILE_GLOB",
    "LAUNCHER_TRACES_FILE_GLOB",
    "TelemetryFile",
    "parse_telemetry_file",
    "spooled",
    "recorder_file",
    "capture_ack_file",
    "profiler_trace_file",
    "lens_capture_ack_file",
    "traces_file",
    "launcher_traces_file",
    "run_lock_file",
    "launcher_record_file",
    "metrics_file",
    "spool_file",
    "received_file",
    "receiver_stats_file",
    "span_counts_file",
    "default_run_dir",
    "is_run_dir",
    "tee_file",
]
