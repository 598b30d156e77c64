"""The span contract (the names Megatron-LM's code emits) on a PP=2 x DP=2 job (4
processes), per span-group spec: the exact multiset of span names per rank, each span's parent,
the roots (``megatron.startup``, one ``megatron.train`` per save interval) and the links between
them, its attributes and ``is_goodput_span`` mark, the cross-stage links, shared trace ids per
block across ranks, and that no documented-only name is emitted. Expected counts come from the
catalogue and the run's configuration. Also: telemetry off writes nothing and trains
identically."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from support.trainer_runs import TINY, Run, run_trainer, telemetry_env

from mlaunch.model.groups import SpanGroup
from mlaunch.model.identity import JOB_UUID, RUN_UUID
from mlaunch.model.spans import (
    ALIASES,
    CATALOGUE,
    Attr,
    LegacyName,
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
from mlaunch.otlp.otlp_json import read_spans

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

PP, DP, WORLD = 2, 2, 4
ITERS, EVAL_ITERS, SAMPLE = 3, 2, 3
MICRO = 8 // (2 * DP)  # global 8, micro 2 (TINY)
LAYERS_PER_STAGE = 2 // PP
SAVES = 2  # --save-interval 2 over 3 iterations: at 2, and the final save at 3
BLOCKS = 2  # megatron.train blocks of save_interval iterations: 1-2 (save at 2), 3 (final save)
EVALS = 1  # --eval-interval 3
#: The launcher's attempt span, as the launcher hands it to the workers.
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
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


def expected_counts(groups: frozenset[SpanGroup], rank: int) -> Counter:
    """Span name -> count for one rank of this job, derived from the catalogue."""
    stage, dp_rank = divmod(rank, DP)
    per_repeat = {
        Repeat.ONCE: 1, Repeat.BLOCK: BLOCKS, Repeat.ITERATION: ITERS, Repeat.MICROBATCH: ITERS * MICRO,
        Repeat.LAYER: ITERS * MICRO * LAYERS_PER_STAGE, Repeat.SAVE: SAVES, Repeat.EVAL: EVALS,
        Repeat.EVAL_STEP: EVALS * EVAL_ITERS, Repeat.REQUEST: EVALS, Repeat.REGION: 0,
    }  # fmt: skip
    out: Counter = Counter()
    for d in CATALOGUE:
        if d.group not in groups or not _emitted_on(d.stages, stage) or d.megatron_only:
            continue
        if d.name in (SpanName.CHECKPOINT_LOAD, SpanName.CHECKPOINT_LOAD_IO_READ):
            continue  # no --load in this job
        name = text_completion_name(MODEL_NAME) if d.repeat is Repeat.REQUEST else d.name
        out[name] += per_repeat[d.repeat]
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


SPECS = ["default", "per_step", "all"]


@pytest.fixture(scope="module", params=SPECS)
def traced(request, workdir) -> tuple[str, Run, dict[int, list[dict]]]:
    spec = request.param
    env = {**telemetry_env(spec), "TRACEPARENT": TRACEPARENT}
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
        assert got == expected_counts(groups, rank), f"rank {rank}, spec {spec!r}"


def test_no_documented_only_name_is_emitted(traced):
    _, _, spans = traced
    names = {s["name"] for rank_spans in spans.values() for s in rank_spans}
    assert not names & (set(ALIASES) | {LegacyName.PRETRAIN}), names


def test_roots_are_startup_and_one_train_block_per_save_interval_linked_in_a_chain(traced):
    spec, _, spans = traced
    for rank, rank_spans in spans.items():
        startup = [s for s in rank_spans if s["name"] == SpanName.STARTUP]
        blocks = sorted(
            (s for s in rank_spans if s["name"] == SpanName.TRAIN),
            key=lambda s: s["attributes"][Attr.TRAIN_BLOCK],
        )
        assert len(startup) == 1 and len(blocks) == BLOCKS, (rank, spec)
        (st,) = startup
        # The startup span links to the launcher's attempt span (TRACEPARENT).
        assert [(ln["trace_id"], ln["span_id"]) for ln in st["links"]] == [
            tuple(TRACEPARENT.split("-")[1:3])
        ]
        assert st["attributes"][Attr.MODEL_TYPE] == "gpt"
        previous = st
        for k, block in enumerate(blocks):
            assert block["attributes"][Attr.TRAIN_BLOCK] == k
            assert block["parent_span_id"] in (None, "")
            # Each block is a trace of its own, linked to the previous block (the first: startup).
            assert block["trace_id"] != previous["trace_id"]
            assert [(ln["trace_id"], ln["span_id"]) for ln in block["links"]] == [
                (previous["trace_id"], previous["span_id"])
            ]
            assert block["end_ns"] <= blocks[k + 1]["start_ns"] if k + 1 < BLOCKS else True
            previous = block
        # No worker span covers the whole run.
        first, last = min(s["start_ns"] for s in rank_spans), max(s["end_ns"] for s in rank_spans)
        assert not [s for s in rank_spans if s["start_ns"] <= first and s["end_ns"] >= last]


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
                    (SpanName.DATALOADER if SpanGroup.DATA_LOADING in groups else SpanName.STARTUP)
                    if s["name"].startswith(region_name("data"))
                    else SpanName.CHECKPOINT_SAVE_IO_WRITE
                )
            else:
                want = effective_parent(d.name, groups)
                # megatron.train.first_iteration wraps the first iteration: what would hang under
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
            assert set(d.all_attributes) <= set(attrs), (
                f"{s['name']} lacks {set(d.all_attributes) - set(attrs)}"
            )
            assert attrs.get(Attr.IS_GOODPUT) is (True if d.is_goodput else None)
            res = s["resource"]
            assert (res[ResourceAttr.PP_RANK], res[ResourceAttr.DP_RANK]) == (stage, dp_rank)
            assert res[ResourceAttr.BATCH_SIZE] == 8 and res[ResourceAttr.PRECISION] == "fp32"
            assert res[ResourceAttr.NUM_LAYERS] == 2 and res[ResourceAttr.CKPT_FORMAT] == "torch"
            # Megatron-LM's run identity, the same on every rank (no communication).
            assert res[JOB_UUID] == spans[0][0]["resource"][JOB_UUID]
            assert res[RUN_UUID] == spans[0][0]["resource"][RUN_UUID]
        values = {
            name: sorted(s["attributes"][key] for s in rank_spans if s["name"] == name)
            for name, key in [
                (SpanName.ITERATION, Attr.ITERATION), (SpanName.MICROBATCH_FORWARD, Attr.MICROBATCH_ID),
                (SpanName.LAYER_FORWARD, Attr.LAYER_NUMBER), (SpanName.EVALUATE_STEP, Attr.EVAL_ITERATION),
                (SpanName.CHECKPOINT_SAVE, Attr.ITERATION), (SpanName.FIRST_ITERATION, Attr.ITERATION),
            ]
        }  # fmt: skip
        expect = {
            SpanName.ITERATION: list(range(1, ITERS + 1)),
            SpanName.MICROBATCH_FORWARD: sorted(list(range(MICRO)) * ITERS),
            SpanName.LAYER_FORWARD: [stage + 1] * (ITERS * MICRO),
            SpanName.EVALUATE_STEP: list(range(1, EVAL_ITERS + 1)),
            SpanName.CHECKPOINT_SAVE: [2, 3],
            SpanName.FIRST_ITERATION: [1],
        }
        for name, got in values.items():
            if got:  # the group is on in this spec
                assert got == expect[name], (rank, name)
        for s in rank_spans:
            if s["name"] == SpanName.OPTIMIZER:
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


def test_every_rank_shares_each_blocks_trace_id(traced):
    _, _, spans = traced
    by_block: dict[int, set[str]] = {}
    startup: set[str] = set()
    for rank_spans in spans.values():
        for s in rank_spans:
            if s["name"] == SpanName.TRAIN:
                by_block.setdefault(s["attributes"][Attr.TRAIN_BLOCK], set()).add(s["trace_id"])
            elif s["name"] == SpanName.STARTUP:
                startup.add(s["trace_id"])
    assert sorted(by_block) == list(range(BLOCKS))
    assert all(len(ids) == 1 for ids in by_block.values()), by_block
    assert len(startup) == 1 and not startup & set().union(*by_block.values())
    # Every span of a block's tree carries the block's trace id on every rank.
    block_of = {next(iter(ids)) for ids in by_block.values()} | startup
    for rank_spans in spans.values():
        for s in rank_spans:
            if not s["name"].startswith(SpanName.TEXT_COMPLETION):
                assert s["trace_id"] in block_of, s["name"]


def test_one_trace_id_per_iteration_across_ranks(traced):
    spec, _, spans = traced
    groups = resolve(spec)
    keyed = (
        (SpanName.ITERATION, Attr.ITERATION)
        if SpanGroup.STEP in groups
        else (SpanName.FIRST_ITERATION, Attr.ITERATION)
    )
    by_iteration: dict[int, set[str]] = {}
    for rank_spans in spans.values():
        for s in rank_spans:
            if s["name"] == keyed[0]:
                by_iteration.setdefault(s["attributes"][keyed[1]], set()).add(s["trace_id"])
    assert by_iteration and all(len(ids) == 1 for ids in by_iteration.values()), by_iteration


def test_telemetry_off_writes_nothing_and_trains_identically(traced, off_run):
    _, run, _ = traced
    assert not (off_run.run_dir / "telemetry").exists()
    assert len(off_run.losses()) == ITERS
    assert run.losses() == off_run.losses()
    assert run.eval_losses() == off_run.eval_losses()
