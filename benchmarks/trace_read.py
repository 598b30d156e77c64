"""How fast ``mlaunch trace`` reads OTLP/JSON traces (goal: >= 200,000 spans/s for summary).

Generates a realistic run directory in a temporary folder (default 1,000,000 spans over 4 ranks,
pipeline-parallel 2, 4 microbatches x 4 layers per step, batches of 512 spans per line, every
span with attributes), then times, in one process:

* ``decode json`` / ``decode orjson``: decoding every line and counting spans — the floor any
  reader pays (the reader uses orjson, falling back to json); the passes are reported as a
  ratio to the orjson floor;
* ``summary``, ``goodput``, ``export`` (Chrome JSON; ``--no-export`` skips it): what a command's
  first read does, in this process: build the store, then the analysis on it;
* the span store (``--no-store`` skips it), each pass in a fresh process so that its
  peak RSS is its own: ``first read`` = building the store from the JSON plus the summary on it
  (goal: <= 1.5x the orjson decode CPU), ``summary store`` (goal: <= 3 s wall at 10^7 spans),
  ``goodput store``, ``sql count`` (the per-name count of docs/trace.md), and the store's size
  against the JSON's (goal: <= 1/10). The first-read ratio is of whole processes (interpreter,
  imports and all threads: what a user's ``mlaunch trace summary`` pays), against a process
  that only decodes with orjson, run before and after it: their ratio (A/A) is printed beside
  it, the noise of the machine the ratio is read against (``--repeat N`` runs the trio N times);
  and Chrome export and ``trace report`` from the store, whole processes (``--no-export``,
  ``--no-report`` skip them).

* ``--bare``: only the issue's two read ratios, whole processes against the orjson decode of the
  same input: ``mlaunch trace summary FILE`` of one traces file (the run's rank files joined;
  goal <= 3x) and of the run directory, each a first read (``--no-json --bare --spans 500000``).

* ``--decoders``: the OTLP-JSON decoder candidates of the store's first read (issue 41), each a
  whole process between two orjson-only floors, its ratio to them with their A/A beside it:
  ``pyarrow`` (:mod:`mlaunch.trace.store_decode`, the store's decoder) and ``orjson`` (the
  reader's orjson decode feeding Arrow columns, the build's path for a chunk pyarrow refuses),
  both full first reads (build + summary); ``duckdb`` (DuckDB's ``read_ndjson`` with the OTLP
  structure as an explicit schema, unnested), the decode to the span columns only: a lower bound
  of its first read (see ``_decode_columns``). The hand-written C scanner measured beside them
  (``mlaunch/trace/_cscan.c``, 0.6-0.7x) was deleted once pyarrow met the goal.

* ``--writers``: only where the store is written (the run-end build, the receiver's appends,
  a worker writing Parquet in its exporter), each against its A/A control (see ``_writers``).

Every reader of the store (:data:`READERS`: summary, goodput, stragglers, sql, report, export in
both formats) is also run as the user runs it, ``mlaunch trace ...`` in a fresh process each,
printing its wall, CPU and peak RSS (the whole process) against the goal of 1 GiB at any size
(``--store-only`` always; ``--readers`` after the other store passes).

Run: ``python benchmarks/trace_read.py [--spans 1000000] [--no-json] [--no-export]
[--no-report] [--no-store] [--readers] [--repeat N] [--writers [--append-min-mib 64]]
[--decoders [pyarrow,orjson,duckdb]]``;
``--store-only --spans 100000000`` for the store passes at 10^8 spans (generated straight into
the store: no JSON, no progress.jsonl; ``--skip-readers stragglers,...`` leaves readers out;
``--microbatches 1 --layers 1``: 11 spans a step, not 61, for shapes of many steps); ``--run DIR`` for
only the export and report comparisons on an existing run directory (its store built first).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.synthetic_traces import spans_per_step, write_realistic_run  # noqa: E402

from mlaunch.trace.chrome import export_chrome  # noqa: E402
from mlaunch.trace.goodput import goodput_store  # noqa: E402
from mlaunch.trace.reader import TraceReader  # noqa: E402
from mlaunch.trace.store import open_reader  # noqa: E402
from mlaunch.trace.summary import summarize_store  # noqa: E402


def _decode_only(run: Path, loads: Callable[[bytes], Any], fields: bool = False) -> int:
    """Decode every line of ``run``'s traces files (``run`` itself when it is one file) and count
    spans; ``fields``: also pull four fields of each span (name, span id, start, end), the
    issue's own floor ("a bare orjson loop that only pulls four fields per span"), a little above
    the decode alone."""
    n = 0
    files = [run] if run.is_file() else sorted((run / "telemetry").glob("traces-rank*.jsonl"))
    for f in files:
        with open(f, "rb") as fh:
            for line in fh:
                for rs in loads(line)["resourceSpans"]:
                    for ss in rs["scopeSpans"]:
                        if not fields:
                            n += len(ss["spans"])
                            continue
                        for sp in ss["spans"]:
                            sp["name"], sp["spanId"], sp["startTimeUnixNano"], sp["endTimeUnixNano"]  # noqa: B018
                            n += 1
    return n


def _peak_rss_mib() -> float:
    """This process's peak RSS: VmHWM (reset by exec, unlike ru_maxrss, which a child started by
    subprocess inherits from its parent on Linux), else ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed(label: str, fn: Callable[[], int], base: float | None) -> float:
    """Run one pass; print wall and CPU rates (CPU time is the fairer number on a shared machine)
    and peak RSS; return the CPU rate."""
    t, c = time.perf_counter(), time.process_time()
    n = fn()
    dt, dc = time.perf_counter() - t, time.process_time() - c
    rate = n / dc
    rss = _peak_rss_mib()
    ratio = f"  {base / rate:4.2f}x decode" if base else ""
    print(
        f"{label:<14} {n:>10,} spans  wall {dt:6.2f} s {n / dt:>9,.0f}/s  "
        f"CPU {dc:6.2f} s {rate:>9,.0f}/s{ratio}  peak RSS {rss:,.0f} MiB"
    )
    return rate


#: The OTLP-JSON span members the library candidates read (what the store's columns need).
_KV = ("STRUCT(key VARCHAR, value STRUCT(stringValue VARCHAR, boolValue BOOLEAN, "
       "intValue VARCHAR, doubleValue DOUBLE))[]")  # fmt: skip
_DUCK_SPAN = (f"STRUCT(traceId VARCHAR, spanId VARCHAR, parentSpanId VARCHAR, name VARCHAR, "
              f"kind BIGINT, startTimeUnixNano VARCHAR, endTimeUnixNano VARCHAR, attributes {_KV}, "
              f"events JSON, links JSON, status STRUCT(message VARCHAR, code BIGINT))")  # fmt: skip
_DUCK_RS = (f"STRUCT(resource STRUCT(attributes {_KV}), scopeSpans STRUCT(scope STRUCT(name "
            f"VARCHAR, version VARCHAR), spans {_DUCK_SPAN}[])[])[]")  # fmt: skip


def _decode_columns(run: Path, how: str) -> int:
    """The span columns of every trace file decoded by DuckDB, into Arrow: ids,
    name, the times as int64, the status code, the iteration attribute and the attributes as JSON
    text, the resource per span. Less than a first read does (no events/links/extra text, no
    group, no Parquet write, no summary), so a ratio above the goal here rules the candidate out."""
    if how != "duckdb":
        raise ValueError(how)
    import duckdb

    glob = str(run / "telemetry" / "traces-rank*.jsonl")
    q = f"""
    WITH l AS (SELECT unnest(resourceSpans) AS rs FROM read_ndjson('{glob}',
          columns={{'resourceSpans': '{_DUCK_RS}'}}, maximum_object_size=1073741824)),
      s AS (SELECT to_json(rs.resource) AS res, unnest(rs.scopeSpans) AS ss FROM l),
      sp AS (SELECT res, unnest(ss.spans) AS x FROM s)
    SELECT x.traceId, x.spanId, nullif(x.parentSpanId, '') AS parent_id, x.name,
      TRY_CAST(list_filter(x.attributes, lambda a: a.key = 'megatron.iteration')[1]
               .value.intValue AS BIGINT) AS iteration,
      CAST(x.startTimeUnixNano AS BIGINT) AS start_ns,
      CAST(x.endTimeUnixNano AS BIGINT) AS end_ns, coalesce(x.status.code, 0) AS status,
      CASE WHEN len(x.attributes) > 0 THEN to_json(x.attributes) END AS attributes, res
    FROM sp"""
    return duckdb.connect().sql(q).to_arrow_table().num_rows


def _child(what: str, run_s: str) -> None:
    """One span-store pass in this (fresh) process: its wall, CPU (all threads) and peak RSS."""
    run = Path(run_s)
    if what in ("decode", "decode-fields"):  # the floors, as whole processes: no pyarrow/DuckDB
        _timed(what, lambda: _decode_only(run, orjson.loads, what == "decode-fields"), None)
        return
    if what.startswith("columns-"):  # DuckDB's decode (--decoders)
        _timed(what, lambda: _decode_columns(run, what.removeprefix("columns-")), None)
        return
    if what == "first-read-orjson":  # the reader's orjson decode for every chunk (--decoders)
        import mlaunch.trace.store_build

        mlaunch.trace.store_build.parse = lambda data, lines: None
        what = "first-read"
    from mlaunch.trace.goodput import goodput_store as goodput_of_store
    from mlaunch.trace.store import StoreReader, open_store, run_sql
    from mlaunch.trace.summary import summarize_store

    def first_read() -> int:
        store = open_store(run)
        assert store is not None
        return sum(s.count for s in summarize_store(store).spans)

    def summary_store() -> int:
        return sum(s.count for s in summarize_store(open_store(run, build=False)).spans)

    def goodput_store() -> int:
        store = open_store(run, build=False)
        goodput_of_store(store)
        return store.manifest.spans

    def sql_count() -> int:
        res = run_sql(open_store(run, build=False), "SELECT name, count(*) FROM spans GROUP BY 1")
        return sum(r[1] for r in res.rows)

    def export_store() -> int:  # the column-wise export (mlaunch/trace/chrome.py)
        reader = StoreReader(open_store(run, build=False))
        return export_chrome(reader, run.parent / "export-store.json").spans

    def report(reader: Any) -> int:
        from mlaunch.trace.report.build import prepare, render

        html = render(prepare(run, reader)).html
        (run.parent / f"{what}.html").write_text(html)
        return store_spans()

    def store_spans() -> int:
        return open_store(run, build=False).manifest.spans

    if what.startswith("report-"):
        reader = {"report-store": lambda: StoreReader(open_store(run, build=False))}
        _timed(what, lambda: report(reader[what]()), None)  # fmt: skip
        return

    fn = {"first-read": first_read, "summary-store": summary_store,
          "goodput-store": goodput_store, "sql-count": sql_count,
          "export-store": export_store}[what]  # fmt: skip
    _timed(what, fn, None)


def _process_cpu(what: str, run: Path) -> float:
    """Run one :func:`_child` pass; the CPU seconds of its whole process (user + system, every
    thread, the interpreter's start and the imports included)."""
    p = subprocess.Popen([sys.executable, __file__, "--child", what, str(run)])
    _, status, ru = os.wait4(p.pid, 0)
    if status:
        raise SystemExit(f"{what} pass failed ({status})")
    return ru.ru_utime + ru.ru_stime


def _first_read(run: Path, repeat: int) -> None:
    """decode, first read, decode again (the A/A control), ``repeat`` times; the ratios."""
    import shutil

    from mlaunch.trace.store_layout import STORE_DIR

    for _ in range(repeat):
        shutil.rmtree(run / STORE_DIR, ignore_errors=True)
        a, fa = _process_cpu("decode", run), _process_cpu("decode-fields", run)
        first = _process_cpu("first-read", run)
        b, fb = _process_cpu("decode", run), _process_cpu("decode-fields", run)
        print(f"first read (whole process) {first:.2f} CPU-s = {2 * first / (a + b):.2f}x "
              f"decode (whole process {a:.2f} / {b:.2f} CPU-s, A/A {b / a:.2f}) = "
              f"{2 * first / (fa + fb):.2f}x decode + four fields a span ({fa:.2f} / {fb:.2f} "
              f"CPU-s, A/A {fb / fa:.2f}); goal <= 1.5x")  # fmt: skip


#: ``--decoders``: candidate -> the :func:`_child` pass that measures it.
DECODERS = {"pyarrow": "first-read", "orjson": "first-read-orjson", "duckdb": "columns-duckdb"}


def _decoders(run: Path, repeat: int, only: list[str]) -> None:
    """Each decoder candidate between two orjson-only floors (whole processes, all threads),
    ``repeat`` times: its ratio to their mean, their A/A beside it (the noise it is read against)."""
    import shutil

    from mlaunch.trace.store_layout import STORE_DIR

    for _ in range(repeat):
        a = _process_cpu("decode", run)
        for name in only:
            shutil.rmtree(run / STORE_DIR, ignore_errors=True)
            cpu = _process_cpu(DECODERS[name], run)
            b = _process_cpu("decode", run)
            kind = "first read" if DECODERS[name].startswith("first-read") else "decode only"
            print(f"decoder {name:<8} {kind:<11} {cpu:7.2f} CPU-s = {2 * cpu / (a + b):5.2f}x "
                  f"orjson decode ({a:.2f} / {b:.2f} CPU-s, A/A {b / a:.2f}); goal <= 1.5x")  # fmt: skip
            a = b


def _export_compare(run: Path, repeat: int) -> None:
    """Chrome export from the store (column-wise), whole processes, ``repeat`` times (the JSON
    path it was compared with is gone: every export reads the store)."""
    for _ in range(repeat):
        new = _process_cpu("export-store", run)
        print(f"export from the store (whole process) {new:.2f} CPU-s")
    (run.parent / "export-store.json").unlink()


def _report_compare(run: Path, repeat: int) -> None:
    """``trace report`` (data and page) from the store, whole processes, ``repeat`` times."""
    for _ in range(repeat):
        new = _process_cpu("report-store", run)
        print(f"report from the store (whole process) {new:.2f} CPU-s")
    (run.parent / "report-store.html").unlink(missing_ok=True)


def _cli_cpu(argv: list[str]) -> float:
    """The CPU seconds of one ``mlaunch trace`` command as a whole process (:func:`_cli_child`)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, __file__, "--cli-child", out.name, *argv], check=True)
        got = json.loads(Path(out.name).read_text())
    if got["code"]:
        raise SystemExit(f"mlaunch trace {' '.join(argv)}: exit {got['code']}")
    return float(got["cpu_s"])


def _bare_reads(run: Path, repeat: int) -> None:
    """The issue's two read ratios, whole processes against a process that only decodes the same
    input with orjson (run before and after: their A/A beside): ``mlaunch trace summary FILE`` of
    one traces file (the rank files of ``run`` joined; goal <= 3x) and of the run directory,
    each a first read (no store yet: it builds one beside the input, then reads it)."""
    import shutil

    from mlaunch.trace.store import store_site

    bare = run.parent / "bare" / "traces.jsonl"
    bare.parent.mkdir(exist_ok=True)
    with open(bare, "wb") as out:
        for f in sorted((run / "telemetry").glob("traces-rank*.jsonl")):
            out.write(f.read_bytes())
    for label, path in (("bare file", bare), ("run directory", run)):
        for _ in range(repeat):
            shutil.rmtree(store_site(path), ignore_errors=True)
            a = _process_cpu("decode", path)
            cmd = _cli_cpu(["summary", str(path)])
            b = _process_cpu("decode", path)
            print(f"trace summary {label} (first read, whole process) {cmd:.2f} CPU-s = "
                  f"{2 * cmd / (a + b):.2f}x the orjson decode (whole process {a:.2f} / {b:.2f} "
                  f"CPU-s, A/A {b / a:.2f}){'; goal <= 3x' if path == bare else ''}")  # fmt: skip
    shutil.rmtree(bare.parent)


#: Every reader of the store, as the user runs it: (label, ``mlaunch trace`` arguments after the
#: run directory; ``{out}`` is a scratch file). The goal: each whole process <= 1 GiB at any size.
READERS = (
    ("summary", ["summary", "{run}", "--json"]),
    ("goodput", ["goodput", "{run}", "--json"]),
    ("stragglers", ["stragglers", "{run}", "--json"]),
    (
        "sql",
        ["sql", "{run}", "SELECT name, count(*), avg(end_ns - start_ns) FROM spans GROUP BY 1"],
    ),
    ("report", ["report", "{run}", "-o", "{out}.html", "--iterations", "10:12"]),
    ("export chrome", ["export", "{run}", "-o", "-"]),  # to /dev/null: 30 GB at 10^8 spans
    ("export otlp-json", ["export", "{run}", "--format", "otlp-json", "-o", "-"]),
)
GIB = 1024.0


def _cli_child(out: str, argv: list[str]) -> None:
    """One ``mlaunch trace`` command in this (fresh) process, its standard output (where the
    exports write) to /dev/null; then its peak RSS (VmHWM: the whole process, every thread,
    DuckDB's and Arrow's memory included) and CPU (all threads) to the file ``out``."""
    import contextlib

    from mlaunch.cli import build_app

    sys.argv = ["mlaunch", "trace", *argv]
    code = 0
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        try:
            build_app("trace")()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    ru = resource.getrusage(resource.RUSAGE_SELF)
    Path(out).write_text(json.dumps({"rss_mib": _peak_rss_mib(), "code": code,
                                     "cpu_s": ru.ru_utime + ru.ru_stime}))  # fmt: skip


def _readers(run: Path, spans: int, skip: set[str] = frozenset()) -> None:
    """Each reader of :data:`READERS` on ``run``'s store, a fresh process each: wall, CPU and peak
    RSS (whole process), against the 1 GiB goal."""
    scratch = run.parent / "reader-out"
    print(f"readers on the store of {spans:,} spans (whole processes; goal: peak RSS <= 1 GiB)",
          flush=True)  # fmt: skip
    worst = 0.0
    for label, args in READERS:
        if label in skip:
            continue
        argv = [a.format(run=run, out=scratch) for a in args]
        res = run.parent / "reader.json"
        res.unlink(missing_ok=True)
        t = time.perf_counter()
        rc = subprocess.run([sys.executable, __file__, "--cli-child", str(res), *argv]).returncode
        wall = time.perf_counter() - t
        if not res.exists():  # it crashed (the traceback is above): no figures
            print(f"  {label:<17} wall {wall:8.1f} s  FAILED (exit {rc})", flush=True)
            worst = float("inf")
            continue
        got = json.loads(res.read_text())
        worst = max(worst, got["rss_mib"])
        flag = "" if got["rss_mib"] <= GIB else "  OVER 1 GiB"
        failed = f"  EXIT {got['code']}" if got["code"] else ""
        print(f"  {label:<17} wall {wall:8.1f} s  CPU {got['cpu_s']:8.1f} s  "
              f"peak RSS {got['rss_mib']:7,.0f} MiB{flag}{failed}", flush=True)  # fmt: skip
        for f in run.parent.glob("reader-out*"):
            f.unlink()
    print(f"  largest peak RSS {worst:,.0f} MiB: {'meets' if worst <= GIB else 'MISSES'} the "
          "1 GiB goal")  # fmt: skip


def _hex_u64(col: Any) -> Any:
    """A column of 16-hex-digit ids (null: 0) as uint64s."""
    import numpy as np
    import pyarrow.compute as pc

    text = "".join(pc.fill_null(col, "0" * 16).to_pylist())
    return np.frombuffer(bytes.fromhex(text), dtype=">u8").astype(np.uint64)


def _u64_hex(ids: Any, null: Any) -> Any:
    """uint64s as an Arrow column of 16-hex-digit ids (null where ``null``)."""
    import numpy as np
    import pyarrow as pa

    n = len(ids)
    data = pa.py_buffer(ids.astype(">u8").tobytes().hex().encode())
    offsets = pa.py_buffer(np.arange(0, 16 * (n + 1), 16, dtype=np.int32).tobytes())
    valid = None if null is None else pa.array(~null).buffers()[1]
    return pa.StringArray.from_buffers(n, offsets, data, valid)


_ITERATION_TEXT = '{"key":"megatron.iteration","value":{"intValue":"'


def _split_iteration(col: Any) -> tuple[Any, Any, Any]:
    """Each attribute text cut around its ``megatron.iteration`` number: (text before, text
    after, whether it has one); a text without one is all "before"."""
    import re

    import pyarrow as pa

    pat = re.compile(re.escape(_ITERATION_TEXT) + r"-?\d+")
    pre, post, has = [], [], []
    for text in col.to_pylist():
        m = pat.search(text) if text is not None else None
        if m is None:
            pre.append(text)
            post.append(None if text is None else "")
            has.append(False)
        else:
            pre.append(text[: m.start()] + _ITERATION_TEXT)
            post.append(text[m.end() :])
            has.append(True)
    return pa.array(pre, pa.string()), pa.array(post, pa.string()), pa.array(has)


def _store_only(
    spans: int, ranks: int, skip: set[str], microbatches: int = 4, layers: int = 4
) -> None:
    """A store of about ``spans`` spans without the JSON: a 50-step realistic run's store (of
    ``microbatches`` x ``layers`` a step: fewer make more iterations of the same spans), each
    rank's rows repeated with times shifted by the run's extent (iterations by 50, in the column
    and the attribute text; span ids made distinct per copy), written
    part by part (memory stays at one part), then the store passes of :func:`_child`."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from mlaunch.trace.store import open_store
    from mlaunch.trace.store_layout import MANIFEST, SEGMENT_ROWS, STORE_DIR

    with tempfile.TemporaryDirectory(prefix="mlaunch-trace-bench-") as tmp:
        tmpl = Path(tmp) / "template"
        write_realistic_run(
            tmpl, ranks=ranks, steps=50, microbatches=microbatches, layers=layers, pp=2
        )
        store = open_store(tmpl)
        assert store is not None
        run = Path(tmp) / "run"
        root = run / STORE_DIR
        root.mkdir(parents=True)
        t = time.perf_counter()
        parts: list[str] = []
        written = 0
        per_rank = spans // ranks
        for r in range(ranks):
            src = [p for p in store.parts if p.parent.name == f"rank={r}"]
            t_r = pa.concat_tables(pq.read_table(p) for p in src)
            n_t = t_r.num_rows
            copies = max(1, SEGMENT_ROWS // n_t)
            block = t_r.take(np.tile(np.arange(n_t), copies))
            st = t_r.column("start_ns").to_numpy()
            en = t_r.column("end_ns").to_numpy()
            period = int(en.max() - st.min()) + 1
            it = t_r.column("iteration").to_numpy(zero_copy_only=False)
            ids = _hex_u64(block.column("span_id"))
            parents = _hex_u64(block.column("parent_id"))
            roots = block.column("parent_id").is_null().to_numpy(zero_copy_only=False)
            pre, post, has_it = _split_iteration(block.column("attributes"))
            k = 0
            for part in range(-(-per_rank // block.num_rows)):
                shift = np.repeat(np.arange(k, k + copies, dtype=np.int64), n_t)
                cols = {
                    "start_ns": np.tile(st, copies) + shift * period,
                    "end_ns": np.tile(en, copies) + shift * period,
                    "iteration": pa.array(np.tile(it, copies) + shift * 50,
                                          mask=np.tile(np.isnan(it), copies)),
                }  # fmt: skip
                out = block
                for name, col in cols.items():
                    i = out.schema.get_field_index(name)
                    out = out.set_column(i, name, pa.array(col, pa.int64()))
                # each copy its own span ids (a copy's parents stay its own; links still point
                # into the first copy): readers that index spans by id see 10^8 distinct ones
                # and its own iteration numbers in the attribute text too (what report reads)
                num = pc.if_else(has_it, pa.array(cols["iteration"]).cast(pa.string()), "")
                i = out.schema.get_field_index("attributes")
                out = out.set_column(
                    i, "attributes", pc.binary_join_element_wise(pre, num, post, "")
                )
                tag = shift.astype(np.uint64) << np.uint64(32)
                for name, col, null in (("span_id", ids, None), ("parent_id", parents, roots)):
                    i = out.schema.get_field_index(name)
                    out = out.set_column(i, name, _u64_hex(col ^ tag, null))
                rel = f"spans/rank={r}/part-{part:05d}.parquet"
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                pq.write_table(out, root / rel, compression="zstd")
                parts.append(rel)
                written += out.num_rows
                k += copies
        (root / "resources.parquet").write_bytes((store.root / "resources.parquet").read_bytes())
        man = json.loads((store.root / MANIFEST).read_text())
        man.update(sources={}, files=[], parts=parts, spans=written)
        man["read"].update(files=0, lines=0, spans=written)
        (root / MANIFEST).write_text(json.dumps(man))
        sb = sum(f.stat().st_size for f in root.rglob("*.parquet"))
        print(f"generated {written:,} spans straight into the store: {sb / 2**20:,.0f} MiB, "
              f"{len(parts)} parts ({time.perf_counter() - t:.0f} s)", flush=True)  # fmt: skip
        del store, block, t_r, out
        _readers(run, written, skip)
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


def _update_cpu(run: Path) -> tuple[float, float]:
    """One ``python -m mlaunch.trace.store RUN`` (the receiver's append and the launcher's
    run-end build, as they run it, niced): (wall seconds, CPU seconds of the process)."""
    t = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "mlaunch.trace.store", str(run)])
    _, status, ru = os.wait4(p.pid, 0)
    if status:
        raise SystemExit(f"store update failed ({status})")
    return time.perf_counter() - t, ru.ru_utime + ru.ru_stime


def _writers(run: Path, spans: int, min_mib: float, repeat: int) -> None:
    """Where the store is written, measured (docs/trace.md, "The span store"):

    * the run-end build (what ``mlaunch train`` adds after the workers exit, for the file
      exporter's runs): wall and CPU of the store process, against an orjson decode process run
      before and after it (A/A);
    * the receiver's appends as the files grow (StoreAppender's geometric steps, first after
      ``min_mib``), plus the run-end tail: their CPU per span, against a full build before and
      after (A/A);
    * a worker writing Parquet itself in its file exporter: the CPU per span of turning span
      dicts into Parquet parts, against the exporter's JSON encoding of the same batches (the
      floor of what the file exporter pays now), measured twice (A/A).
    """
    import shutil

    from mlaunch.receiver.store_append import APPEND_GROWTH
    from mlaunch.trace.store_layout import STORE_DIR

    for _ in range(repeat):
        shutil.rmtree(run / STORE_DIR, ignore_errors=True)
        a = _process_cpu("decode", run)
        wall, cpu = _update_cpu(run)
        b = _process_cpu("decode", run)
        print(f"run-end build: {wall:.2f} s wall, {cpu:.2f} CPU-s = {1e6 * cpu / spans:.2f} "
              f"us/span = {2 * cpu / (a + b):.2f}x decode ({a:.2f} / {b:.2f} CPU-s, "
              f"A/A {b / a:.2f})")  # fmt: skip

    # The receiver: the same files grown line by line, the store appended at the appender's
    # steps, then the tail at the end (the launcher's build).
    files = sorted((run / "telemetry").glob("traces-*.jsonl"))
    lines = [(f.name, line) for f in files for line in f.read_bytes().splitlines(keepends=True)]
    live = run.parent / "live"
    for _ in range(repeat):
        shutil.rmtree(run / STORE_DIR, ignore_errors=True)
        _, full_a = _update_cpu(run)
        shutil.rmtree(live, ignore_errors=True)
        (live / "telemetry").mkdir(parents=True)
        out = {f.name: (live / "telemetry" / f.name).open("ab") for f in files}
        written = stored = appends = 0
        cpu = 0.0
        for name, line in lines:
            out[name].write(line)
            written += len(line)
            new = written - stored
            if new >= max(min_mib * 2**20, APPEND_GROWTH * stored):
                for fh in out.values():
                    fh.flush()
                stored = written
                cpu += _update_cpu(live)[1]
                appends += 1
        for fh in out.values():
            fh.close()
        tail_wall, tail_cpu = _update_cpu(live)
        cpu += tail_cpu
        shutil.rmtree(run / STORE_DIR, ignore_errors=True)
        _, full_b = _update_cpu(run)
        print(f"receiver appends: {appends} + the run-end tail ({tail_wall:.2f} s wall): "
              f"{cpu:.2f} CPU-s = {1e6 * cpu / spans:.2f} us/span = "
              f"{2 * cpu / (full_a + full_b):.2f}x one build ({full_a:.2f} / {full_b:.2f} CPU-s, "
              f"A/A {full_b / full_a:.2f})")  # fmt: skip

    # The worker's side: its exporter's batches (one OTLP line each) as JSON, and as Parquet.
    from mlaunch.trace.store_build import _Columns, _write_atomic
    from mlaunch.trace.store_layout import SEGMENT_ROWS

    batches = []
    reader = TraceReader.open(run)
    for res, batch, flagged in reader:
        batches.append((res, batch, flagged))

    def json_encode() -> float:
        t = time.process_time()
        for res, batch, _ in batches:
            orjson.dumps({"resourceSpans": [{"resource": {"attributes": res.attrs},
                                             "scopeSpans": [{"spans": batch}]}]})  # fmt: skip
        return time.process_time() - t

    def parquet_write() -> float:
        t = time.process_time()
        cols, n, k = _Columns(), 0, 0
        for _res, batch, flagged in batches:
            cols.add(0, None, batch, flagged)
            n += len(batch)
            if n >= SEGMENT_ROWS:
                _write_atomic(cols.table(), run.parent / "worker" / f"part-{k:05d}.parquet")
                cols, n, k = _Columns(), 0, k + 1
        if n:
            _write_atomic(cols.table(), run.parent / "worker" / f"part-{k:05d}.parquet")
        return time.process_time() - t

    for _ in range(repeat):
        a, pq_s, b = json_encode(), parquet_write(), json_encode()
        print(f"worker exporter: Parquet {1e6 * pq_s / spans:.2f} us/span = "
              f"{2 * pq_s / (a + b):.2f}x its JSON encoding ({1e6 * a / spans:.2f} / "
              f"{1e6 * b / spans:.2f} us/span, A/A {b / a:.2f})")  # fmt: skip


def main() -> None:
    """Generate, then time each pass."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--spans", type=int, default=1_000_000, help="about how many spans to generate")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument(
        "--microbatches",
        type=int,
        default=4,
        help="--store-only: microbatches a step (fewer: more steps for the spans)",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=4,
        help="--store-only: layers a pipeline stage (fewer: more steps for the spans)",
    )
    p.add_argument("--no-export", action="store_true", help="skip the Chrome export pass")
    p.add_argument("--no-store", action="store_true", help="skip the span store passes")
    p.add_argument("--no-json", action="store_true", help="skip the JSON reader's passes")
    p.add_argument("--no-report", action="store_true", help="skip the report comparison")
    p.add_argument("--store-only", action="store_true",
                   help="generate straight into the span store (no JSON; for 10^8 spans): a "
                   "realistic run's store tiled in time, then the store passes")  # fmt: skip
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="how many times to run the first-read trio (decode, first read, decode)",
    )
    p.add_argument("--run", help="an existing run directory: only the export/report comparisons")
    p.add_argument(
        "--writers",
        action="store_true",
        help="only where the store is written: the run-end build, the receiver's "
        "appends, a worker writing Parquet (each against its A/A control)",
    )
    p.add_argument(
        "--append-min-mib",
        type=float,
        default=64.0,
        help="--writers: the receiver's first append after this much JSON (the "
        "receiver's own step; smaller to see more steps on a small run)",
    )
    p.add_argument(
        "--decoders",
        nargs="?",
        const=",".join(DECODERS),
        metavar="A,B",
        help=f"only the OTLP-JSON decoder candidates of the first read, each against the orjson "
        f"floor with its A/A (default all: {','.join(DECODERS)})",
    )
    p.add_argument("--bare", action="store_true",
                   help="only `mlaunch trace summary` of one traces file and of the run "
                   "directory, first reads, against the orjson decode (the issue's ratios)")  # fmt: skip
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # one store pass, in a subprocess
    p.add_argument("--readers", action="store_true",
                   help="with the store passes: every reader of the store as a whole process "
                   "(wall, CPU, peak RSS; --store-only always runs them)")  # fmt: skip
    p.add_argument(
        "--skip-readers",
        default="",
        metavar="A,B",
        help="readers not to run (labels as printed: summary, export chrome, ...)",
    )
    if len(sys.argv) > 2 and sys.argv[1] == "--cli-child":  # one reader, in a subprocess
        _cli_child(sys.argv[2], sys.argv[3:])
        return
    args = p.parse_args()
    if args.child:
        _child(*args.child)
        return

    if args.run:
        run = Path(args.run)
        _process_cpu("first-read", run)  # the store exists before the comparisons
        if not args.no_export:
            _export_compare(run, args.repeat)
        if not args.no_report:
            _report_compare(run, args.repeat)
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        return
    if args.store_only:
        skip = set(filter(None, args.skip_readers.split(",")))
        _store_only(args.spans, args.ranks, skip, args.microbatches, args.layers)
        return
    micro, layers, pp = 4, 4, 2
    steps = max(1, round(args.spans / args.ranks / spans_per_step(micro, layers)))
    with tempfile.TemporaryDirectory(prefix="mlaunch-trace-bench-") as tmp:
        run = Path(tmp) / "run"
        t = time.perf_counter()
        n = write_realistic_run(run, ranks=args.ranks, steps=steps, microbatches=micro,
                                layers=layers, pp=pp, batch=512)  # fmt: skip
        size = sum(f.stat().st_size for f in (run / "telemetry").iterdir())
        print(f"generated {n:,} spans, {size / 2**20:,.0f} MiB in {args.ranks} files "
              f"({time.perf_counter() - t:.1f} s); Python {sys.version.split()[0]}")  # fmt: skip

        def fresh() -> Any:  # what a command's first read does: build the store, open it
            import shutil

            shutil.rmtree(run / "trace-store", ignore_errors=True)
            return open_reader(run)

        def summary_pass() -> int:
            r = fresh()
            summarize_store(r.store)
            return r.stats.spans

        def goodput_pass() -> int:
            r = fresh()
            goodput_store(r.store)
            return r.stats.spans

        def export_pass() -> int:
            return export_chrome(fresh(), Path(tmp) / "trace.json").spans

        if args.decoders:
            _decoders(run, args.repeat, args.decoders.split(","))
            print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
            return
        if args.writers:
            _writers(run, n, args.append_min_mib, args.repeat)
            print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
            return
        if not args.no_json:
            _timed("decode json", lambda: _decode_only(run, json.loads), None)
        base = _timed("decode orjson", lambda: _decode_only(run, orjson.loads), None)
        if not args.no_json:
            rate = _timed("summary", summary_pass, base)
            _timed("goodput", goodput_pass, base)
            if not args.no_export:
                _timed("export", export_pass, base)
            verdict = "meets" if rate >= 200_000 else "MISSES"
            print(f"summary {verdict} the 200,000 spans/s goal ({rate:,.0f} spans per CPU "
                  "second)")  # fmt: skip
        if args.bare:
            _bare_reads(run, args.repeat)
            print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
            return
        if not args.no_store:
            _first_read(run, args.repeat)
            sb = sum(f.stat().st_size for f in (run / "trace-store").rglob("*.parquet"))
            print(f"store {sb / 2**20:,.1f} MiB = 1/{size / sb:,.1f} of the JSON "
                  f"({size / 2**20:,.0f} MiB); goal <= 1/10")  # fmt: skip
            for what in ("summary-store", "goodput-store", "sql-count"):
                subprocess.run([sys.executable, __file__, "--child", what, str(run)], check=True)
            if args.readers:
                _readers(run, n)
            if not args.no_export:
                _export_compare(run, args.repeat)
            if not args.no_report:
                _report_compare(run, args.repeat)
        load = os.getloadavg()[0]
        print(f"load average {load:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
