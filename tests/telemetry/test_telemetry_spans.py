# ruff: noqa: SIM117 - nested with-blocks mirror the span tree under test
"""The span API against the file exporter: names, parents (across coarse and fine spans), trace
identity, attributes, resource, errors, truncation, propagation."""

from __future__ import annotations

import os
import socket
import threading

import pytest
from telemetry_helpers import by_name, parent_names, read_trace_file

import mlaunch
from mlaunch import telemetry
from mlaunch.model.groups import SpanGroup as G
from mlaunch.model.spans import Attr, ResourceAttr, region_name
from mlaunch.model.spans import SpanName as S
from mlaunch.rundir import layout as lay


def test_disabled_telemetry_creates_nothing(make_settings, tmp_path):
    handle = telemetry.setup(make_settings(ENABLED="0"), rank=0, world_size=1, run_dir=tmp_path)
    assert not handle.exporting and handle.enabled_groups == frozenset()
    assert not telemetry.is_enabled(G.JOB)
    cm = telemetry.span(G.JOB, S.STARTUP)
    assert cm is telemetry.span(G.LAYER, S.LAYER_FORWARD)  # one preallocated null object
    with cm as s:
        assert s is cm  # the null span: its own context manager
        s.set_attribute(Attr.LOSS, 1.0)  # every span method is there and does nothing
        s.set_attributes({"a": 1})
        s.add_event("e")
        s.set_status(None)
        assert not s.is_recording()
    with telemetry.trace_region("x") as s:
        assert isinstance(s, telemetry.NullSpan)
    assert telemetry.current_context_ints() == (0, 0, 0, 0)
    telemetry.record_step(1, step_ms=1.0)
    telemetry.shutdown()
    assert not (tmp_path / lay.TELEMETRY_DIR).exists()


def test_non_exporting_rank_has_empty_enabled_set(make_settings, tmp_path):
    settings = make_settings(EXPORT_STRATEGY="single_rank")  # last rank exports
    handle = telemetry.setup(settings, rank=0, world_size=4, run_dir=tmp_path)
    assert not handle.exporting and handle.enabled_groups == frozenset()
    assert not telemetry.is_enabled(G.JOB)
    with telemetry.span(G.JOB, S.STARTUP) as s:
        assert isinstance(s, telemetry.NullSpan)


def test_second_setup_is_refused_until_shutdown(make_settings, tmp_path):
    telemetry.setup(make_settings(), rank=0, world_size=1, run_dir=tmp_path)
    with pytest.raises(RuntimeError, match="already set up"):
        telemetry.setup(make_settings(), rank=0, world_size=1, run_dir=tmp_path)
    telemetry.shutdown()
    telemetry.setup(make_settings(), rank=0, world_size=1, run_dir=tmp_path)


def test_span_groups_decide_which_spans_exist(make_settings, tmp_path):
    handle = telemetry.setup(
        make_settings(SPAN_GROUPS="per_step"), rank=0, world_size=1, run_dir=tmp_path
    )
    assert G.STEP in handle.enabled_groups and G.LAYER not in handle.enabled_groups
    assert telemetry.is_enabled(G.STEP) and telemetry.is_enabled("step")
    assert not telemetry.is_enabled(G.MICROBATCH)
    with telemetry.span(G.STEP, S.ITERATION):
        # a disabled parent group: the child attaches to the nearest enabled ancestor
        with telemetry.span(G.MICROBATCH, S.MICROBATCH_FORWARD) as mb:
            assert isinstance(mb, telemetry.NullSpan)
            with telemetry.span(G.COMMUNICATION, S.P2P_SEND_FORWARD):
                pass
    telemetry.shutdown()
    spans = read_trace_file(tmp_path)
    assert sorted(s["name"] for s in spans) == [S.P2P_SEND_FORWARD, S.ITERATION]
    assert parent_names(spans)[S.P2P_SEND_FORWARD] == S.ITERATION


def test_parents_cross_between_coarse_and_fine_spans(make_settings, tmp_path):
    telemetry.setup(make_settings(), rank=0, world_size=1, run_dir=tmp_path)
    with telemetry.span(G.JOB, S.STARTUP, **{Attr.MODEL_TYPE: "gpt"}):  # coarse
        with telemetry.span(G.FORWARD_BACKWARD, S.FORWARD_BACKWARD):  # coarse
            with telemetry.span(
                G.MICROBATCH, S.MICROBATCH_FORWARD, **{Attr.MICROBATCH_ID: 3}
            ) as mb:
                mb.set_attribute("extra", 1.5)
                with telemetry.span(G.LAYER, S.LAYER_FORWARD, **{Attr.LAYER_NUMBER: 1}):  # fine
                    with telemetry.trace_region("inner"):  # fine
                        with telemetry.span(G.CHECKPOINT, S.CHECKPOINT_SAVE_IO_WRITE):  # coarse
                            with telemetry.span(G.LAYER, S.LAYER_MLP):  # fine
                                pass
    telemetry.shutdown()
    spans = read_trace_file(tmp_path)
    assert parent_names(spans) == {
        S.STARTUP: None,
        S.FORWARD_BACKWARD: S.STARTUP,
        S.MICROBATCH_FORWARD: S.FORWARD_BACKWARD,
        S.LAYER_FORWARD: S.MICROBATCH_FORWARD,
        region_name("inner"): S.LAYER_FORWARD,
        S.CHECKPOINT_SAVE_IO_WRITE: region_name("inner"),
        S.LAYER_MLP: S.CHECKPOINT_SAVE_IO_WRITE,
    }
    assert len({s["trace_id"] for s in spans}) == 1
    named = by_name(spans)
    assert named[S.MICROBATCH_FORWARD]["attributes"] == {Attr.MICROBATCH_ID: 3, "extra": 1.5}
    assert named[S.STARTUP]["attributes"] == {Attr.MODEL_TYPE: "gpt", Attr.IS_GOODPUT: True}
    assert named[S.CHECKPOINT_SAVE_IO_WRITE]["attributes"] == {Attr.IS_GOODPUT: True}
    # Megatron-LM's marks, span by span: forward_backward is marked, layers and regions are not.
    assert named[S.FORWARD_BACKWARD]["attributes"] == {Attr.IS_GOODPUT: True}
    assert Attr.IS_GOODPUT not in named[S.LAYER_FORWARD]["attributes"]
    # children inside parents in time
    for s in spans:
        assert s["start_ns"] <= s["end_ns"]
    fb, mlp = named[S.FORWARD_BACKWARD], named[S.LAYER_MLP]
    assert fb["start_ns"] <= mlp["start_ns"] <= mlp["end_ns"] <= fb["end_ns"]


def test_resource_attributes(make_settings, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_PARTITION", "gpu")
    settings = make_settings(
        USER_ID="alice", OTEL_RESOURCE_ATTRIBUTES="team=llm,deployment.environment=test"
    )
    resource = {
        ResourceAttr.TP_SIZE: 1,
        ResourceAttr.PP_SIZE: 2,
        ResourceAttr.PRECISION: "bf16",
        ResourceAttr.GPU_COUNT: 0,
    }
    telemetry.setup(
        settings, rank=1, world_size=2, local_rank=1, resource=resource, run_dir=tmp_path
    )
    with telemetry.span(G.JOB, S.STARTUP):
        pass
    telemetry.shutdown()
    (span,) = read_trace_file(tmp_path, rank=1)
    res = span["resource"]
    assert res[ResourceAttr.SERVICE_NAME] == "megatron-lm"
    assert res[ResourceAttr.SERVICE_VERSION] == mlaunch.__version__
    assert res[ResourceAttr.SERVICE_INSTANCE_ID] == "testrun-rank1"
    assert res[ResourceAttr.RUN_ID] == "testrun"
    assert res[ResourceAttr.USER_ID] == "alice"
    assert (res[ResourceAttr.RANK], res[ResourceAttr.WORLD_SIZE], res[ResourceAttr.LOCAL_RANK]) == (
        1,
        2,
        1,
    )
    assert res[ResourceAttr.HOST_NAME] == socket.gethostname()
    assert res[ResourceAttr.PROCESS_PID] == os.getpid()
    assert res[ResourceAttr.PP_SIZE] == 2 and res[ResourceAttr.PRECISION] == "bf16"
    assert res[ResourceAttr.RESTART_COUNT] == 0
    assert res["slurm.job.id"] == "4242" and res["slurm.partition"] == "gpu"
    assert res["team"] == "llm" and res["deployment.environment"] == "test"


def test_exception_sets_error_status_and_event(make_settings, tmp_path):
    telemetry.setup(make_settings(), rank=0, world_size=1, run_dir=tmp_path)
    for group, name in ((G.CHECKPOINT, S.CHECKPOINT_SAVE), (G.LAYER, S.LAYER_FORWARD)):
        with pytest.raises(ValueError, match="boom"), telemetry.span(group, name):
            raise ValueError("boom")
    telemetry.shutdown()
    for span in read_trace_file(tmp_path):
        assert span["status_code"] == 2 and span["status_message"] == "ValueError: boom"
        (event,) = span["events"]
        assert event["name"] == "exception"
        assert event["attributes"]["exception.type"] == "ValueError"
        assert event["attributes"]["exception.message"] == "boom"
        assert "Traceback" in event["attributes"]["exception.stacktrace"]


def test_shutdown_truncates_open_spans_and_is_idempotent(make_settings, tmp_path):
    telemetry.setup(make_settings(), rank=0, world_size=1, run_dir=tmp_path)
    outer = telemetry.span(G.JOB, S.TRAIN)
    outer.__enter__()
    inner = telemetry.span(G.LAYER, S.LAYER_FORWARD)
    inner.__enter__()
    telemetry.shutdown()
    telemetry.shutdown()
    # the with-blocks unwinding later (e.g. after SIGTERM) must not export the spans twice
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)
    spans = read_trace_file(tmp_path)
    assert sorted(s["name"] for s in spans) == [S.LAYER_FORWARD, S.TRAIN]
    assert all(s["attributes"][Attr.TRUNCATED] is True for s in spans)
    assert not telemetry.is_enabled(G.JOB)


def test_trace_fn_wraps_calls(make_settings, tmp_path):
    @telemetry.trace_fn(G.DATA_LOADING, S.GET_BATCH)
    def get_batch(x: int) -> int:
        return x + 1

    assert get_batch(1) == 2  # before setup: plain call
    telemetry.setup(make_settings(), rank=0, world_size=1, run_dir=tmp_path)
    assert get_batch(2) == 3
    telemetry.shutdown()
    assert [s["name"] for s in read_trace_file(tmp_path)] == [S.GET_BATCH]


def test_inject_extract_and_context_ints_round_trip(make_settings, tmp_path):
    telemetry.setup(make_settings(), rank=0, world_size=1, run_dir=tmp_path)
    carrier: dict[str, str] = {}
    telemetry.inject(carrier)
    assert carrier == {}  # no current span
    assert telemetry.extract({}) is None and telemetry.context_from_ints((0, 0, 0, 0)) is None
    for group, name in ((G.JOB, S.TRAIN), (G.COMMUNICATION, S.P2P_SEND_FORWARD)):
        with telemetry.span(group, name) as s:
            ctx = s.get_span_context()
            telemetry.inject(carrier)
            assert carrier["traceparent"] == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"
            got = telemetry.extract(carrier)
            assert (got.trace_id, got.span_id, got.is_remote) == (ctx.trace_id, ctx.span_id, True)
            ints = telemetry.current_context_ints()
            assert all(-(2**63) <= v < 2**63 for v in ints)
            back = telemetry.context_from_ints(list(ints))
            assert (back.trace_id, back.span_id, back.trace_flags.sampled) == (
                ctx.trace_id,
                ctx.span_id,
                True,
            )
    assert telemetry.extract({"traceparent": "garbage"}) is None


def test_linked_span_links_to_the_sender(make_settings, tmp_path):
    telemetry.setup(make_settings(), rank=0, world_size=1, run_dir=tmp_path)
    with telemetry.span(G.FORWARD_BACKWARD, S.FORWARD_BACKWARD):
        with telemetry.span(G.COMMUNICATION, S.P2P_SEND_FORWARD):
            ints = telemetry.current_context_ints()
        attrs = {Attr.PP_RANK: 1, Attr.DL_MICROBATCH_ID: 0}
        with telemetry.linked_span(
            G.COMMUNICATION, S.PP_RECV_FORWARD_LINKED, telemetry.context_from_ints(ints), **attrs
        ):
            pass
        with telemetry.span(G.COMMUNICATION, S.P2P_SEND_FORWARD):
            carrier: dict[str, str] = {}
            telemetry.inject(carrier)
        with telemetry.linked_span(G.OPTIMIZER, S.OPTIMIZER, carrier):  # a coarse linked span
            pass
    telemetry.shutdown()
    spans = read_trace_file(tmp_path)
    sends = [s for s in spans if s["name"] == S.P2P_SEND_FORWARD]
    named = by_name(spans)
    linked = named[S.PP_RECV_FORWARD_LINKED]
    assert linked["attributes"] == {Attr.PP_RANK: 1, Attr.DL_MICROBATCH_ID: 0}
    assert [(ln["trace_id"], ln["span_id"]) for ln in linked["links"]] == [
        (sends[0]["trace_id"], sends[0]["span_id"])
    ]
    assert parent_names(spans)[S.PP_RECV_FORWARD_LINKED] == S.FORWARD_BACKWARD
    assert [ln["span_id"] for ln in named[S.OPTIMIZER]["links"]] == [sends[1]["span_id"]]


def _run_rank(
    make_settings, tmp_path, rank: int, iters: int, restart: int = 0, environ: dict | None = None
):
    """A script that keeps one ``megatron.train`` open over ``iters`` iterations (1-based) with
    K = 3 and no saves: set_iteration re-roots it into one trace per block."""
    settings = make_settings(TRACE_SEGMENT_ITERS="3", SPAN_GROUPS="job,step,layer")
    telemetry.setup(
        settings,
        rank=rank,
        world_size=2,
        run_dir=tmp_path,
        resource={ResourceAttr.RESTART_COUNT: restart},
    )
    with telemetry.span(G.JOB, S.STARTUP):
        pass
    telemetry.set_iteration(1)
    with telemetry.span(G.JOB, S.TRAIN):
        for it in range(1, iters + 1):
            telemetry.set_iteration(it)
            with telemetry.span(G.STEP, S.ITERATION, **{Attr.ITERATION: it}):
                with telemetry.span(G.LAYER, S.LAYER_FORWARD):
                    pass
    telemetry.shutdown()
    return read_trace_file(tmp_path, rank)


def test_blocks_share_trace_ids_across_ranks_and_are_linked_in_a_chain(make_settings, tmp_path):
    rank0 = _run_rank(make_settings, tmp_path, 0, 7)
    rank1 = _run_rank(make_settings, tmp_path, 1, 7)

    def step_traces(spans):
        return {
            s["attributes"][Attr.ITERATION]: s["trace_id"]
            for s in spans
            if s["name"] == S.ITERATION
        }

    assert step_traces(rank0) == step_traces(rank1)  # no communication needed
    traces = step_traces(rank0)
    # K = 3: iterations 1-3 are block 0, 4-6 block 1, 7 block 2; startup has a trace of its own.
    assert traces[1] == traces[3] != traces[4] == traces[6] != traces[7]
    startup = by_name(rank0)[S.STARTUP]
    assert startup["trace_id"] not in traces.values()
    assert {s["trace_id"] for s in rank0 if s["name"] == S.STARTUP} == {
        s["trace_id"] for s in rank1 if s["name"] == S.STARTUP
    }
    trains = [s for s in rank0 if s["name"] == S.TRAIN]
    assert [t["attributes"][Attr.TRAIN_BLOCK] for t in trains] == [0, 1, 2]
    assert all(t["attributes"][Attr.IS_GOODPUT] is True for t in trains)
    previous = startup
    for cur in trains:
        assert cur["parent_span_id"] == ""  # a root...
        assert [(ln["trace_id"], ln["span_id"]) for ln in cur["links"]] == [
            (previous["trace_id"], previous["span_id"])  # ...linked to the previous block
        ]
        assert previous["end_ns"] <= cur["start_ns"]
        previous = cur
    # every step hangs under the block of its trace
    train_by_trace = {t["trace_id"]: t["span_id"] for t in trains}
    for s in rank0:
        if s["name"] == S.ITERATION:
            assert s["parent_span_id"] == train_by_trace[s["trace_id"]]


def test_restart_gets_distinct_trace_ids(make_settings, tmp_path):
    first = _run_rank(make_settings, tmp_path / "a", 0, 2, restart=0)
    second = _run_rank(make_settings, tmp_path / "b", 0, 2, restart=1)
    assert {s["trace_id"] for s in first}.isdisjoint({s["trace_id"] for s in second})


def test_save_interval_sets_the_block_size(make_settings, tmp_path):
    telemetry.setup(
        make_settings(SPAN_GROUPS="job,step"), rank=0, world_size=1, run_dir=tmp_path,
        save_interval=2,
    )  # fmt: skip
    for block_start in (1, 3, 5):
        telemetry.set_iteration(block_start)
        with telemetry.span(G.JOB, S.TRAIN):
            for it in (block_start, block_start + 1):
                telemetry.set_iteration(it)
                with telemetry.span(G.STEP, S.ITERATION, **{Attr.ITERATION: it}):
                    pass
    telemetry.shutdown()
    spans = read_trace_file(tmp_path)
    trains = [s for s in spans if s["name"] == S.TRAIN]
    assert [t["attributes"][Attr.TRAIN_BLOCK] for t in trains] == [0, 1, 2]
    steps = {
        s["attributes"][Attr.ITERATION]: s["trace_id"] for s in spans if s["name"] == S.ITERATION
    }
    assert steps[1] == steps[2] != steps[3] == steps[4] != steps[5] == steps[6]


@pytest.mark.parametrize(
    "value, linked",
    [
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", True),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", False),  # no flags
        ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", False),  # zero trace id
        ("not a traceparent", False),
    ],
)
def test_startup_links_to_the_launchers_attempt_span_from_traceparent(
    make_settings, tmp_path, monkeypatch, caplog, value, linked
):
    monkeypatch.setenv("TRACEPARENT", value)
    telemetry.setup(make_settings(), rank=0, world_size=1, run_dir=tmp_path)
    with telemetry.span(G.JOB, S.STARTUP), telemetry.span(G.MODEL_INIT, S.MODEL_INIT):
        pass
    with telemetry.span(G.JOB, S.STARTUP):  # a second root of the same name links again
        pass
    telemetry.shutdown()
    spans = read_trace_file(tmp_path)
    startups = [s for s in spans if s["name"] == S.STARTUP]
    want = [tuple(value.split("-")[1:3])] if linked else []
    for st in startups:
        assert [(ln["trace_id"], ln["span_id"]) for ln in st["links"]] == want
    assert by_name(spans)[S.MODEL_INIT]["links"] == []
    warned = [r for r in caplog.records if "TRACEPARENT" in r.getMessage()]
    assert len(warned) == (0 if linked else 1)  # an invalid value: ignored, logged once


def test_threads_have_their_own_stacks_and_shutdown_truncates_every_thread(make_settings, tmp_path):
    import threading

    telemetry.setup(make_settings(), rank=0, world_size=1, run_dir=tmp_path)
    opened, release = threading.Event(), threading.Event()

    def worker() -> None:
        with telemetry.span(G.CHECKPOINT, S.CHECKPOINT_SAVE_IO_WRITE):
            with telemetry.trace_region("async-write"):
                opened.set()
                release.wait(10)

    with telemetry.span(G.JOB, S.TRAIN):
        thread = threading.Thread(target=worker)
        thread.start()
        assert opened.wait(10)
        telemetry.shutdown()
    release.set()
    thread.join(10)
    spans = read_trace_file(tmp_path)
    parents = parent_names(spans)
    assert parents[S.CHECKPOINT_SAVE_IO_WRITE] is None  # not parented across threads
    assert parents[region_name("async-write")] == S.CHECKPOINT_SAVE_IO_WRITE
    assert all(s["attributes"].get(Attr.TRUNCATED) is True for s in spans)
    assert len(spans) == 3


def test_a_slurm_requeue_gets_distinct_trace_ids(make_settings, tmp_path, monkeypatch):
    """A requeued job starts torchrun's restart count at 0 again; Megatron-LM's run_uuid (from
    SLURM_RESTART_COUNT) still tells the incarnations apart."""
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    first = _run_rank(make_settings, tmp_path / "a", 0, 2)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    second = _run_rank(make_settings, tmp_path / "b", 0, 2)
    assert {s["trace_id"] for s in first}.isdisjoint({s["trace_id"] for s in second})


def test_attrs_mapping_takes_attr_members_as_keys(make_settings, tmp_path):
    telemetry.setup(make_settings(), rank=0, world_size=1, run_dir=tmp_path)
    with telemetry.span(G.JOB, S.STARTUP, {Attr.MODEL_TYPE: "gpt"}):  # coarse
        with telemetry.span(G.MICROBATCH, S.MICROBATCH_FORWARD, {Attr.MICROBATCH_ID: 3}, x=1):
            with telemetry.device_span(G.LAYER, S.LAYER_FORWARD, {Attr.LAYER_NUMBER: 2}):
                pass
    telemetry.shutdown()
    named = by_name(read_trace_file(tmp_path))
    assert named[S.STARTUP]["attributes"] == {Attr.MODEL_TYPE: "gpt", Attr.IS_GOODPUT: True}
    assert named[S.MICROBATCH_FORWARD]["attributes"] == {Attr.MICROBATCH_ID: 3, "x": 1}
    assert named[S.LAYER_FORWARD]["attributes"] == {Attr.LAYER_NUMBER: 2}


def test_root_span_has_no_parent_whatever_is_open(make_settings, tmp_path):
    telemetry.setup(make_settings(), rank=0, world_size=1, run_dir=tmp_path)
    with telemetry.span(G.JOB, S.STARTUP):
        with telemetry.span(G.INFERENCE, "text_completion m", root=True):  # coarse
            with telemetry.span(G.LAYER, S.LAYER_FORWARD):  # a child of the root, as usual
                pass
        with telemetry.span(G.LAYER, S.LAYER_MLP, root=True):  # fine
            pass
        with telemetry.span(G.LAYER, S.LAYER_SELF_ATTENTION):  # the stack is as it was
            pass
    telemetry.shutdown()
    spans = read_trace_file(tmp_path)
    assert parent_names(spans) == {
        S.STARTUP: None,
        "text_completion m": None,
        S.LAYER_FORWARD: "text_completion m",
        S.LAYER_MLP: None,
        S.LAYER_SELF_ATTENTION: S.STARTUP,
    }
    assert len({s["trace_id"] for s in spans}) == 1  # roots in the current trace


def test_suppressed_makes_spans_null_and_hands_no_context_on(make_settings, tmp_path):
    telemetry.setup(make_settings(), rank=0, world_size=1, run_dir=tmp_path)
    seen_elsewhere: list[bool] = []
    with telemetry.span(G.JOB, S.STARTUP):
        assert telemetry.current_context_ints() != (0, 0, 0, 0)
        with telemetry.suppressed():
            assert not telemetry.is_enabled(G.LAYER)
            for make in (telemetry.span, telemetry.device_span):
                with make(G.LAYER, S.LAYER_FORWARD) as s:
                    assert isinstance(s, telemetry.NullSpan)
            with telemetry.suppressed():  # nests
                pass
            with telemetry.trace_region("r") as s:
                assert isinstance(s, telemetry.NullSpan)
            assert telemetry.current_context_ints() == (0, 0, 0, 0)
            carrier: dict[str, str] = {}
            telemetry.inject(carrier)
            assert carrier == {}
            # Other threads are not suppressed.
            t = threading.Thread(
                target=lambda: seen_elsewhere.append(telemetry.is_enabled(G.LAYER))
            )
            t.start()
            t.join()
        assert telemetry.is_enabled(G.LAYER)
        with telemetry.span(G.LAYER, S.LAYER_MLP):
            pass
    telemetry.shutdown()
    assert seen_elsewhere == [True]
    assert sorted(s["name"] for s in read_trace_file(tmp_path)) == [S.LAYER_MLP, S.STARTUP]


def test_the_setup_handle_shuts_telemetry_down_at_the_end_of_its_block(make_settings, tmp_path):
    with pytest.raises(ValueError, match="boom"):
        with telemetry.setup(make_settings(), rank=0, world_size=1, run_dir=tmp_path):
            outer = telemetry.span(G.JOB, S.TRAIN)
            outer.__enter__()  # still open when the job ends: truncated
            raise ValueError("boom")
    assert not telemetry.is_enabled(G.JOB)
    spans = read_trace_file(tmp_path)
    assert [s["name"] for s in spans] == [S.TRAIN]
    assert spans[0]["attributes"][Attr.TRUNCATED] is True
