"""The trace readers on the three kinds of trace a user brings:

(a) a trace written by a worker that emits through the real nemo-lens as Megatron-LM does
    (Megatron-LM's code names, per-rank trace ids, ``is_goodput_span`` marks), received by an
    in-process OTLP receiver and written as OTLP/JSON lines with mlaunch's encoder, as a
    collector's file exporter would;
(b) an mlaunch trace (the same code names, shared trace ids);
(c) an older mlaunch trace (the documented names, ``megatron.pretrain``,
    ``mlaunch.span.truncated``).

(b) and (c) are built with identical timings, so summary, goodput (with and without the
launcher's ``mlaunch.job`` span), the Perfetto export and the report must give the same figures.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.otlp import GrpcOtlpReceiver, _Store
from support.synthetic_traces import hand_example

from mlaunch.model.spans import ALIASES, STEP_SPAN, LegacyName, SpanName, canonical_name
from mlaunch.otlp import otlp_json
from mlaunch.trace.chrome import LAUNCHER_PID, export_chrome
from mlaunch.trace.goodput import goodput_store
from mlaunch.trace.report import write_report
from mlaunch.trace.store import open_reader
from mlaunch.trace.summary import summarize_store

#: The spans only one shape has: the legacy umbrella, and the start-up root that replaced it.
_SHAPE_ONLY = {LegacyName.PRETRAIN.value, SpanName.STARTUP.value}
JOB = (-100.0, 1100.0)  # the launcher's mlaunch.job around the hand example (ms)


def _run(tmp_path: Path, *, legacy: bool, job: tuple[float, float] | None = None) -> Path:
    name = ("legacy" if legacy else "code") + ("-job" if job else "")
    return hand_example(legacy=legacy, job=job)[0].write_run_dir(tmp_path / name)


def _summary_rows(run: Path) -> dict[str, Any]:
    d = summarize_store(open_reader(run).store).to_json()
    rows = {s["name"]: s for s in d["spans"] if s["name"] not in _SHAPE_ONLY}
    for row in rows.values():
        row.pop("share")  # the same numbers, but the umbrella's row shifts nothing else
    return {"rows": rows, "skew": d["step_skew"], "errors": d["errors"],
            "truncated": d["truncated"], "ranks": d["ranks_seen"]}  # fmt: skip


def test_summary_reads_old_names_as_the_code_names(tmp_path: Path) -> None:
    code, legacy = _run(tmp_path, legacy=False), _run(tmp_path, legacy=True)
    a, b = _summary_rows(code), _summary_rows(legacy)
    assert a == b
    assert STEP_SPAN in a["rows"] and a["rows"][STEP_SPAN]["count"] == 8
    assert not set(ALIASES) & set(a["rows"])  # documented names are shown as the code names
    assert a["truncated"] == 1  # nemo.span.truncated here, mlaunch.span.truncated there
    assert [r["rank"] for r in a["skew"]["ranks"]] == [0, 1]


@pytest.mark.parametrize("job", [None, JOB], ids=["no-job-span", "job-span"])
def test_goodput_is_the_same_for_code_and_documented_names(tmp_path: Path, job) -> None:
    code = goodput_store(open_reader(_run(tmp_path, legacy=False, job=job)).store).to_json()
    legacy = goodput_store(open_reader(_run(tmp_path, legacy=True, job=job)).store).to_json()
    for r in (*code["ranks"], *legacy["ranks"]):
        r.pop("wall_source")
    assert code == legacy
    r0, r1 = code["ranks"]
    assert (r0["productive_ms"], r0["steps"]) == (pytest.approx(400), 4)
    if job is None:
        assert (r0["wall_ms"], r1["wall_ms"]) == (pytest.approx(1000), pytest.approx(570))
        assert code["overall"]["job_wall_ms"] == pytest.approx(1000)
    else:
        # The launcher's job span is every rank's denominator: the 100 ms before the workers
        # and the 100 ms after them are lost time too.
        assert (r0["wall_ms"], r1["wall_ms"]) == (pytest.approx(1200), pytest.approx(1200))
        assert r0["unaccounted_ms"] == pytest.approx(100 + 200)
        assert r1["productive_ms"] == pytest.approx(570)
        assert code["overall"]["job_wall_ms"] == pytest.approx(1200)
        assert code["overall"]["goodput"] == pytest.approx(970 / 2400)


def test_goodput_names_its_wall_source(tmp_path: Path) -> None:
    def sources(**kw: Any) -> list[str]:
        return [r.wall_source for r in goodput_store(open_reader(_run(tmp_path, **kw)).store).ranks]

    assert sources(legacy=False, job=JOB) == [SpanName.JOB, SpanName.JOB]
    assert sources(legacy=True) == [LegacyName.PRETRAIN, "span extent"]
    assert sources(legacy=False) == ["span extent", "span extent"]


def _chrome_slices(run: Path, out: Path) -> tuple[list[tuple], Any]:
    stats = export_chrome(open_reader(run), out)
    doc = json.loads(out.read_text())
    xs = sorted(
        (canonical_name(e["name"]), e["pid"], e["ts"], e["dur"], e["cat"])
        for e in doc["traceEvents"]
        if e["ph"] == "X" and e["name"] not in _SHAPE_ONLY
    )
    return xs, stats


def test_perfetto_export_gives_the_same_slices_and_categories(tmp_path: Path) -> None:
    a, _ = _chrome_slices(_run(tmp_path, legacy=False), tmp_path / "a.json")
    b, _ = _chrome_slices(_run(tmp_path, legacy=True), tmp_path / "b.json")
    assert a == b
    assert ("megatron.checkpoint.save", 0, 600000.0, 100000.0, "checkpoint") in a


def test_perfetto_export_shows_the_launchers_job_trace_as_its_own_process(tmp_path: Path) -> None:
    out = tmp_path / "job.json"
    export_chrome(open_reader(_run(tmp_path, legacy=False, job=JOB)), out)
    doc = json.loads(out.read_text())
    names = {
        e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"
    }  # fmt: skip
    assert "launcher (node 0)" in names
    job = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"] == SpanName.JOB]
    assert [e["pid"] for e in job] == [LAUNCHER_PID]


def _figures(page: Path) -> dict:
    m = re.search(r'<script type="application/json" id="report-figures">(.*?)</script>',
                  page.read_text(), re.S)  # fmt: skip
    assert m
    return json.loads(m.group(1).replace("<\\/", "</"))


@pytest.mark.parametrize("job", [None, JOB], ids=["no-job-span", "job-span"])
def test_report_figures_are_the_same_for_code_and_documented_names(tmp_path: Path, job) -> None:
    pages = [
        write_report(_run(tmp_path, legacy=legacy, job=job), tmp_path / f"{legacy}.html")
        for legacy in (False, True)
    ]
    a, b = (_figures(p) for p in pages)
    a.pop("timeline"), b.pop("timeline")  # the legacy umbrella is one more bar there
    assert a == b
    assert a  # skew, goodput and curves are there


# ----------------------------------------------------------------------------------------------
# (a) a real nemo-lens worker, as Megatron-LM emits

LENS_ITERS, LENS_SAVE_INTERVAL = 6, 3


class _RecordingStore(_Store):
    """Keeps every trace request as the OTLP/JSON line mlaunch's file exporter writes."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def add_traces(self, request: Any, headers: dict[str, str]) -> None:
        with self.cond:
            self.lines.append(json.dumps(otlp_json.trace_request_to_dict(request)))
        super().add_traces(request, headers)


@pytest.fixture(scope="module")
def lens_trace(lens_python, tmp_path_factory) -> Path:
    """Two ranks of the Megatron-LM-like worker on the real nemo-lens, exporting OTLP/gRPC to an
    in-process receiver; what arrived, as one collector-style OTLP/JSON file."""
    from support.nemo_lens import WORKER

    tmp = tmp_path_factory.mktemp("lens")
    rx = GrpcOtlpReceiver()
    rx._store = _RecordingStore()
    rx.start()
    try:
        env = {
            k: v for k, v in os.environ.items()
            if not k.startswith(("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_", "TORCHELASTIC_"))
        }  # fmt: skip
        env.update(
            MEGATRON_OTEL_ENABLED="true", MEGATRON_OTEL_EXPORTER="otlp",
            MEGATRON_OTEL_EXPORT_STRATEGY="all_ranks", MEGATRON_OTEL_SPAN_GROUPS="per_step",
            OTEL_EXPORTER_OTLP_ENDPOINT=rx.endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
            OTEL_EXPORTER_OTLP_INSECURE="true", WORLD_SIZE="2", LENS_WORKER_ITER_SECONDS="0.01",
            MLAUNCH_RUN_DIR=str(tmp),
        )  # fmt: skip
        args = [
            "--train-iters", str(LENS_ITERS), "--save-interval", str(LENS_SAVE_INTERVAL),
            "--save", str(tmp / "ckpt"), "--micro-batch-size", "1", "--global-batch-size", "4",
            "--eval-interval", "3", "--eval-iters", "2", "--log-interval", "1",
        ]  # fmt: skip
        procs = [
            subprocess.Popen(
                [str(lens_python), str(WORKER), *args],
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                cwd=tmp,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            for r in range(2)
        ]
        for p in procs:
            out, _ = p.communicate(timeout=180)
            assert p.returncode == 0, out[-3000:]
        assert rx.wait_for_spans(2, timeout=20)
    finally:
        rx.stop()
    path = tmp / "collector-traces.jsonl"
    path.write_text("".join(line + "\n" for line in rx._store.lines))
    return path


@pytest.mark.nemo_lens
def test_a_megatron_trace_from_the_real_nemo_lens_is_summarized(lens_trace: Path) -> None:
    spans = otlp_json.read_spans(lens_trace)
    # What Megatron-LM does and mlaunch's trainer does not: each rank has its own trace ids.
    blocks = {}
    for s in spans:
        if s["name"] == SpanName.TRAIN:
            blocks.setdefault(s["resource"]["dl.rank"], set()).add(s["trace_id"])
    assert len(blocks) == 2 and blocks[0].isdisjoint(blocks[1])

    d = summarize_store(open_reader(lens_trace).store).to_json()
    rows = {s["name"]: s for s in d["spans"]}
    assert rows[STEP_SPAN]["count"] == 2 * LENS_ITERS
    assert rows[SpanName.TRAIN]["count"] == 2 * (LENS_ITERS // LENS_SAVE_INTERVAL)
    assert rows[SpanName.FORWARD_BACKWARD]["share"] < 1.0
    assert d["ranks_seen"] == [0, 1]
    assert [r["steps"] for r in d["step_skew"]["ranks"]] == [LENS_ITERS, LENS_ITERS]


@pytest.mark.nemo_lens
def test_a_megatron_trace_gives_a_goodput_figure(lens_trace: Path) -> None:
    rep = goodput_store(open_reader(lens_trace).store)
    assert [r.steps for r in rep.ranks] == [LENS_ITERS, LENS_ITERS]
    assert 0.0 < rep.overall.goodput < 1.0
    for r in rep.ranks:
        b = r.breakdown
        assert b.restart_split_ms["model_init"] > 0 and b.restart_split_ms["data_setup"] > 0
        assert b.checkpoint_ms > 0 and b.evaluation_ms > 0
        parts = b.productive_ms + b.restart_ms + b.checkpoint_ms + b.evaluation_ms
        assert parts + b.unaccounted_ms == pytest.approx(b.wall_ms)


@pytest.mark.nemo_lens
def test_a_megatron_trace_exports_to_perfetto_and_reports(lens_trace: Path, tmp_path) -> None:
    out = tmp_path / "lens.json"
    stats = export_chrome(open_reader(lens_trace), out)
    assert stats.processes == 2
    # Each block links to the previous one (the first to startup): flows within each rank.
    assert stats.flows == 2 * (LENS_ITERS // LENS_SAVE_INTERVAL)
    run = tmp_path / "run"
    (run / "telemetry").mkdir(parents=True)
    (run / "telemetry" / "traces-rank0.jsonl").write_text(lens_trace.read_text())
    page = write_report(run, tmp_path / "lens.html")
    figs = _figures(page)
    assert figs["timeline"]["data"]
