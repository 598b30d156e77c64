"""The recorded span's C accelerator (``mlaunch.telemetry._cspan``) against its pure-Python
definition (``_recorder._PySpanBase``): the C one is in use wherever it is built, and both give the
same dump for the same spans. The recorder tests run against the fallback too."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.cpythons import PYTHONS, PythonUnavailable, cspan_python

from mlaunch import envcontract
from mlaunch.telemetry import _recorder

BUILT = importlib.util.find_spec("mlaunch.telemetry._cspan") is not None
HERE = Path(__file__).resolve().parent

#: One process's span sequence: nesting, a root span, attributes and events, an exception, spans
#: ended out of order, a span on a second thread, one still open at the dump. Prints the dump and
#: the spans' events (dumps carry no events) with span ids replaced by their order in the dump.
SEQUENCE = r"""
import json, sys, threading
from mlaunch import envcontract, telemetry
from mlaunch.rundir import layout as lay
from mlaunch.model.groups import SpanGroup as G
from mlaunch.model.spans import Attr, SpanName
from mlaunch.settings import load_telemetry_settings
from mlaunch.otlp import otlp_json
from mlaunch.telemetry import _recorder

run_dir = sys.argv[1]
settings = load_telemetry_settings(environ={
    "MEGATRON_OTEL_ENABLED": "1", "MEGATRON_OTEL_EXPORT_STRATEGY": "single_rank",
    "MEGATRON_OTEL_EXPORTER": "none", "MEGATRON_OTEL_RECORDER_GROUPS": "all",
    "MEGATRON_OTEL_RUN_ID": "testrun",
})
telemetry.setup(settings, rank=0, world_size=2, run_dir=run_dir)
kept = []
telemetry.set_iteration(1)
with telemetry.span(G.STEP, SpanName.ITERATION, {Attr.ITERATION: 1}) as it:
    kept.append(it)
    with telemetry.span(G.LAYER, "fwd", {"x": 1}, layer=0) as s:
        kept.append(s)
        s.set_attribute("k", "v")
        s.add_event("ev", {"a": 1}, timestamp=5)
    try:
        with telemetry.span(G.LAYER, "fails", layer=1) as s:
            kept.append(s)
            raise ValueError("boom")
    except ValueError:
        pass
    with telemetry.span(G.LAYER, "rooted", root=True) as s:
        kept.append(s)
        with telemetry.span(G.LAYER, "under_root") as s2:
            kept.append(s2)
    a, b = telemetry.span(G.LAYER, "a"), telemetry.span(G.LAYER, "b")
    a.__enter__(); b.__enter__()
    a.__exit__(None, None, None)  # out of order: the repair path
    with telemetry.span(G.LAYER, "after_a") as s:  # opened under b, the stack's top now
        kept.append(s)
    b.__exit__(None, None, None)
    kept += [a, b]
    worker = threading.Thread(target=lambda: kept.append(
        telemetry.span(G.LAYER, "thread").__enter__()))
    worker.start(); worker.join()
    kept[-1].__exit__(None, None, None)
telemetry.set_iteration(2)
with telemetry.span(G.STEP, SpanName.ITERATION, {Attr.ITERATION: 2}):
    with telemetry.span(G.LAYER, "before_dump"):
        pass
    telemetry.recorder_dump("request")  # the iteration span is written open
spans = otlp_json.read_spans(lay.recorder_file(run_dir, 0))
order = {s["span_id"]: i for i, s in enumerate(spans)}
out = []
for s in spans:
    assert s["end_ns"] >= s["start_ns"] > 0, s
    out.append([s["name"], s["trace_id"], order.get(s["parent_span_id"], s["parent_span_id"]),
                s["attributes"], s["status_code"], s["status_message"]])
events = {r.name: [(n, a) for n, a, _ in getattr(r, "events", None) or ()] for r in kept}
# A rebound module global is seen at the next span: C caches the globals it reads while the
# module's dict is unchanged, told so by CPython's dict internals (a version tag on 3.11, a dict
# watcher on 3.12+).
other, saved = [], _recorder._CURRENT
_recorder._CURRENT = other
with telemetry.span(G.LAYER, "after_rebind"):
    pass
_recorder._CURRENT = saved
with telemetry.span(G.LAYER, "after_restore"):
    pass
rebound = [[s.name for s in other], [s.name for s in saved][-1:]]
print(json.dumps({"base": _recorder.SPAN_BASE.__module__, "spans": out, "events": events,
                  "python": sys.version_info[:2], "rebound": rebound}))
telemetry.shutdown(1.0)
"""


def _run(
    tmp_path: Path, pure: bool, python: str = sys.executable, path: Path | None = None
) -> dict:
    """SEQUENCE's output under ``python`` (with ``path`` first on its PYTHONPATH, if given)."""
    env = dict(os.environ)
    env.pop(envcontract.PURE_PYTHON_SPANS, None)
    if pure:
        env[envcontract.PURE_PYTHON_SPANS] = "1"
    if path is not None:
        env["PYTHONPATH"] = str(path)
    run_dir = tmp_path / ("pure" if pure else "default")
    proc = subprocess.run(
        [python, "-c", SEQUENCE, str(run_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,  # not the checkout: `-c` puts the cwd first on sys.path
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_c_span_is_in_use_where_built_and_has_the_python_definitions_slots():
    if not BUILT:
        pytest.skip("the C accelerator is not built here (no compiler or Python headers)")
    from mlaunch.telemetry import _cspan

    pure = os.environ.get(envcontract.PURE_PYTHON_SPANS) == "1"
    assert (_recorder.SPAN_BASE is _cspan.SpanBase) is not pure
    fields = {
        k
        for k, v in vars(_cspan.SpanBase).items()
        if type(v).__name__ in ("member_descriptor", "getset_descriptor") and k[:2] != "__"
    }
    assert fields == set(_recorder._PySpanBase.__slots__)
    # The times, kept as C ints, read and write as the slots do.
    rec = _recorder.RecordedSpan()
    with pytest.raises(AttributeError):
        rec.end  # noqa: B018
    assert getattr(rec, "end", 0) == 0
    rec.end, rec.start = 2**70, None  # anything a slot takes
    assert (rec.end, rec.start) == (2**70, None)
    rec.start = 5
    del rec.end
    assert rec.start == 5 and not hasattr(rec, "end")
    assert isinstance(_recorder.RootRecordedSpan(), _recorder.RecordedSpan)
    assert not hasattr(_recorder.RecordedSpan(), "__dict__")  # slotted, as the fallback


def test_c_and_pure_python_spans_dump_the_same(tmp_path):
    default, pure = _run(tmp_path, pure=False), _run(tmp_path, pure=True)
    assert default["base"] == ("mlaunch.telemetry._cspan" if BUILT else pure["base"])
    _same_dumps(default, pure)


@pytest.mark.parametrize("version", PYTHONS, ids=[f"py{a}.{b}" for a, b in PYTHONS])
def test_c_and_pure_python_spans_dump_the_same_on_each_cpython(tmp_path, version):
    """_cspan.c reads CPython's dict internals, which differ between minor versions: built from
    the current source for each supported CPython, it is in use there and dumps what the
    pure-Python spans dump."""
    try:
        python, path = cspan_python(version, tmp_path / "lib")
    except PythonUnavailable as exc:
        pytest.skip(str(exc))
    default = _run(tmp_path, pure=False, python=python, path=path)
    pure = _run(tmp_path, pure=True, python=python, path=path)
    assert default["python"] == pure["python"] == list(version)
    assert default["base"] == "mlaunch.telemetry._cspan"
    _same_dumps(default, pure)


def _same_dumps(default: dict, pure: dict) -> None:
    assert pure["base"] == "mlaunch.telemetry._recorder"
    assert default["rebound"] == pure["rebound"] == [["after_rebind"], ["after_restore"]]
    assert default["spans"] == pure["spans"]
    assert default["events"] == pure["events"]
    # The sequence reached what it means to compare.
    spans = {s[0]: s for s in pure["spans"]}
    names = [s[0] for s in pure["spans"]]
    assert spans["fails"][4] == 2 and spans["fails"][5] == "ValueError: boom"
    assert [e[0] for e in pure["events"]["fails"]] == ["exception"]
    assert pure["events"]["fwd"] == [["ev", {"a": 1}]]
    assert spans["rooted"][2] == "" and names[spans["under_root"][2]] == "rooted"
    assert names[spans["after_a"][2]] == "b" and names[spans["b"][2]] == "a"
    assert spans["thread"][2] == ""  # its thread had nothing open: the trace id is its parent
    assert spans["fwd"][3]["k"] == "v" and spans["fwd"][3]["x"] == 1


def test_recorder_tests_pass_with_the_pure_python_fallback():
    env = {**os.environ, envcontract.PURE_PYTHON_SPANS: "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-n",
            "0",
            "-q",
            str(HERE / "test_telemetry_recorder.py"),
            str(HERE / "test_telemetry_cspan.py") + "::"
            "test_c_span_is_in_use_where_built_and_has_the_python_definitions_slots",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=HERE.parents[1],
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_recorded_spans_follow_a_rebound_module_global(make_settings, tmp_path, monkeypatch):
    """The C path reads ``_recorder``'s globals (cached while that dict is unchanged): a rebound
    one is seen at the next span, as the Python path sees it."""
    from mlaunch import telemetry
    from mlaunch.model.groups import SpanGroup as G

    settings = make_settings(EXPORT_STRATEGY="single_rank", RECORDER_GROUPS="all")
    telemetry.setup(settings, rank=0, world_size=2, run_dir=tmp_path)
    telemetry.set_iteration(1)
    with telemetry.span(G.LAYER, "before"):
        pass
    other: list = []
    monkeypatch.setattr(_recorder, "_CURRENT", other)
    with telemetry.span(G.LAYER, "after"):
        pass
    assert [s.name for s in other] == ["after"]
    assert [s.name for s in _recorder.RECORDER.current] == ["before"]
