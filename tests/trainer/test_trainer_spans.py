"""The span contract (SPEC section 4) on a PP=2 x DP=2 job (4 processes), per span-group spec:
the exact multiset of span names per rank, each span's parent, its attributes, the cross-stage
links, and one trace id per iteration across ranks. Expected counts come from the catalogue and
the run's configuration. Also: telemetry off writes nothing and trains identically."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from support.trainer_runs import TINY, Run, run_trainer, telemetry_env

from mlaunch.model.groups import SpanGroup
from mlaunch.model.spans import (
    CATALOGUE,
    Attr,
    Repeat,
    ResourceAttr,
    SpanName,
    Stages,
    effective_parent,
    region_name,
    span_def,
    text_completion_name,
)
from mlaunch.model.spec import resolve
from mlaunch.telemetry.otlp_json import read_spans

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

PP, DP, WORLD = 2, 2, 4
ITERS, EVAL_ITERS, SAMPLE = 3, 2, 3
MICRO = 8 // (2 * DP)  # global 8, micro 2 (TINY)
LAYERS_PER_STAGE = 2 // PP
SAVES = 2  # --save-interval 2 over 3 iterations: at 2, and the final save at 3
EVALS = 1  # --eval-interval 3
MODEL_NAME = "mlaunch-gpt-2l-32h"
ARGS = [
    *TINY, "--train-iters", str(ITERS), "--pipeline-model-parallel-size", str(PP),
    "--eval-interval", "3", "--eval-iters", str(EVAL_ITERS), "--sample-tokens", str(SAMPLE),
    "--save-interval", "2", "--offload-activations",
    "--untie-embeddings",  # the tied layout across stages is covered by test_trainer_training.py
]  # fmt: skip

# trace_region markers the trainer places (data setup on every rank; checkpoint phases by role).
DATA_REGIONS = ("data.read_corpus", "data.split")
RANK0_SAVE_REGIONS = ("checkpoint.prepare", "checkpoint.commit")
WRITER_SAVE_REGIONS = ("checkpoint.serialize", "checkpoint.write")


def _emitted_on(stages: Stages, stage: int) -> bool:
    return {
        Stages.ALL: True, Stages.NOT_FIRST: stage > 0, Stages.NOT_LAST: stage < PP - 1,
    }[stages]  # fmt: skip


#: One spec re-roots megatron.train every SEGMENT iterations (SPEC section 4: bounded traces).
SEGMENTED_SPEC, SEGMENT = "per_step", 2


def train_segments(spec: str) -> int:
    """How many megatron.train spans a rank emits: one per trace segment the run touches."""
    if spec != SEGMENTED_SPEC:
        return 1
    return len({it // SEGMENT for it in range(1, ITERS + 1)})


def expected_counts(groups: frozenset[SpanGroup], rank: int, segments: int = 1) -> Counter:
    """Span name -> count for one rank of this job, derived from the catalogue."""
    stage, dp_rank = divmod(rank, DP)
    per_repeat = {
        Repeat.ONCE: 1, Repeat.ITERATION: ITERS, Repeat.MICROBATCH: ITERS * MICRO,
        Repeat.LAYER: ITERS * MICRO * LAYERS_PER_STAGE, Repeat.SAVE: SAVES, Repeat.EVAL: EVALS,
        Repeat.EVAL_STEP: EVALS * EVAL_ITERS, Repeat.REQUEST: EVALS, Repeat.REGION: 0,
    }  # fmt: skip
    out: Counter = Counter()
    for d in CATALOGUE:
        if d.group not in groups or not _emitted_on(d.stages, stage):
            continue
        if d.name in (SpanName.LOAD_CHECKPOINT, SpanName.LOAD_CHECKPOINT_IO_READ):
            continue  # no --load in this job
        name = text_completion_name(MODEL_NAME) if d.repeat is Repeat.REQUEST else d.name
        out[name] += segments if d.name == SpanName.TRAIN else per_repeat[d.repeat]
    if SpanGroup.TRACE_REGION in groups:
        regions = list(DATA_REGIONS)
        if rank == 0:
            regions += list(RANK0_SAVE_REGIONS) * SAVES
        if dp_rank == 0:
            regions += list(WRITER_SAVE_REGIONS) * SAVES
        out.update(region_name(r) for r in regions)
    return +out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("spans")


@pytest.fixture(scope="module")
def off_run(workdir) -> Run:
    run = run_trainer(workdir, [*ARGS, "--save", "ck-off"], nproc=WORLD, name="off")
    assert run.returncode == 0, run.output[-3000:]
    return run


SPECS = ["default", "per_step", "all", "default,microbatch"]


@pytest.fixture(scope="module", params=SPECS)
def traced(request, workdir) -> tuple[str, Run, dict[int, list[dict]]]:
    spec = request.param
    env = telemetry_env(spec)
    if spec == SEGMENTED_SPEC:
        env["MEGATRON_OTEL_TRACE_SEGMENT_ITERS"] = str(SEGMENT)
    # One save directory per run: a directory that holds a checkpoint is resumed from (--load
    # defaults to --save), and every run here starts from scratch.
    name = spec.replace(",", "+")
    run = run_trainer(workdir, [*ARGS, "--save", f"ck-{name}"], nproc=WORLD, env=env, name=name)
    assert run.returncode == 0, run.output[-3000:]
    spans = {
        r: read_spans(run.run_dir / "telemetry" / f"traces-rank{r}.jsonl") for r in range(WORLD)
    }
    return spec, run, spans


def test_span_names_per_rank_are_exactly_the_catalogue_for_the_spec(traced):
    spec, _, spans = traced
    groups = resolve(spec)
    for rank, rank_spans in spans.items():
        got = Counter(s["name"] for s in rank_spans)
        assert got == expected_counts(groups, rank, train_segments(spec)), (
            f"rank {rank}, spec {spec!r}"
        )


def test_every_span_has_its_contract_parent(traced):
    spec, _, spans = traced
    groups = resolve(spec)
    for rank, rank_spans in spans.items():
        by_id = {s["span_id"]: s for s in rank_spans}
        first_iter = [s for s in rank_spans if s["name"] == SpanName.FIRST_ITERATION]
        for s in rank_spans:
            parent = by_id.get(s["parent_span_id"])
            parent_name = parent["name"] if parent else None
            d = span_def(s["name"])
            if d.name == SpanName.REGION:
                want = (
                    (SpanName.DATA_SETUP if SpanGroup.DATA_LOADING in groups else SpanName.PRETRAIN)
                    if s["name"].startswith(region_name("data"))
                    else SpanName.SAVE_CHECKPOINT_IO_WRITE
                )
            elif d.name == SpanName.TRAIN and Attr.TRACE_SEGMENT in s["attributes"]:
                # A re-rooted segment starts a new trace, linked to the previous segment.
                want = None
                assert [ln["span_id"] for ln in s["links"]] and s["links"][0]["span_id"] in by_id
            else:
                want = effective_parent(d.name, groups)
                # megatron.first_iteration wraps the first iteration: what would hang under
                # megatron.train during that iteration hangs under it instead.
                if want == SpanName.TRAIN and first_iter and d.name != SpanName.FIRST_ITERATION:
                    fi = first_iter[0]
                    if fi["start_ns"] <= s["start_ns"] and s["end_ns"] <= fi["end_ns"]:
                        want = SpanName.FIRST_ITERATION
            assert parent_name == want, f"rank {rank} {spec!r}: {s['name']} under {parent_name}"
            assert s["status_code"] != 2, s


def test_every_listed_attribute_is_set_with_its_value(traced):
    spec, _, spans = traced
    for rank, rank_spans in spans.items():
        stage, dp_rank = divmod(rank, DP)
        for s in rank_spans:
            d = span_def(s["name"])
            attrs = s["attributes"]
            assert set(d.attributes) <= set(attrs), (
                f"{s['name']} lacks {set(d.attributes) - set(attrs)}"
            )
            assert attrs.get(Attr.IS_GOODPUT) is (True if d.is_goodput else None)
            res = s["resource"]
            assert (res[ResourceAttr.PP_RANK], res[ResourceAttr.DP_RANK]) == (stage, dp_rank)
            assert res[ResourceAttr.BATCH_SIZE] == 8 and res[ResourceAttr.PRECISION] == "fp32"
            assert res[ResourceAttr.NUM_LAYERS] == 2 and res[ResourceAttr.CKPT_FORMAT] == "torch"
        values = {
            name: sorted(s["attributes"][key] for s in rank_spans if s["name"] == name)
            for name, key in [
                (SpanName.TRAIN_STEP, Attr.ITERATION), (SpanName.MICROBATCH_FORWARD, Attr.MICROBATCH_ID),
                (SpanName.LAYER_FORWARD, Attr.LAYER_NUMBER), (SpanName.EVALUATE_STEP, Attr.EVAL_ITERATION),
                (SpanName.SAVE_CHECKPOINT, Attr.ITERATION), (SpanName.FIRST_ITERATION, Attr.ITERATION),
            ]
        }  # fmt: skip
        expect = {
            SpanName.TRAIN_STEP: list(range(1, ITERS + 1)),
            SpanName.MICROBATCH_FORWARD: sorted(list(range(MICRO)) * ITERS),
            SpanName.LAYER_FORWARD: [stage + 1] * (ITERS * MICRO),
            SpanName.EVALUATE_STEP: list(range(1, EVAL_ITERS + 1)),
            SpanName.SAVE_CHECKPOINT: [2, 3],
            SpanName.FIRST_ITERATION: [1],
        }
        for name, got in values.items():
            if got:  # the group is on in this spec
                assert got == expect[name], (rank, name)
        for s in rank_spans:
            if s["name"] == SpanName.OPTIMIZER_STEP:
                assert s["attributes"][Attr.UPDATE_SUCCESSFUL] is True
            if s["name"] == SpanName.FORWARD_BACKWARD:
                assert s["attributes"][Attr.NUM_MICROBATCHES] == MICRO
            if s["name"] == SpanName.PP_RECV_FORWARD_LINKED:
                assert s["attributes"][Attr.PP_RANK] == stage
            if s["name"].startswith(SpanName.TEXT_COMPLETION):
                a = s["attributes"]
                assert (
                    a[Attr.GEN_AI_OUTPUT_TOKENS] == SAMPLE
                    and a[Attr.GEN_AI_REQUEST_MODEL] == MODEL_NAME
                )


def test_linked_spans_point_at_the_senders_send_forward(traced):
    spec, _, spans = traced
    if SpanGroup.COMMUNICATION not in resolve(spec):
        # Group off: no P2P span and no linked span anywhere (the context tensor still travels,
        # but nothing is recorded from it).
        names = {s["name"] for rank_spans in spans.values() for s in rank_spans}
        assert not names & {SpanName.PP_RECV_FORWARD_LINKED, SpanName.P2P_SEND_FORWARD}
        return
    for rank in range(DP, WORLD):  # stage 1
        sender = {
            s["span_id"]: s for s in spans[rank - DP] if s["name"] == SpanName.P2P_SEND_FORWARD
        }
        linked = [s for s in spans[rank] if s["name"] == SpanName.PP_RECV_FORWARD_LINKED]
        assert len(linked) == ITERS * MICRO
        targets = []
        for s in linked:
            assert len(s["links"]) == 1
            link = s["links"][0]
            assert link["span_id"] in sender, "link to a span stage 0 never exported"
            assert link["trace_id"] == sender[link["span_id"]]["trace_id"]
            targets.append(link["span_id"])
        assert sorted(targets) == sorted(sender)  # each send is received (and linked) once


def test_one_trace_id_per_iteration_across_ranks(traced):
    spec, _, spans = traced
    groups = resolve(spec)
    keyed = (
        (SpanName.TRAIN_STEP, Attr.ITERATION)
        if SpanGroup.STEP in groups
        else (SpanName.FIRST_ITERATION, Attr.ITERATION)
    )
    by_iteration: dict[int, set[str]] = {}
    for rank_spans in spans.values():
        for s in rank_spans:
            if s["name"] == keyed[0]:
                by_iteration.setdefault(s["attributes"][keyed[1]], set()).add(s["trace_id"])
    assert by_iteration and all(len(ids) == 1 for ids in by_iteration.values()), by_iteration
    pretrain = {s["trace_id"] for r in spans.values() for s in r if s["name"] == SpanName.PRETRAIN}
    assert len(pretrain) == 1


def test_telemetry_off_writes_nothing_and_trains_identically(traced, off_run):
    _, run, _ = traced
    assert not (off_run.run_dir / "telemetry").exists()
    assert len(off_run.losses()) == ITERS
    assert run.losses() == off_run.losses()
    assert run.eval_losses() == off_run.eval_losses()
