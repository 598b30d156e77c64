"""Streaming reader of OTLP/JSON trace lines (the file exporter's, the spool's, and an
OpenTelemetry collector file exporter's format).

Each line is one ``ExportTraceServiceRequest``; a line may hold many spans. The reader decodes a
line at a time and hands out ``(resource, spans)`` batches; consumers aggregate and drop the span
dicts, so memory stays flat with the size of the trace. Metric lines (``resourceMetrics``) are
skipped. Standalone on purpose: it does not import the telemetry runtime (or the OTel SDK); the
values are decoded by the standard-library half of :mod:`mlaunch.otlp.otlp_json`.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlaunch.model.spans import TRUNCATED_ATTRS, ResourceAttr
from mlaunch.otlp.otlp_json import any_value, attributes
from mlaunch.rundir import layout as lay
from mlaunch.settings import recorded_off_reason

#: The rank in an arbitrary file's name (a collector's file, a renamed copy): ``...rank<R>...``.
_ANY_RANK_RE = re.compile(r"rank(\d+)")
#: A raw-bytes pre-check: lines without this marker hold no truncated span, so consumers can
#: skip scanning attributes (the common case) without decoding anything twice. It is the common
#: tail of ``nemo.span.truncated`` (nemo-lens, mlaunch now) and ``mlaunch.span.truncated``
#: (older mlaunch traces).
TRUNCATED_MARKER = b"span.truncated"
assert all(a.encode().endswith(TRUNCATED_MARKER) for a in TRUNCATED_ATTRS)

try:  # orjson decodes these lines ~1.4x faster (benchmarks/trace_read.py); json is the fallback
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - orjson is a dependency; tolerate --no-deps installs
    _fast_loads = json.loads


def loads_line(raw: bytes) -> Any:
    """Decode one JSON line. orjson first; on its refusal, json, which also accepts what Python's
    own encoder writes for non-finite floats (``NaN``, ``Infinity``) — a NaN loss must not make
    a trace unreadable. Raises ValueError when neither accepts the line."""
    try:
        return _fast_loads(raw)
    except ValueError:
        return json.loads(raw)


#: What a Chrome trace-event file (``mlaunch trace export``'s output) holds near its start.
_CHROME_MARK = b'"traceEvents"'


def _chrome_error(path: Path) -> TraceInputError:
    return TraceInputError(
        "is a Chrome trace-event JSON file (what `mlaunch trace export` writes), not OTLP/JSON "
        "trace lines", path=path,
        fix="pass the run directory or the traces-rank<R>.jsonl it was exported from; open "
        "this file in ui.perfetto.dev or chrome://tracing",
    )  # fmt: skip


#: The largest file read whole to tell a JSON document (pretty-printed, one object over many
#: lines) from a broken trace line; a bigger one keeps the plain "not valid JSON" message.
_WHOLE_JSON_LIMIT = 16 << 20


def _json_document_error(path: Path) -> TraceInputError | None:
    """The error for a valid JSON document that is not OTLP/JSON lines (``resolved.json``, a
    config dump), naming what it is and pointing at the run directory it sits in; None when the
    file is not one JSON document (then the line's own parse error is the message)."""
    try:
        if path.stat().st_size > _WHOLE_JSON_LIMIT:
            return None
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    if isinstance(doc, dict) and ("resourceSpans" in doc or "traceEvents" in doc):
        return None  # a trace pretty-printed: the other messages say what to do
    what = "a JSON document"
    if path.name == lay.RESOLVED_JSON_FILE:
        what = "the run's resolved configuration (a JSON document)"
    run_dir = path.parent
    if (run_dir / lay.TELEMETRY_DIR).is_dir():
        fix = f"pass the run directory instead: {run_dir}"
    else:
        fix = "pass a run directory (runs/<run_id>) or an OTLP-JSON traces file"
    return TraceInputError(
        f"is {what}, not an OTLP/JSON traces file (one ExportTraceServiceRequest per line)",
        path=path, fix=fix,
    )  # fmt: skip


#: Where an ExportTraceServiceRequest line starts (what every writer of these files writes first).
_REQUEST_START = b'{"resourceSpans"'


def _after_torn_prefix(raw: bytes) -> dict[str, Any] | None:
    """The request that follows a torn head on one line (``<torn bytes>{"resourceSpans":...}``),
    or ``None`` when there is no such complete request."""
    i = raw.find(_REQUEST_START, 1)
    if i < 0:
        return None
    try:
        req = loads_line(raw[i:])
    except ValueError:
        return None
    return req if isinstance(req, dict) else None


class TraceInputError(Exception):
    """Input that is not a readable trace: names the file, the line (when known) and the fix."""

    def __init__(self, message: str, *, path: Path | None = None, line: int | None = None,
                 fix: str = "") -> None:  # fmt: skip
        self.message = message
        self.path = path
        self.line = line
        self.fix = fix
        super().__init__(self.render())

    def render(self) -> str:
        """``FILE:LINE: message`` followed by the fix, for printing to the user."""
        where = ""
        if self.path is not None:
            where = f"{self.path}:{self.line}: " if self.line is not None else f"{self.path}: "
        text = f"{where}{self.message}"
        return f"{text}\n  fix: {self.fix}" if self.fix else text


def is_error(span: dict[str, Any]) -> bool:
    """Whether the span's status is ERROR (code 2, or the enum name some encoders write)."""
    st = span.get("status")
    return isinstance(st, dict) and st.get("code") in (2, "STATUS_CODE_ERROR", "2")


def is_truncated(span: dict[str, Any]) -> bool:
    """Whether the span was open at shutdown: ``nemo.span.truncated=true`` (nemo-lens and
    mlaunch) or ``mlaunch.span.truncated=true`` (older mlaunch traces)."""
    for kv in span.get("attributes") or ():
        if isinstance(kv, dict) and kv.get("key") in TRUNCATED_ATTRS and any_value(kv.get("value")):
            return True
    return False


_START, _END = "startTimeUnixNano", "endTimeUnixNano"


def span_problem(s: Any) -> str | None:
    """Why ``s`` is not a usable span (``None`` when it is), normalising it in place so that every
    consumer sees the same span: the two times become ints, and an end before the start (a wall
    clock stepped back) becomes the start, an instant span. Only cheap type checks run on the hot
    path (unrolled: this runs once per span); attribute values are decoded leniently by
    :func:`attributes` later."""
    if type(s) is not dict:
        return "a span that is not an object"
    get = s.get
    name = get("name")
    if type(name) is not str:
        return "a span without a 'name'" if name is None else "a span whose 'name' is not a string"
    start, end = get(_START), get(_END)
    key = _START
    try:
        if type(start) is not int:
            if type(start) is bool or start is None:
                raise TypeError
            start = s[_START] = int(start)
        key = _END
        if type(end) is not int:
            if type(end) is bool or end is None:
                raise TypeError
            end = s[_END] = int(end)
    except (TypeError, ValueError, OverflowError):
        what = "no" if get(key) is None else "a non-integer"
        return f"span {name!r} has {what} {key!r}"
    if end < start:
        s[_END] = start
    attrs, events, links = get("attributes"), get("events"), get("links")
    if (
        (attrs is not None and type(attrs) is not list)
        or (events is not None and type(events) is not list)
        or (links is not None and type(links) is not list)
    ):
        for key, v in (("attributes", attrs), ("events", events), ("links", links)):
            if v is not None and type(v) is not list:
                return f"span {name!r}: {key!r} is not a list"
    for key in ("spanId", "parentSpanId", "traceId"):
        v = get(key)
        if v is not None and type(v) is not str:
            return f"span {name!r}: {key!r} is not a string"
    if events:
        for ev in events:
            try:
                ev["timeUnixNano"] = int(ev["timeUnixNano"])
            except (KeyError, TypeError, ValueError, OverflowError):
                return f"span {name!r}: an event without an integer 'timeUnixNano'"
    if links and any(type(lk) is not dict for lk in links):
        return f"span {name!r}: a link that is not an object"
    return None


@dataclass(slots=True)
class Resource:
    """The resource one batch of spans came from, with the rank resolved. The launcher's job
    trace is no rank: ``launcher`` is set and ``rank`` is ``-1 - node_rank``."""

    attrs: dict[str, Any]
    rank: int
    launcher: bool = False


@dataclass(frozen=True, slots=True)
class TraceFile:
    """One input file and the rank its name implies (``None`` for an arbitrary file); for the
    launcher's job trace file, ``launcher`` and the node rank in ``rank``."""

    path: Path
    rank: int | None
    spool: bool = False
    launcher: bool = False


@dataclass
class ReadStats:
    """What the reader saw, for the report footer and for warnings."""

    files: int = 0
    lines: int = 0
    spans: int = 0
    skipped_lines: list[tuple[Path, int, str]] = field(default_factory=list)
    #: Malformed spans dropped under ``--skip-invalid`` (file, line, why).
    skipped_spans: list[tuple[Path, int, str]] = field(default_factory=list)
    #: Torn last lines (a crashed or still-running writer), always skipped: (file, line).
    torn_lines: list[tuple[Path, int]] = field(default_factory=list)
    duplicate_spans: int = 0
    metric_lines: int = 0


def _run_trace_file(path: Path) -> TraceFile | None:
    """``path`` as one of a run directory's trace files (a rank's traces or their spool, or a
    launcher's job trace), or None when its name is none of those."""
    if (recorder_rank := lay.RECORDER_FILE.parse(path.name)) is not None:
        return TraceFile(path, recorder_rank)  # flight-recorder dumps are read with the rest
    named = lay.parse_telemetry_file(path.name)
    if named is None or named.signal != "traces":
        return None
    if named.rank is not None:
        return TraceFile(path, named.rank, spool=named.spool)
    if named.launcher_node is not None and not named.spool:
        return TraceFile(path, named.launcher_node, launcher=True)
    return None  # unranked, or a launcher's spool (for `mlaunch trace replay`, not read here)


def run_directory(path: Path) -> Path:
    """The run directory behind ``path``: itself, or the one holding a traces file or the
    ``telemetry/`` directory given instead (where progress.jsonl and resolved.json live)."""
    path = Path(path)
    d = path if path.is_dir() else path.parent
    return d.parent if d.name == lay.TELEMETRY_DIR else d


def read_resolved(run_dir: Path) -> dict[str, Any]:
    """``resolved.json`` as ``mlaunch train`` wrote it, or {} (plain torchrun runs have none)."""
    try:
        data = json.loads((run_dir / lay.RESOLVED_JSON_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


#: What to check when a run has no spans, unless its record says telemetry was off.
EXPORT_ADVICE = (
    "check that the run exported spans (MEGATRON_OTEL_ENABLED=1, an exporting rank, span groups on)"
)


def export_advice(path: Path) -> str:
    """How to get spans from the run behind ``path``: when its resolved.json says telemetry was
    off, why and how to turn it on (``OTEL_SDK_DISABLED`` is not cured by ``ENABLED=1``), else
    :data:`EXPORT_ADVICE`."""
    table = read_resolved(run_directory(path)).get("settings")
    off = recorded_off_reason(table) if isinstance(table, dict) else None
    return f"telemetry was off in this run ({off})" if off else EXPORT_ADVICE


def discover(path: Path) -> list[TraceFile]:
    """The trace files behind ``path``: a run directory (its ``telemetry/traces-rank*.jsonl`` and
    ``telemetry/spool-traces-rank*.jsonl``), a telemetry directory itself, or one file."""
    if not path.exists():
        raise TraceInputError(
            "no such file or directory", path=path,
            fix="pass a run directory (runs/<run_id>) or an OTLP-JSON traces file",
        )  # fmt: skip
    if path.is_file():
        named = lay.parse_telemetry_file(path.name)
        if named is not None and named.launcher_node is not None and not named.spool:
            return [TraceFile(path, named.launcher_node, launcher=True)]
        m = _ANY_RANK_RE.search(path.name)
        spool = path.name.startswith(lay.SPOOL_PREFIX)
        return [TraceFile(path, int(m.group(1)) if m else None, spool)]
    if not path.is_dir():
        raise TraceInputError("not a regular file or directory", path=path,
                              fix="pass a run directory or an OTLP-JSON traces file")  # fmt: skip
    found: list[TraceFile] = []
    for d in (path / lay.TELEMETRY_DIR, path):
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            if (tf := _run_trace_file(p)) is not None:
                found.append(tf)
        if any(not f.launcher for f in found):
            break
    if not found:
        raise TraceInputError(
            f"no trace files found (expected {lay.TELEMETRY_DIR}/traces-rank<R>.jsonl)",
            path=path,
            fix=_no_files_fix(path),
        )
    # Spool before traces for the same rank: the reader keeps the (small) spool's span keys and
    # drops their duplicates from the traces file, so no set of every span id is ever needed.
    # The launcher's files come first (they hold the job span goodput's wall time starts from).
    found.sort(
        key=lambda f: (
            not f.launcher,
            f.rank if f.rank is not None else -1,
            not f.spool,
            f.path.name,
        )
    )
    return found


def _no_files_fix(path: Path) -> str:
    advice = export_advice(path)
    if advice != EXPORT_ADVICE:
        return advice
    return (
        "run with MEGATRON_OTEL_ENABLED=1 and the file exporter (the default without an OTLP"
        " endpoint), or pass the OTLP-JSON file a collector wrote"
    )


class TraceReader:
    """Iterate ``(resource, spans, maybe_truncated)`` batches over a set of trace files.

    ``maybe_truncated`` is False when the raw line cannot contain a truncated span, letting
    consumers skip the attribute scan. The current file and line are kept so that a consumer
    failing on a malformed span can raise :meth:`error_here`.
    """

    def __init__(
        self,
        files: Sequence[TraceFile],
        *,
        skip_invalid: bool = False,
        limits: dict[Path, int] | None = None,
        starts: dict[Path, tuple[int, int]] | None = None,
    ) -> None:
        self.files = list(files)
        #: Where to start reading a file: (byte offset, lines before it). The span store's
        #: incremental build reads only what a live run appended since the store was written.
        self.starts: dict[Path, tuple[int, int]] = dict(starts or {})
        #: Per file: [bytes, lines] of its complete (newline-terminated) lines read so far.
        self.complete: dict[Path, list[int]] = {}
        self.skip_invalid = skip_invalid
        #: Bytes of each file read (its size when first opened: a file still growing is read
        #: to a fixed end).
        self.limits: dict[Path, int] = dict(limits or {})
        self.stats = ReadStats()
        self.path: Path | None = None
        self.line_no = 0
        self._process_ranks: dict[Any, int] = {}
        #: Called with each complete, non-blank line before it is decoded; a line it returns
        #: True for is the caller's (counted as read, not decoded here): the span store's
        #: column-wise decoder takes the lines it can decode exactly this way.
        self.take_raw: Callable[[TraceFile, bytes], bool] | None = None

    @classmethod
    def open(cls, path: str | Path, *, skip_invalid: bool = False) -> TraceReader:
        """A reader over everything :func:`discover` finds at ``path``."""
        return cls(discover(Path(path)), skip_invalid=skip_invalid)

    def error_here(self, message: str, fix: str = "") -> TraceInputError:
        """An error pointing at the line being read."""
        return TraceInputError(
            message, path=self.path, line=self.line_no or None,
            fix=fix or "repair or delete that line, or pass --skip-invalid to ignore bad lines",
        )  # fmt: skip

    def _bad_line(self, why: str) -> None:
        if not self.skip_invalid:
            raise self.error_here(why)
        assert self.path is not None
        self.stats.skipped_lines.append((self.path, self.line_no, why))

    def __iter__(self) -> Iterator[tuple[Resource, list[dict[str, Any]], bool]]:
        spool_keys: set[tuple[str, str]] = set()
        spool_rank: int | None = None
        for tf in self.files:
            if tf.rank != spool_rank:
                spool_keys, spool_rank = set(), None
            self.stats.files += 1
            dedup = bool(spool_keys) and not tf.spool and not tf.launcher
            for res, spans, flagged in self._read_file(tf):
                if tf.spool and tf.rank is not None:
                    spool_rank = tf.rank
                    spool_keys.update((s.get("traceId"), s.get("spanId")) for s in spans)
                elif dedup:
                    kept = [
                        s for s in spans if (s.get("traceId"), s.get("spanId")) not in spool_keys
                    ]
                    self.stats.duplicate_spans += len(spans) - len(kept)
                    spans = kept
                self.stats.spans += len(spans)
                yield res, spans, flagged
        self.path, self.line_no = None, 0

    def _open(self, path: Path) -> Any:
        """Open a trace file for reading without ever blocking: a FIFO or device where a trace
        file is expected is refused (opening a FIFO for reading would wait for a writer)."""
        fix = "pass a run directory (runs/<run_id>) or a regular OTLP-JSON traces file"
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except IsADirectoryError:
            raise TraceInputError("is a directory, not a trace file", path=path, fix=fix) from None
        except OSError as e:
            raise TraceInputError(f"cannot read: {e.strerror}", path=path,
                                  fix="check the path and its permissions") from None  # fmt: skip
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise TraceInputError(f"is {kind}, not a trace file", path=path, fix=fix)
        os.set_blocking(fd, True)
        # Bytes: json decodes UTF-8 itself, faster than text mode.
        return os.fdopen(fd, "rb"), st.st_size

    def _lines(self, f: Any, limit: int) -> Iterator[bytes]:
        """The file's lines up to ``limit`` bytes: a line cut by the limit comes out cut, the
        same way every time, so two reads of a growing file see the same lines."""
        pos = 0
        for raw in f:
            if pos + len(raw) > limit:
                if pos < limit:
                    yield raw[: limit - pos]
                return
            pos += len(raw)
            yield raw
            if pos >= limit:
                return

    def _read_file(self, tf: TraceFile) -> Iterator[tuple[Resource, list[dict[str, Any]], bool]]:
        self.path, self.line_no = tf.path, 0
        f, size = self._open(tf.path)
        # Read what the file held when first opened: a run still writing appends behind us, and
        # a second pass (export, report) reads exactly the bytes the first one did.
        limit = self.limits.setdefault(tf.path, size)
        offset, self.line_no = self.starts.get(tf.path, (0, 0))
        if offset:
            f.seek(offset)
        done = self.complete[tf.path] = [offset, self.line_no]
        take = self.take_raw
        with f:
            for raw in self._lines(f, limit - offset):
                self.line_no += 1
                self.stats.lines += 1
                if raw.isspace() or not raw:  # (not raw.strip(): that copies the line)
                    if raw.endswith(b"\n"):
                        done[0] += len(raw)
                        done[1] = self.line_no
                    continue
                if not raw.endswith(b"\n"):
                    # only the last line can lack its newline: torn (a writer mid-line)
                    yield from self.decode_line(tf, raw, torn=True)
                    continue
                done[0] += len(raw)  # read up to here for good (a torn line may grow)
                done[1] = self.line_no
                if take is None or not take(tf, raw):
                    yield from self.decode_line(tf, raw)

    def decode_line(
        self, tf: TraceFile, raw: bytes, *, torn: bool = False
    ) -> list[tuple[Resource, list[dict[str, Any]], bool]]:
        """The batches of one line of ``tf`` (the line :attr:`line_no` names): a torn line and
        metric lines give none; a line that is not a trace request raises, or under
        ``skip_invalid`` is counted and gives none."""
        try:
            req = loads_line(raw)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            req = None if torn else _after_torn_prefix(raw)
            if req is not None:
                # A writer that crashed mid-line, then one that appended (a restart):
                # the torn head is skipped like a torn last line, the request kept.
                self.stats.torn_lines.append((tf.path, self.line_no))
            elif torn:
                self.stats.torn_lines.append((tf.path, self.line_no))
                return []
            elif self.line_no == 1 and _CHROME_MARK in raw[:4096]:
                raise _chrome_error(tf.path) from None
            elif self.line_no == 1 and (doc_err := _json_document_error(tf.path)):
                raise doc_err from None
            else:
                self._bad_line(f"not valid JSON ({e})")
                return []
        if not isinstance(req, dict):
            if torn:
                self.stats.torn_lines.append((tf.path, self.line_no))
            else:
                self._bad_line("not an OTLP/JSON ExportTraceServiceRequest (not an object)")
            return []
        rss = req.get("resourceSpans")
        if rss is None:
            if "resourceMetrics" in req or "resourceLogs" in req:
                self.stats.metric_lines += 1
                return []
            if "traceEvents" in req:
                raise _chrome_error(tf.path)
            if self.line_no == 1 and (doc_err := _json_document_error(tf.path)):
                raise doc_err
            self._bad_line("not an OTLP/JSON ExportTraceServiceRequest (no 'resourceSpans' key)")
            return []
        flagged = TRUNCATED_MARKER in raw
        try:
            batches = []
            for rs in rss:
                res = self.resource(rs.get("resource"), tf)
                for ss in rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or ():
                    spans = ss.get("spans")
                    if spans:
                        batches.append((res, self._checked(spans)))
        except TraceInputError:
            raise
        except (AttributeError, TypeError, KeyError, ValueError) as e:
            self._bad_line(f"malformed OTLP/JSON structure ({type(e).__name__}: {e})")
            return []
        return [(res, spans, flagged) for res, spans in batches if spans]

    def _checked(self, spans: Any) -> list[dict[str, Any]]:
        """``spans`` with the malformed ones refused (or, under ``--skip-invalid``, dropped and
        counted): consumers only ever see spans :func:`span_problem` accepts."""
        if type(spans) is not list:
            raise TypeError("'spans' is not a list")
        bad = None
        for i, s in enumerate(spans):
            why = span_problem(s)
            if why is not None:
                if not self.skip_invalid:
                    raise self.error_here(f"malformed span: {why}")
                assert self.path is not None
                self.stats.skipped_spans.append((self.path, self.line_no, why))
                bad = bad or set()
                bad.add(i)
        if bad:
            return [s for i, s in enumerate(spans) if i not in bad]
        return spans

    def resource(self, resource: dict[str, Any] | None, tf: TraceFile) -> Resource:
        """The batch's resource with its rank: ``dl.rank``; else the file name's ``rank<R>``;
        else one number per distinct process (``service.instance.id``, or host and pid) in
        order of appearance, so a collector file from a foreign trainer still splits by
        process."""
        attrs = attributes((resource or {}).get("attributes"))
        if tf.launcher:
            return Resource(attrs, -1 - (tf.rank or 0), launcher=True)
        rank = attrs.get(ResourceAttr.RANK)
        if rank is None:
            if tf.rank is not None:
                rank = tf.rank
            else:
                ident = attrs.get(ResourceAttr.SERVICE_INSTANCE_ID) or (
                    attrs.get(ResourceAttr.HOST_NAME),
                    attrs.get(ResourceAttr.PROCESS_PID),
                )
                rank = self._process_ranks.setdefault(ident, len(self._process_ranks))
        return Resource(attrs, int(rank))


def no_spans_error(reader: TraceReader) -> TraceInputError:
    """The error for input that parsed but held no spans (empty files, a metrics file), or, for
    a command that needs the workers' spans, only the launcher's job trace (which is a trace:
    summary, goodput and report read it)."""
    files = list(reader.files)
    if reader.stats.spans and files and all(getattr(f, "launcher", False) for f in files):
        return TraceInputError(
            f"only the launcher's job trace ({reader.stats.spans:,} spans: mlaunch.job and its"
            " attempts) and no worker spans: the workers exported none",
            fix="`mlaunch trace summary`, `goodput` and `report` read the job trace; for the"
            " workers' spans, turn their telemetry on (mlaunch's trainer, a script using"
            " mlaunch.telemetry, or Megatron-LM with --otel-enabled)",
        )
    names = ", ".join(str(f.path) for f in files[:3])
    extra = " (it holds metrics only)" if reader.stats.metric_lines else ""
    return TraceInputError(
        f"no spans in {names}{extra}",
        fix="point at the traces file (traces-rank<R>.jsonl) or the run directory; "
        + (export_advice(reader.files[0].path) if reader.files else EXPORT_ADVICE),
    )
