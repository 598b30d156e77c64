"""Synthetic OTLP/JSON trace files with known answers, for the ``mlaunch trace`` tests and the
``benchmarks/trace_read.py`` benchmark.

Two levels:

* :class:`TraceBuilder` — place spans by hand (times in milliseconds from a fixed origin), so a
  test can compute the expected summary/goodput numbers on paper.
* :func:`write_realistic_run` — a bulk generator of the trainer's span tree (steps with
  forward/backward, microbatches, layers, P2P with links, checkpoints, evaluation) for volume.

A builder made with ``legacy=True`` writes the documented names older mlaunch traces carry
(``megatron.train_step``, ...; ``mlaunch.span.truncated``) for the same calls, so one test can
compare a trace in the code names with the same timings in the old names.

Output is exactly the OTLP/JSON line format the file exporter, the spool and an OpenTelemetry
collector's file exporter write: one ``ExportTraceServiceRequest`` per line, lowerCamelCase keys,
ids as lowercase hex, 64-bit integers as decimal strings.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlaunch.model.spans import ALIASES, Attr, ResourceAttr, SpanName
from mlaunch.rundir import layout as lay

#: Code name -> the documented name an older mlaunch trace carries instead.
LEGACY_NAMES: dict[str, str] = {code: doc for doc, code in ALIASES.items()}

#: The origin of synthetic time (2023-11-14T22:13:20Z), in Unix nanoseconds.
T0_NS = 1_700_000_000_000_000_000
_MS = 1_000_000


def ms(t: float) -> int:
    """Milliseconds after :data:`T0_NS` as absolute Unix nanoseconds."""
    return T0_NS + round(t * _MS)


def encode_value(value: Any) -> dict[str, Any]:
    """A Python value as an OTLP/JSON ``AnyValue`` (ints as decimal strings, as protobuf JSON does)."""
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, bytes):
        import base64

        return {"bytesValue": base64.b64encode(value).decode()}
    if isinstance(value, Mapping):
        return {"kvlistValue": {"values": encode_attributes(value)}}
    if isinstance(value, list | tuple):
        return {"arrayValue": {"values": [encode_value(v) for v in value]}}
    return {"stringValue": str(value)}


def encode_attributes(attrs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A mapping as an OTLP/JSON ``KeyValue`` list."""
    return [{"key": k, "value": encode_value(v)} for k, v in attrs.items()]


def resource_attributes(
    rank: int,
    *,
    world_size: int = 2,
    run_id: str = "synthrun0001",
    host: str | None = None,
    pp: int = 1,
    tp: int = 1,
    num_layers: int = 4,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The resource attributes of one rank (a representative subset)."""
    dp = max(1, world_size // (pp * tp))
    attrs: dict[str, Any] = {
        ResourceAttr.SERVICE_NAME: "megatron-lm",
        ResourceAttr.SERVICE_VERSION: "0.1.0",
        ResourceAttr.SERVICE_INSTANCE_ID: f"{run_id}-rank{rank}",
        ResourceAttr.RUN_ID: run_id,
        ResourceAttr.RANK: rank,
        ResourceAttr.WORLD_SIZE: world_size,
        ResourceAttr.LOCAL_RANK: rank % 8,
        ResourceAttr.TP_SIZE: tp,
        ResourceAttr.PP_SIZE: pp,
        ResourceAttr.DP_SIZE: dp,
        ResourceAttr.PP_RANK: (rank // tp) % pp,
        ResourceAttr.NUM_LAYERS: num_layers,
        ResourceAttr.HIDDEN_SIZE: 256,
        ResourceAttr.NUM_ATTENTION_HEADS: 8,
        ResourceAttr.PRECISION: "bf16",
        ResourceAttr.HOST_NAME: host or f"node{rank // 8}",
        ResourceAttr.PROCESS_PID: 1000 + rank,
    }
    if extra:
        attrs.update(extra)
    return {str(k): v for k, v in attrs.items()}


def request_line(resource: Mapping[str, Any], spans: Sequence[Mapping[str, Any]]) -> str:
    """One OTLP/JSON ``ExportTraceServiceRequest`` line holding ``spans`` under one resource."""
    req = {
        "resourceSpans": [
            {
                "resource": {"attributes": encode_attributes(resource)},
                "scopeSpans": [{"scope": {"name": "mlaunch"}, "spans": list(spans)}],
            }
        ]
    }
    return json.dumps(req, separators=(",", ":"))


@dataclass
class SpanRef:
    """What a test needs to refer back to a span it placed (to parent or link others)."""

    trace_id: str
    span_id: str
    rank: int


@dataclass
class TraceBuilder:
    """Hand-placed spans for tests: ``b.span(0, SpanName.ITERATION, 100, 200)`` etc.; rank
    ``LAUNCHER`` holds the launcher's job trace (written to ``traces-launcher-node0.jsonl``)."""

    world_size: int = 2
    run_id: str = "synthrun0001"
    trace_id: str = "0af7651916cd43dd8448eb211c80319c"
    spans: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    resources: dict[int, dict[str, Any]] = field(default_factory=dict)
    legacy: bool = False
    _next_id: int = 1

    LAUNCHER = -1

    def resource(self, rank: int) -> dict[str, Any]:
        """The resource of ``rank`` (created on first use with :func:`resource_attributes`)."""
        if rank == self.LAUNCHER:
            return self.resources.setdefault(
                rank, {ResourceAttr.SERVICE_NAME: "mlaunch", ResourceAttr.RUN_ID: self.run_id}
            )
        if rank not in self.resources:
            self.resources[rank] = resource_attributes(
                rank, world_size=self.world_size, run_id=self.run_id
            )
        return self.resources[rank]

    def span(
        self,
        rank: int,
        name: str,
        start_ms: float,
        end_ms: float,
        *,
        parent: SpanRef | None = None,
        attrs: Mapping[str, Any] | None = None,
        error: str | None = None,
        truncated: bool = False,
        events: Iterable[tuple[float, str, Mapping[str, Any]]] = (),
        links: Iterable[SpanRef] = (),
        thread: int | None = None,
    ) -> SpanRef:
        """Add one span on ``rank`` lasting [start_ms, end_ms] and return its reference."""
        self.resource(rank)
        span_id = f"{self._next_id:016x}"
        self._next_id += 1
        a = dict(attrs or {})
        if self.legacy:
            name = LEGACY_NAMES.get(str(name), str(name))
        if truncated:
            a[Attr.LEGACY_TRUNCATED if self.legacy else Attr.TRUNCATED] = True
        if thread is not None:
            a["thread.id"] = thread
        span: dict[str, Any] = {
            "traceId": self.trace_id,
            "spanId": span_id,
            "parentSpanId": parent.span_id if parent else "",
            "name": str(name),
            "kind": 1,
            "startTimeUnixNano": str(ms(start_ms)),
            "endTimeUnixNano": str(ms(end_ms)),
            "attributes": encode_attributes({str(k): v for k, v in a.items()}),
            "status": {"code": 2, "message": error} if error else {},
        }
        evs = [
            {"timeUnixNano": str(ms(t)), "name": n, "attributes": encode_attributes(ea)}
            for t, n, ea in events
        ]
        if evs:
            span["events"] = evs
        lks = [{"traceId": r.trace_id, "spanId": r.span_id, "attributes": []} for r in links]
        if lks:
            span["links"] = lks
        self.spans.setdefault(rank, []).append(span)
        return SpanRef(self.trace_id, span_id, rank)

    def lines(self, rank: int, batch: int = 3) -> list[str]:
        """The OTLP/JSON lines of one rank, ``batch`` spans per line, children before parents
        (the order a batch span processor exports them: a span is exported when it ends)."""
        ordered = sorted(self.spans.get(rank, []), key=lambda s: int(s["endTimeUnixNano"]))
        res = self.resource(rank)
        return [request_line(res, ordered[i : i + batch]) for i in range(0, len(ordered), batch)]

    def write_run_dir(self, run_dir: Path, *, batch: int = 3) -> Path:
        """Write ``telemetry/traces-rank{R}.jsonl`` for every rank with spans; return run_dir."""
        tel = Path(run_dir) / "telemetry"
        tel.mkdir(parents=True, exist_ok=True)
        for rank in sorted(self.spans):
            path = (
                lay.launcher_traces_file(run_dir, 0)
                if rank == self.LAUNCHER
                else tel / f"traces-rank{rank}.jsonl"
            )
            path.write_text("".join(line + "\n" for line in self.lines(rank, batch)))
        return Path(run_dir)


# --------------------------------------------------------------------------------------------
# Bulk generation (benchmarks, volume tests)


def _ids(rng: random.Random) -> str:
    return f"{rng.getrandbits(64):016x}"


def _realistic_rank_spans(
    rank: int,
    *,
    steps: int,
    microbatches: int,
    layers: int,
    pp: int,
    rng: random.Random,
    ckpt_every: int,
    eval_every: int,
) -> Iterable[dict[str, Any]]:
    """Spans of one rank in end-time order (children first), following the trainer's span tree."""
    stage = rank % pp
    t = ms(0)
    trace_id = f"{rng.getrandbits(128):032x}"
    root_id, train_id = _ids(rng), _ids(rng)

    def mk(
        name: str, start: int, end: int, parent: str, attrs: Mapping[str, Any]
    ) -> dict[str, Any]:
        return {
            "traceId": trace_id,
            "spanId": _ids(rng),
            "parentSpanId": parent,
            "name": str(name),
            "kind": 1,
            "startTimeUnixNano": str(start),
            "endTimeUnixNano": str(end),
            "attributes": encode_attributes(
                {str(k): v for k, v in attrs.items()} | {"is_goodput_span": True}
            ),
            "status": {},
        }

    startup_start = t
    for name, dur in ((SpanName.MODEL_INIT, 900), (SpanName.DATALOADER, 200)):
        yield mk(name, t, t + dur * _MS, root_id, {})
        t += dur * _MS
    s = mk(SpanName.STARTUP, startup_start, t, "", {Attr.MODEL_TYPE: "gpt"})
    s["spanId"] = root_id
    yield s
    startup_trace = trace_id
    trace_id = f"{rng.getrandbits(128):032x}"  # the megatron.train block: a trace of its own
    train_start = t
    for it in range(1, steps + 1):
        step_id = _ids(rng)
        step_start = t
        t += rng.randint(1, 3) * _MS // 10
        fb_id = _ids(rng)
        fb_start = t
        for mb in range(microbatches):
            fwd_id = _ids(rng)
            fwd_start = t
            if stage > 0:
                yield mk(SpanName.P2P_RECV_FORWARD, t, t + 50_000, fb_id, {})
                t += 50_000
            for layer in range(layers):
                lid = _ids(rng)
                ls = t
                yield mk(SpanName.LAYER_SELF_ATTENTION, t, t + 120_000, lid, {})
                t += 120_000
                yield mk(SpanName.LAYER_MLP, t, t + 80_000, lid, {})
                t += 80_000
                s = mk(SpanName.LAYER_FORWARD, ls, t, fwd_id, {Attr.LAYER_NUMBER: layer + 1})
                s["spanId"] = lid
                yield s
            if stage < pp - 1:
                yield mk(SpanName.P2P_SEND_FORWARD, t, t + 40_000, fb_id, {})
                t += 40_000
            s = mk(SpanName.MICROBATCH_FORWARD, fwd_start, t, fb_id, {Attr.MICROBATCH_ID: mb})
            s["spanId"] = fwd_id
            yield s
            bs = t
            t += layers * 400_000 + rng.randint(0, 50_000)
            yield mk(SpanName.MICROBATCH_BACKWARD, bs, t, fb_id, {Attr.MICROBATCH_ID: mb})
        s = mk(
            SpanName.FORWARD_BACKWARD, fb_start, t, step_id, {Attr.NUM_MICROBATCHES: microbatches}
        )
        s["spanId"] = fb_id
        yield s
        yield mk(SpanName.GRAD_SYNC_START, t, t + 100_000, step_id, {})
        t += 100_000
        yield mk(SpanName.GRAD_SYNC_FINISH, t, t + 300_000, step_id, {})
        t += 300_000
        yield mk(
            SpanName.OPTIMIZER, t, t + 500_000, step_id,
            {Attr.GRAD_NORM: 1.0, Attr.UPDATE_SUCCESSFUL: True},
        )  # fmt: skip
        t += 500_000
        s = mk(
            SpanName.ITERATION, step_start, t, train_id,
            {Attr.ITERATION: it, Attr.LOSS: 3.0 - it * 1e-4, Attr.GRAD_NORM: 1.0, Attr.SKIPPED: False},
        )  # fmt: skip
        s["spanId"] = step_id
        yield s
        if ckpt_every and it % ckpt_every == 0:
            cid, cs = _ids(rng), t
            yield mk(SpanName.CHECKPOINT_SAVE_STATE_DICT, t, t + 5 * _MS, cid, {})
            t += 5 * _MS
            yield mk(SpanName.CHECKPOINT_SAVE_IO_WRITE, t, t + 20 * _MS, cid, {})
            t += 20 * _MS
            s = mk(SpanName.CHECKPOINT_SAVE, cs, t, train_id, {Attr.ITERATION: it})
            s["spanId"] = cid
            yield s
        if eval_every and it % eval_every == 0:
            eid, es = _ids(rng), t
            for e in range(2):
                yield mk(SpanName.EVALUATE_STEP, t, t + 3 * _MS, eid, {Attr.EVAL_ITERATION: e})
                t += 3 * _MS
            s = mk(SpanName.EVALUATE, es, t, train_id, {Attr.EVAL_ITERS: 2})
            s["spanId"] = eid
            yield s
    s = mk(SpanName.TRAIN, train_start, t, "", {Attr.TRAIN_BLOCK: 0})
    s["spanId"] = train_id
    s["links"] = [{"traceId": startup_trace, "spanId": root_id, "attributes": []}]
    yield s


def spans_per_step(microbatches: int, layers: int) -> int:
    """Spans a realistic step emits on a middle pipeline stage (for sizing a benchmark)."""
    per_mb = 1 + 1 + 3 * layers + 1  # fwd, bwd, layers x 3, one P2P (send or recv) with pp > 1
    return per_mb * microbatches + 1 + 3 + 1  # fwd_bwd, grad_sync x2, optimizer, step


def write_realistic_run(
    run_dir: Path,
    *,
    ranks: int = 4,
    steps: int = 100,
    microbatches: int = 4,
    layers: int = 4,
    pp: int = 2,
    batch: int = 512,
    seed: int = 0,
    ckpt_every: int = 50,
    eval_every: int = 25,
    seeded_alike: bool = False,
) -> int:
    """Write a run directory of ``ranks`` trace files; return the number of spans written.
    ``seeded_alike``: every rank draws its ids from a generator seeded with ``seed`` (nemo-lens
    0.1.0 on data-parallel ranks that seeded ``random`` alike): with ``pp=1`` the ranks' trace
    and span ids are identical."""
    rng = random.Random(seed)
    tel = Path(run_dir) / "telemetry"
    tel.mkdir(parents=True, exist_ok=True)
    total = 0
    for rank in range(ranks):
        if seeded_alike:
            rng = random.Random(seed)
        res = resource_attributes(rank, world_size=ranks, pp=pp, num_layers=layers * pp)
        buf: list[dict[str, Any]] = []
        with open(tel / f"traces-rank{rank}.jsonl", "w") as f:
            for span in _realistic_rank_spans(
                rank, steps=steps, microbatches=microbatches, layers=layers, pp=pp, rng=rng,
                ckpt_every=ckpt_every, eval_every=eval_every,
            ):  # fmt: skip
                buf.append(span)
                if len(buf) >= batch:
                    f.write(request_line(res, buf) + "\n")
                    total += len(buf)
                    buf = []
            if buf:
                f.write(request_line(res, buf) + "\n")
                total += len(buf)
    return total


# --------------------------------------------------------------------------------------------
# The hand-computed example the trace tests share


def hand_example(
    *, legacy: bool = False, job: tuple[float, float] | None = None
) -> tuple[TraceBuilder, dict[str, SpanRef]]:
    """A two-rank run small enough to check on paper (times in ms; answers in the tests).

    rank 0 (the full span tree): startup 0-250 with model_init 0-100, dataloader 100-150,
    checkpoint.load 150-250 (io_read 160-240); train 250-1000; train.first_iteration 250-400
    wrapping train.iteration #1 260-390; #2 400-500, #3 500-600; checkpoint.save 600-700
    (state_dict 600-620, io_write 620-690, ERROR); #4 700-800; evaluate 800-900 (evaluate.step
    800-850, 850-900, with an event at 820).

    rank 1 (steps only, no startup, no first_iteration): train.iteration 0-120, 120-240,
    240-370, 370-570 (the last one truncated).

    ``legacy``: the same timings in an older mlaunch trace's shape: documented names, a
    ``megatron.pretrain`` umbrella 0-1000 over start-up and train, ``mlaunch.span.truncated``.
    ``job``: the launcher's ``mlaunch.job`` span over (start, end), with one attempt inside.
    """
    b = TraceBuilder(world_size=2, legacy=legacy)
    r: dict[str, SpanRef] = {}
    S = SpanName
    if legacy:
        r["pretrain"] = pre = b.span(
            0, "megatron.pretrain", 0, 1000, attrs={"megatron.train_iters": 4}
        )
        startup = train_parent = pre
    else:
        startup = b.span(0, S.STARTUP, 0, 250, attrs={Attr.MODEL_TYPE: "gpt"})
        train_parent = None
    r["startup"] = startup
    b.span(0, S.MODEL_INIT, 0, 100, parent=startup)
    b.span(0, S.DATALOADER, 100, 150, parent=startup)
    load = b.span(0, S.CHECKPOINT_LOAD, 150, 250, parent=startup, attrs={Attr.ITERATION: 0})
    b.span(0, S.CHECKPOINT_LOAD_IO_READ, 160, 240, parent=load)
    train = b.span(0, S.TRAIN, 250, 1000, parent=train_parent,
                   links=[] if legacy else [startup])  # fmt: skip
    first = b.span(0, S.FIRST_ITERATION, 250, 400, parent=train, attrs={Attr.ITERATION: 1})
    b.span(0, S.ITERATION, 260, 390, parent=first, attrs={Attr.ITERATION: 1, Attr.LOSS: 4.0})
    r["step2"] = b.span(0, S.ITERATION, 400, 500, parent=train, attrs={Attr.ITERATION: 2})
    b.span(0, S.ITERATION, 500, 600, parent=train, attrs={Attr.ITERATION: 3})
    save = b.span(0, S.CHECKPOINT_SAVE, 600, 700, parent=train, attrs={Attr.ITERATION: 3})
    b.span(0, S.CHECKPOINT_SAVE_STATE_DICT, 600, 620, parent=save)
    b.span(0, S.CHECKPOINT_SAVE_IO_WRITE, 620, 690, parent=save, error="disk full")
    b.span(0, S.ITERATION, 700, 800, parent=train, attrs={Attr.ITERATION: 4})
    ev = b.span(0, S.EVALUATE, 800, 900, parent=train, attrs={Attr.EVAL_ITERS: 2})
    r["eval_step"] = b.span(
        0, S.EVALUATE_STEP, 800, 850, parent=ev, attrs={Attr.EVAL_ITERATION: 0},
        events=[(820, "exception", {"exception.type": "ValueError"})],
    )  # fmt: skip
    b.span(0, S.EVALUATE_STEP, 850, 900, parent=ev, attrs={Attr.EVAL_ITERATION: 1})
    for i, (s, e) in enumerate(((0, 120), (120, 240), (240, 370), (370, 570)), start=1):
        b.span(1, S.ITERATION, s, e, attrs={Attr.ITERATION: i}, truncated=i == 4)
    if job is not None:
        r["job"] = j = b.span(b.LAUNCHER, S.JOB, *job)
        b.span(b.LAUNCHER, S.JOB_ATTEMPT, job[0] + 1, job[1] - 1, parent=j,
               attrs={Attr.ATTEMPT: 0, Attr.EXIT_CODE: 0})  # fmt: skip
    return b, r


# --------------------------------------------------------------------------------------------
# Checking Chrome trace-event output

_EPS_US = 1e-6  # ts/dur are written in µs with 3 decimals


def check_chrome_trace(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Assert the trace-event format rules that Perfetto / chrome://tracing rely on; return the
    complete (X) events."""
    assert isinstance(doc["traceEvents"], list)
    xs: list[dict[str, Any]] = []
    by_thread: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for ev in doc["traceEvents"]:
        assert {"name", "ph", "pid", "tid"} <= set(ev), ev
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int)
        if ev["ph"] == "M":
            assert ev["name"] in {"process_name", "process_sort_index", "thread_name",
                                  "thread_sort_index"}  # fmt: skip
            assert "args" in ev
            continue
        assert isinstance(ev["ts"], int | float) and ev["ts"] >= 0
        if ev["ph"] == "X":
            assert isinstance(ev["dur"], int | float) and ev["dur"] >= 0
            assert isinstance(ev["args"], dict)
            xs.append(ev)
            by_thread.setdefault((ev["pid"], ev["tid"]), []).append(ev)
        elif ev["ph"] == "i":
            assert ev["s"] in {"t", "p", "g"}
        elif ev["ph"] in {"s", "f"}:
            assert "id" in ev
        else:
            raise AssertionError(f"unexpected phase {ev['ph']}")
    for events in by_thread.values():  # proper nesting: inside the open slice or after it
        stack: list[float] = []
        for ev in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            end = ev["ts"] + ev["dur"]
            while stack and stack[-1] <= ev["ts"] + _EPS_US:
                stack.pop()
            assert not stack or end <= stack[-1] + _EPS_US, f"{ev} overlaps its thread's open slice"
            stack.append(end)
    return xs
