"""What a hang leaves and what it says: every local worker's Python stacks (py-spy, from outside
the process), each mlaunch worker's open spans, the verdict that groups the ranks by where they
are, and the report files under the run directory's ``hang/`` (read by ``mlaunch status``).

Why py-spy: it reads a process's memory from outside (``process_vm_readv`` under ptrace rights),
so it works for any worker - mlaunch's trainer, a Megatron-LM script, a main thread blocked in C
code (a collective) - without the worker's cooperation; its wheel is one static binary for every
CPython version (the launcher's Python need not be the worker's: nemo-lens workers run 3.12 or
3.13), and ``py-spy dump --json`` gives frames as data. pystack (the other candidate) is built per
CPython version and prints text only.

The verdict is pure (:func:`judge`): a list of :class:`RankView` in, one line out.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mlaunch.model.groups import SpanGroup
from mlaunch.model.spans import SPANS, Attr, canonical_name
from mlaunch.rundir import layout as lay
from mlaunch.rundir.atomic import write_json
from mlaunch.rundir.records import read_hang_reports
from mlaunch.rundir.state import log_superseded

#: How long one ``py-spy dump`` may take (it pauses the worker while it reads its stacks).
PY_SPY_TIMEOUT_S = 20.0
#: How long the launcher waits for the mlaunch workers' open-span files (their request watcher
#: looks once a second).
SPANS_WAIT_S = 3.0
#: torch.distributed functions that block until the peers arrive: a main thread inside one of
#: them is waiting for another rank.
COLLECTIVE_FUNCTIONS = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier",
    "monitored_barrier", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv",
    "isend", "irecv", "wait", "batch_isend_irecv", "_wait",
})  # fmt: skip
#: Span groups whose spans wait for other ranks by design (pipeline P2P, gradient all-reduce).
WAITING_GROUPS = frozenset({SpanGroup.COMMUNICATION.value})


def py_spy() -> str | None:
    """The py-spy executable: beside this Python (a venv's ``bin``), else on ``PATH``."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.is_file() else shutil.which("py-spy")


# --------------------------------------------------------------------------------------------
# One rank


@dataclass
class RankView:
    """Where one rank is, as its stacks and open spans say."""

    rank: int
    local_rank: int | None = None
    pid: int | None = None
    span: str | None = None
    """The innermost open span of its main thread (mlaunch workers; None when unknown)."""
    iteration: int | None = None
    microbatch: int | None = None
    stage: int | None = None
    since_s: float | None = None
    """How long the innermost span has been open."""
    frame: str | None = None
    """``file:line function`` of the main thread's innermost Python frame."""
    in_collective: bool = False
    """Its main thread waits in a torch.distributed call or a communication span."""
    stacks_file: str | None = None
    spans_file: str | None = None
    collect_s: float | None = None
    """Wall time of its ``py-spy dump``."""
    error: str | None = None
    """Why its stacks could not be read."""
    process: str | None = None
    """What the kernel says the process is doing when that matters to the verdict: ``stopped``
    (SIGSTOP, a debugger) or ``in uninterruptible I/O``; None otherwise."""


def _frame_text(frame: dict[str, Any]) -> str:
    return f"{frame.get('filename')}:{frame.get('line')} {frame.get('name')}"


def main_thread(threads: list[dict[str, Any]], pid: int | None) -> dict[str, Any] | None:
    """The main thread of a ``py-spy dump --json`` process (its OS thread id is the pid)."""
    for t in threads:
        if t.get("thread_name") == "MainThread" or (pid and t.get("os_thread_id") == pid):
            return t
    return threads[0] if threads else None


def stack_in_collective(frames: list[dict[str, Any]]) -> bool:
    """Whether a stack (innermost first) is inside a blocking torch.distributed call."""
    return any(
        "torch/distributed" in str(f.get("filename", "")).replace("\\", "/")
        and str(f.get("name", "")).rsplit(".", 1)[-1] in COLLECTIVE_FUNCTIONS
        for f in frames
    )


def stacks_text(threads: list[dict[str, Any]], rank: int, pid: int) -> str:
    """The stack file of one rank: every thread, innermost frame first."""
    lines = [f"rank {rank} (pid {pid}): {len(threads)} thread(s), innermost frame first", ""]
    for t in threads:
        state = "active" if t.get("active") else "idle"
        gil = ", holds the GIL" if t.get("owns_gil") else ""
        lines.append(f'Thread {t.get("os_thread_id")} ({state}{gil}): "{t.get("thread_name")}"')
        lines += [f"    {f.get('name')} ({f.get('filename')}:{f.get('line')})"
                  for f in t.get("frames") or []]  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def _py_spy_dump(exe: str, pid: int, *extra: str) -> tuple[list[dict[str, Any]] | None, str]:
    """One ``py-spy dump --json`` (``extra``: more options); ``(threads, error)``."""
    try:
        out = subprocess.run(
            [exe, "dump", "--pid", str(pid), "--json", *extra], capture_output=True, text=True,
            timeout=PY_SPY_TIMEOUT_S, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return None, f"py-spy took over {PY_SPY_TIMEOUT_S:g} s"
    if out.returncode == 0:
        with contextlib.suppress(ValueError):
            data = json.loads(out.stdout)
            if isinstance(data, list):
                return data, ""
        return None, "py-spy printed no JSON"
    lines = [ln.strip() for ln in out.stderr.splitlines() if ln.strip()]
    # Its message is the first line; a Rust backtrace may follow.
    return None, "py-spy: " + next(
        (ln for ln in lines if ln.startswith("Error")), lines[0] if lines else "failed"
    )


def dump_stacks(pid: int) -> tuple[list[dict[str, Any]] | None, str | None, float]:
    """``(threads, error, seconds)`` of ``pid``'s stacks. py-spy first pauses the process for a
    consistent read; a process it cannot pause (stopped by SIGSTOP, traced) is read without
    pausing (``--nonblocking``: a hung process's stacks do not move)."""
    exe = py_spy()
    if exe is None:
        return None, "py-spy is not installed (pip install py-spy)", 0.0
    t0 = time.perf_counter()
    threads, error = _py_spy_dump(exe, pid)
    if threads is None:
        threads, again = _py_spy_dump(exe, pid, "--nonblocking")
        error = error if threads is None else ""
        if threads is None and again != error:
            error = f"{error}; {again}"
    return threads, error or None, time.perf_counter() - t0


#: /proc states worth saying in a verdict.
_PROCESS_STATES = {"T": "stopped", "t": "stopped", "D": "in uninterruptible I/O"}


def process_state(pid: int) -> str | None:
    """``stopped`` / ``in uninterruptible I/O`` from ``/proc/<pid>/stat``, else None."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return _PROCESS_STATES.get(state)


def _span_facts(view: RankView, spans_body: dict[str, Any], now_ns: int) -> None:
    """Fill the span, iteration, microbatch and stage from a worker's open-span file."""
    threads = spans_body.get("threads") or []
    chosen = next((t for t in threads if t.get("thread") == "MainThread"), None)
    chosen = chosen or next((t for t in threads if t.get("spans")), None)
    spans = (chosen or {}).get("spans") or []
    if spans:
        inner = spans[-1]
        view.span = inner.get("name")
        start = inner.get("start_ns")
        if isinstance(start, int) and start > 0:
            view.since_s = round(max(0, now_ns - start) / 1e9, 1)
        known = SPANS.get(canonical_name(str(view.span)))
        if known is not None and known.group.value in WAITING_GROUPS:
            view.in_collective = True
    for s in reversed(spans):
        attrs = s.get("attributes") or {}
        if view.iteration is None and isinstance(attrs.get(Attr.ITERATION.value), int):
            view.iteration = attrs[Attr.ITERATION.value]
        for key in (Attr.MICROBATCH_ID.value, Attr.DL_MICROBATCH_ID.value):
            if view.microbatch is None and isinstance(attrs.get(key), int):
                view.microbatch = attrs[key]
        if view.stage is None and isinstance(attrs.get(Attr.PP_RANK.value), int):
            view.stage = attrs[Attr.PP_RANK.value]
    if view.iteration is None and isinstance(spans_body.get("iteration"), int):
        view.iteration = spans_body["iteration"]


# --------------------------------------------------------------------------------------------
# The verdict


def _where(v: RankView, stuck_s: float | None = None) -> str:
    """Where a rank is, as the verdict says it (ranks saying the same are grouped); ``stuck_s``:
    how long it has been there, said of the odd one out."""
    if v.error and v.frame is None and v.span is None:
        return f"{v.process + ', ' if v.process else ''}stacks not read ({v.error})"
    text = f"in {v.span}" if v.span else (f"at {v.frame}" if v.frame else "somewhere unknown")
    if v.process:
        text = f"{v.process}, {text}"
    if v.iteration is not None:
        text += f" (iteration {v.iteration})"
    if stuck_s is not None:
        text += f" for {stuck_s:.0f} s"
    if _waits(v):
        text += ", waiting in a collective"
    elif v.span and v.frame:
        text += f", at {v.frame}"
    return text


def _waits(v: RankView) -> bool:
    """Whether a rank waits for others (a stopped process waits for nothing: it is the hang)."""
    return v.in_collective and v.process != "stopped"


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, sorted(ranks)))


def judge(views: Iterable[RankView]) -> str:
    """One line: the ranks grouped by where they are, the odd one out named last.

    The odd ones out: ranks not waiting in a collective while others are (the ones the others
    wait for); else, when every rank waits, the ranks at the lowest iteration when the others
    are further (behind the others)."""
    views = sorted(views, key=lambda v: v.rank)
    if not views:
        return "no local worker to inspect"
    groups: dict[str, list[RankView]] = {}
    for v in views:
        groups.setdefault(_where(v), []).append(v)
    unread = {k for k in groups if "stacks not read" in k}
    waiting = {k for k, g in groups.items() if all(_waits(v) for v in g)}
    odd: set[str] = set()
    why = ""
    if waiting and len(waiting) + len(unread) < len(groups):
        odd, why = set(groups) - waiting - unread, "the rank the others wait for"
    elif waiting and unread:  # every rank that could be read waits: the others are suspects
        odd, why = unread, "the rank the others wait for"
    elif len(groups) > 1:
        lowest = {
            k: min((v.iteration for v in g if v.iteration is not None), default=None)
            for k, g in groups.items()
        }
        known = [i for i in lowest.values() if i is not None]
        if known and min(known) < max(known):
            odd, why = {k for k, i in lowest.items() if i == min(known)}, "behind the others"
    parts = []
    for key, group in sorted(groups.items(), key=lambda kv: (kv[0] in odd, kv[1][0].rank)):
        ranks = _ranks_text([v.rank for v in group])
        if key not in odd:
            parts.append(f"{ranks}: {key}")
            continue
        stuck = max((v.since_s for v in group if v.since_s is not None), default=None)
        plural = why if len(group) == 1 else why.replace("the rank ", "the ranks ")
        parts.append(f"{ranks}: {_where(group[0], stuck)} \N{EM DASH} {plural}")
    if len(groups) == 1:
        parts.append("no rank stands out")
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------
# Collecting


@dataclass
class Worker:
    """One local worker process of the hung attempt."""

    rank: int
    local_rank: int
    pid: int


@dataclass
class HangReport:
    """One node's hang report (``hang/report-node<N>.json``)."""

    detected_at: float
    node: int
    attempt: int
    timeout_s: float
    silent_s: float
    """Seconds without progress when the hang was declared."""
    source: str
    """What progress was watched (heartbeats, progress.jsonl, receiver, worker output)."""
    action: str
    verdict: str = ""
    ranks: list[RankView] = field(default_factory=list)
    nccl: dict[str, Any] = field(default_factory=dict)
    collect_s: float = 0.0
    """From the hang's detection to the verdict."""
    recorder_files: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def request_hang_spans(run_dir: Path, run_id: str) -> str:
    """Ask every mlaunch worker of the run for its open spans and its recorder's ring (the
    capture request with ``trigger: "hang"``; ranks: all, so nodes writing it at once agree)."""
    rid = f"hang-{os.getpid()}-{time.time_ns():x}"
    body = {
        "id": rid, "created_ns": time.time_ns(), "run_id": run_id, "ranks": None,
        "recorded": True, "trigger": "hang", "open_spans": True,
    }  # fmt: skip
    log_superseded(run_dir)  # a user's capture it replaces stays in the run model
    write_json(run_dir / lay.CAPTURE_REQUEST_FILE, body)
    return rid


#: A hang request younger than this is the current hang's (nodes detect within seconds).
HANG_REQUEST_FRESH_S = 30.0


def _fresh_hang_request(run_dir: Path, since: float) -> str | None:
    """The id of the hang request in the run directory when one was written in the last
    :data:`HANG_REQUEST_FRESH_S` (by this or another node's launcher) and after ``since`` (the
    attempt's start: older ones its workers ignore), else None."""
    body = _read_json(run_dir / lay.CAPTURE_REQUEST_FILE)
    if body is None or body.get("trigger") != "hang" or not isinstance(body.get("created_ns"), int):
        return None
    if body["created_ns"] < max(time.time_ns() - HANG_REQUEST_FRESH_S * 1e9, since * 1e9):
        return None
    return str(body.get("id") or "") or None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def nccl_dump(run_dir: Path, ranks: list[int], nccl_env: bool) -> dict[str, Any]:
    """Ask torch's NCCL flight recorder of each rank to dump now (a write to its named pipe);
    say where the dumps go, or why there are none (a gloo job has no NCCL flight recorder)."""
    if not nccl_env:
        return {"available": False, "note": "not available: the job does not use NCCL (gloo)"}
    hang = lay.hang_dir(run_dir)
    asked = []
    for rank in ranks:
        pipe = hang / f"{lay.NCCL_PIPE_PREFIX}{rank}.pipe"
        with contextlib.suppress(OSError):  # no pipe: that rank has no NCCL process group
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
            try:
                os.write(fd, b"1\n")
                asked.append(rank)
            finally:
                os.close(fd)
    files = [str(hang / f"{lay.NCCL_TRACE_PREFIX}{r}") for r in ranks]
    note = (
        f"dump asked of rank(s) {','.join(map(str, asked))}; torch writes {lay.NCCL_TRACE_PREFIX}<R>"
        if asked
        else "no NCCL process group answered (none created yet, or not NCCL); torch dumps"
        " there itself when NCCL's own timeout fires"
    )
    return {"available": True, "asked": asked, "files": files, "note": note}


def collect(
    report: HangReport, run_dir: Path, run_id: str, workers: list[Worker],
    mlaunch_ranks: set[int], nccl_env: bool, detected_mono: float, since: float = 0.0,
) -> HangReport:  # fmt: skip
    """Collect every local worker's stacks (in parallel), the mlaunch workers' open spans, the
    NCCL dump; judge; write the stack files and this node's report. Never raises on a worker
    that cannot be read (its rank says why)."""
    hang = lay.hang_dir(run_dir)
    hang.mkdir(parents=True, exist_ok=True)
    rid = _fresh_hang_request(run_dir, since) or ""  # another node asked already: its answers count
    if not rid and mlaunch_ranks:
        for w in workers:  # an earlier hang's files must not be read as this one's
            with contextlib.suppress(OSError):
                (hang / lay.HANG_SPANS_FILE.name(w.rank)).unlink()
        rid = request_hang_spans(run_dir, run_id)
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(workers)))) as pool:
        dumps = list(pool.map(lambda w: dump_stacks(w.pid), workers))
    report.nccl = nccl_dump(run_dir, [w.rank for w in workers], nccl_env)
    now_ns = time.time_ns()
    views = []
    for w, (threads, error, took) in zip(workers, dumps, strict=True):
        v = RankView(w.rank, w.local_rank, w.pid, collect_s=round(took, 3), error=error,
                     process=process_state(w.pid))  # fmt: skip
        if threads is not None:
            path = hang / lay.HANG_STACKS_FILE.name(w.rank)
            path.write_text(stacks_text(threads, w.rank, w.pid), encoding="utf-8")
            v.stacks_file = str(path)
            main = main_thread(threads, w.pid)
            frames = (main or {}).get("frames") or []
            if frames:
                v.frame = _frame_text(frames[0])
            v.in_collective = stack_in_collective(frames)
        views.append(v)
    # The open spans: the watchers answer within a second or so; a worker whose watcher is
    # stuck too (a main thread holding the GIL in C code) leaves only its stacks.
    deadline = time.monotonic() + SPANS_WAIT_S
    pending = {v.rank: v for v in views if v.rank in mlaunch_ranks and v.process != "stopped"}
    while pending and time.monotonic() < deadline:
        # Nodes writing the one request file at once: the workers answer whichever landed.
        asked = {rid, _fresh_hang_request(run_dir, since)}
        for rank, v in list(pending.items()):
            path = hang / lay.HANG_SPANS_FILE.name(rank)
            body = _read_json(path)
            if body is not None and body.get("request") in asked:
                _span_facts(v, body, now_ns)
                v.spans_file = str(path)
                del pending[rank]
        if pending:
            time.sleep(0.1)
    report.recorder_files = sorted(
        str(lay.recorder_file(run_dir, v.rank)) for v in views
        if lay.recorder_file(run_dir, v.rank).exists()
    )  # fmt: skip
    report.ranks = views
    report.verdict = judge(views)
    report.collect_s = round(time.monotonic() - detected_mono, 2)
    write_report(run_dir, report)
    return report


def write_report(run_dir: Path, report: HangReport) -> None:
    """This node's report, then the merge of every node's report present (``report.json``)."""
    hang = lay.hang_dir(run_dir)
    write_json(hang / lay.HANG_NODE_REPORT.name(report.node), report.as_json(), indent=1)
    write_merged(run_dir)


def write_merged(run_dir: Path) -> None:
    """``report.json``: the merge of every node's report present now."""
    merged = merged_report(run_dir)
    if merged is not None:
        write_json(lay.hang_dir(run_dir) / lay.HANG_REPORT_FILE, merged, indent=1)


# --------------------------------------------------------------------------------------------
# Reading (mlaunch status)


def _view(data: dict[str, Any]) -> RankView:
    known = set(RankView.__dataclass_fields__)
    return RankView(**{k: v for k, v in data.items() if k in known})


def merged_report(run_dir: Path, since: float | None = None) -> dict[str, Any] | None:
    """Every node's hang report merged (the newest hang of each node detected since ``since``):
    the ranks of all nodes, the verdict judged over them all, the earliest detection."""
    nodes = read_hang_reports(run_dir, since)
    if not nodes:
        return None
    latest = max(n.attempt for n in nodes)
    nodes = [n for n in nodes if n.attempt == latest]  # one hang, not two
    views = [_view(r) for n in nodes for r in n.ranks]
    first = min(nodes, key=lambda n: n.detected_at)
    return {
        "detected_at": first.detected_at,
        "verdict": judge(views) if len(nodes) > 1 or first.verdict is None else first.verdict,
        "ranks": [asdict(v) for v in sorted(views, key=lambda v: v.rank)],
        "nodes": [n.node for n in nodes],
        "attempt": latest,
        "action": first.action,
        "timeout_s": first.timeout_s,
        "collect_s": max(n.collect_s for n in nodes),
        "nccl": first.nccl,
    }


def hang_status(run_dir: Path, since: float | None = None) -> dict[str, Any] | None:
    """The ``hang`` object of ``mlaunch status --json``: ``detected_at``, ``verdict``, ``ranks``
    (``rank``, ``span``, ``iteration``, ``frame``), and where the report is."""
    merged = merged_report(run_dir, since)
    if merged is None:
        return None
    return {
        "detected_at": merged["detected_at"],
        "verdict": merged["verdict"],
        "ranks": [
            {k: r.get(k) for k in ("rank", "span", "iteration", "frame")} for r in merged["ranks"]
        ],
        "attempt": merged["attempt"],
        "action": merged["action"],
        "report": str(lay.hang_dir(run_dir) / lay.HANG_REPORT_FILE),
    }
