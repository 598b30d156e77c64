"""A worker that behaves as a Megatron-LM worker does at the telemetry boundary.

Runs under the nemo-lens interpreter (see ``nemo_lens.py``), never under mlaunch's: it imports
nothing from mlaunch. What it does, in Megatron-LM's order:

1. Parses its arguments strictly, like Megatron's ``parse_args`` (an unknown argument exits 2):
   Megatron's three ``--otel-*`` flags and the model/training flags mlaunch hands a Megatron-LM
   entry point.
2. Configures telemetry as ``megatron/training/global_vars.py:_set_telemetry`` does:
   ``NemoLensConfig.from_env("MEGATRON_OTEL", "NEMO_LENS", span_group_cls=...)``, service name
   ``megatron-lm`` unless ``OTEL_SERVICE_NAME`` is set, the flags override, Megatron's resource
   attributes, ``setup_telemetry(config, rank, world_size, resource_attributes)``. Whatever
   nemo-lens raises stops the worker, as it stops Megatron-LM.
3. Emits Megatron-LM's code span tree through ``nemo.lens.helpers.managed_span``: a
   ``megatron.startup`` trace (backdated from ``LENS_LAUNCH_SCRIPT_START_TIME`` /
   ``LENS_LAUNCH_SCRIPT_PRESRUN_TIME`` and ``SLURM_JOB_START_TIME`` as ``pretrain_hybrid.py``
   and ``training.py`` do: ``pre_startup``, ``megatron.startup.launch_script``,
   ``.container_load``, ``.imports``), then one ``megatron.train`` trace per ``--save-interval``
   iterations (one block without saves), each linked to the previous block (the first to
   startup).

It writes ``lens-worker-rank{R}.json`` (and ``lens-worker-rank{R}-attempt{A}.json``) into
``$MLAUNCH_RUN_DIR`` (else the working directory): what nemo-lens resolved (``enabled``,
``exporting``, ``span_groups``, ``exporter``, ``export_strategy``, ``export_rank``,
``export_sample_rate``, ``sampler_enabled``, ``sampler``, ``service_name``, ``run_id``,
``resource``, ``protocol``, ``endpoint``), ``traceparent`` (the ``TRACEPARENT`` it was started
with), ``attempt`` (``TORCHELASTIC_RESTART_COUNT``), ``nemo_lens`` and ``python`` (the versions it
runs under), ``launch_stamps`` (what it read of the start-up stamps), ``error`` (what setup raised,
if it did) and, at the end, ``emitted`` (spans ended on this rank's SDK provider, i.e. handed to
the exporter) and ``finished``.

Metrics: Megatron-LM's eight ``megatron.training.*`` instruments (names, kinds, units as
``megatron/training/training_metrics.py`` creates them), recorded every ``--log-interval``
iterations: the loss ``10/i``, the learning rate ``1e-3/i`` and the grad norm ``1 + 1/i`` of
iteration ``i``, tokens/s from the step's time.

Test controls (environment):

- ``LENS_WORKER_ITER_SECONDS``: sleep inside each iteration's forward/backward (default 0.005).
- ``LENS_WORKER_BURST``: emit this many extra spans (``lens_worker.burst``, under the first
  iteration) as fast as possible; raise ``OTEL_BSP_MAX_QUEUE_SIZE`` to keep the SDK from dropping.
- ``LENS_WORKER_KILL_AT`` / ``LENS_WORKER_KILL_RANK`` (default 0): that rank SIGKILLs itself at
  the start of that iteration, in the first attempt only (so a torchrun restart then finishes),
  once every rank's report of the attempt holds its resource (a peer still in set-up would be
  torn down without one).
- ``LENS_WORKER_FAIL_AT``: every rank raises ``RuntimeError`` at that iteration.
- ``LENS_WORKER_STOP_FILE``: iterate past ``--train-iters`` until that file exists, then
  ``LENS_WORKER_AFTER_STOP`` (default 3) more iterations, so a test decides when the loop ends
  whatever the machine's load; the report then carries ``iteration`` (the last one started).
- ``LENS_WORKER_SEED_RANDOM=1``: seed Python's ``random`` with ``--seed`` after set-up, as
  Megatron-LM's ``_set_random_seed`` does alike on every data-parallel rank. Under nemo-lens
  0.1.0 the SDK's ids come from ``random``, so the ranks' span and trace ids are then identical
  (Lens #28); 0.2.0's id generator does not depend on the seed.
- ``LENS_WORKER_HANG_AT`` / ``LENS_WORKER_HANG_RANK`` (default 0): that rank sleeps for an hour
  inside that iteration's ``megatron.train.iteration`` span, in the first attempt only (a hang);
  its report then carries ``hung`` (the iteration).

SIGTERM is handled as Megatron-LM's ``training.py`` does when telemetry exports: the open
``megatron.train`` block and start-up are ended, telemetry is shut down (under nemo-lens 0.2.0
that ends every span still open, marked ``nemo.span.truncated``), then the default action.
"""

from __future__ import annotations

import time

# As Megatron-LM's entry points do, first thing, before any other import: the program's start.
_PROGRAM_START_TIME = time.time()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402

import nemo.lens  # noqa: E402
from nemo.lens import NemoLensConfig, setup_telemetry  # noqa: E402
from nemo.lens.groups import SpanGroup  # noqa: E402
from nemo.lens.helpers import managed_span  # noqa: E402
from nemo.lens.state import is_span_group_enabled  # noqa: E402


class MegatronLikeSpanGroup(SpanGroup):
    """The groups and presets of Megatron-LM's ``MegatronSpanGroup`` (written out here)."""

    MICROBATCH = "microbatch"
    LAYER = "layer"
    COMMUNICATION = "communication"
    ACTIVATION_OFFLOAD = "activation_offload"
    DATA_LOADING = "data_loading"
    FIRST_ITERATION = "first_iteration"
    TRACE_REGION = "trace_region"
    INFERENCE = "inference"

    ALL_GROUPS = SpanGroup.ALL_GROUPS | frozenset(
        {
            MICROBATCH,
            LAYER,
            COMMUNICATION,
            ACTIVATION_OFFLOAD,
            DATA_LOADING,
            FIRST_ITERATION,
            TRACE_REGION,
            INFERENCE,
        }
    )
    _DEFAULT = frozenset({"job", "checkpoint", "evaluate", FIRST_ITERATION, INFERENCE})
    _PER_STEP = _DEFAULT | frozenset(
        {
            "model_init",
            "load_checkpoint",
            "step",
            "forward_backward",
            "optimizer",
            COMMUNICATION,
            DATA_LOADING,
        }
    )
    _PRESETS = {
        "default": _DEFAULT,
        "per_step": _PER_STEP,
        "profiling": ALL_GROUPS,
        "all": ALL_GROUPS,
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Megatron-LM's spelling of what mlaunch passes; anything else is an argparse error."""
    p = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False)
    p.add_argument("--otel-enabled", action="store_true")
    p.add_argument("--otel-service-name", default=None)
    p.add_argument("--otel-span-groups", default=None)
    for name, typ, default in (
        ("--num-layers", int, 2),
        ("--hidden-size", int, 64),
        ("--num-attention-heads", int, 4),
        ("--seq-length", int, 64),
        ("--max-position-embeddings", int, None),
        ("--micro-batch-size", int, 1),
        ("--global-batch-size", int, None),
        ("--train-iters", int, 10),
        ("--lr", float, 1e-4),
        ("--min-lr", float, 0.0),
        ("--lr-warmup-iters", int, 0),
        ("--weight-decay", float, 0.01),
        ("--clip-grad", float, 1.0),
        ("--eval-interval", int, 1000),
        ("--eval-iters", int, 10),
        ("--log-interval", int, 100),
        ("--save", str, None),
        ("--load", str, None),
        ("--save-interval", int, None),
        ("--seed", int, 1234),
        ("--tensor-model-parallel-size", int, 1),
        ("--pipeline-model-parallel-size", int, 1),
        ("--context-parallel-size", int, 1),
        ("--ckpt-format", str, "torch_dist"),
    ):
        p.add_argument(name, type=typ, default=default)
    p.add_argument("--data-path", nargs="*", default=None)
    p.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fp16", action="store_true")
    return p.parse_args(argv)


def resource_attributes(args: argparse.Namespace, local_rank: int, world_size: int) -> dict:
    """Megatron-LM's resource attributes (``build_telemetry_resource_attrs``), CPU edition."""
    tp, pp, cp = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
    )
    attrs = {
        "dl.local_rank": local_rank,
        "dl.tensor_parallel.size": tp,
        "dl.pipeline_parallel.size": pp,
        "dl.data_parallel.size": max(1, world_size // (tp * pp * cp)),
        "dl.batch_size": args.global_batch_size or args.micro_batch_size,
        "dl.sequence_length": args.seq_length,
        "megatron.num_layers": args.num_layers,
        "megatron.hidden_size": args.hidden_size,
        "megatron.num_attention_heads": args.num_attention_heads,
        "megatron.train_iters": args.train_iters,
        "megatron.micro_batch_size": args.micro_batch_size,
        "megatron.ckpt_format": args.ckpt_format,
        "megatron.precision": "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32",
    }
    for attr, var in (  # MEGATRON.md section 4, written out as Megatron-LM does (not mlaunch's)
        ("slurm.job.id", "SLURM_JOB_ID"),
        ("slurm.sluid", "LENS_SLURM_SLUID"),
        ("slurm.cluster", "SLURM_CLUSTER_NAME"),
        ("slurm.array.job_id", "SLURM_ARRAY_JOB_ID"),
        ("slurm.array.task_id", "SLURM_ARRAY_TASK_ID"),
        ("slurm.array.sluid", "LENS_SLURM_ARRAY_SLUID"),
        ("slurm.restart_count", "SLURM_RESTART_COUNT"),
        ("nvrx.cycle", "NVRX_CYCLE"),
        ("nvrx.infra_rank", "NVRX_INFRA_RANK"),
        ("nvrx.membership", "NVRX_MEMBERSHIP"),
    ):
        if os.environ.get(var):
            attrs[attr] = os.environ[var]
    cluster = os.environ.get("SLURM_CLUSTER_NAME", "nocluster")
    is_array = "SLURM_ARRAY_TASK_ID" in os.environ
    job = (
        os.environ.get("SLURM_ARRAY_JOB_ID") if is_array else os.environ.get("SLURM_JOB_ID")
    ) or "nojob"
    parts = [cluster, job] + (
        [] if is_array else ["sr" + os.environ.get("SLURM_RESTART_COUNT", "0")]
    )
    te = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if te is not None:
        parts.append("te" + te)
        attrs["slurm.torchelastic.restart_count"] = te
    attrs["nemo.lens.job_uuid"] = str(
        uuid.uuid5(uuid.NAMESPACE_URL, f"nemo.lens.job/{cluster}/{job}")
    )
    attrs["nemo.lens.run_uuid"] = str(
        uuid.uuid5(uuid.NAMESPACE_URL, "nemo.lens.run/" + "/".join(parts))
    )
    return attrs


class Report:
    """The worker's account of itself, rewritten as it goes (so a crash leaves what was known)."""

    def __init__(self, rank: int, attempt: str) -> None:
        out = Path(os.environ.get("MLAUNCH_RUN_DIR") or os.getcwd())
        out.mkdir(parents=True, exist_ok=True)
        self.paths = [
            out / f"lens-worker-rank{rank}.json",
            out / f"lens-worker-rank{rank}-attempt{attempt}.json",
        ]
        self.data: dict = {
            "rank": rank,
            "attempt": attempt,
            "traceparent": os.environ.get("TRACEPARENT"),
            "nemo_lens": nemo.lens.__version__,
            "python": "{}.{}".format(*sys.version_info[:2]),
            "finished": False,
        }

    def update(self, **values) -> None:
        self.data.update(values)
        text = json.dumps(self.data, indent=1, sort_keys=True, default=str)
        for path in self.paths:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)


def _counting_processor():
    """Counts spans as the SDK hands them to the exporter (recording spans that ended)."""
    from opentelemetry.sdk.trace import SpanProcessor

    class Counter(SpanProcessor):
        ended = 0

        def on_end(self, span) -> None:
            Counter.ended += 1

    return Counter


def setup(args: argparse.Namespace, rank: int, world_size: int, local_rank: int, report: Report):
    """``_set_telemetry``, step by step, recording what nemo-lens resolved."""
    config = NemoLensConfig.from_env(
        prefix="MEGATRON_OTEL", fallback_prefix="NEMO_LENS", span_group_cls=MegatronLikeSpanGroup
    )
    if not os.environ.get("OTEL_SERVICE_NAME", "").strip():
        config.service_name = "megatron-lm"
    if args.otel_enabled:
        config.enabled = True
    if args.otel_service_name:
        config.service_name = args.otel_service_name
    if args.otel_span_groups:
        config.span_groups = args.otel_span_groups
    resource = resource_attributes(args, local_rank, world_size) if config.enabled else {}
    report.update(
        enabled=config.enabled,
        exporter=config.exporter,
        export_strategy=config.export_strategy,
        export_rank=config.export_rank,
        export_sample_rate=config.export_sample_rate,
        sampler_enabled=config.sampler_enabled,
        service_name=config.service_name,
        span_spec=config.span_groups,
        protocol=os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL"),
        endpoint=os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
    )
    handle = setup_telemetry(config, rank=rank, world_size=world_size, resource_attributes=resource)
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    counter = None
    sampler = None
    if hasattr(provider, "add_span_processor"):
        counter = _counting_processor()
        provider.add_span_processor(counter())
        sampler = provider.sampler.get_description()
    groups = sorted(g for g in MegatronLikeSpanGroup.ALL_GROUPS if is_span_group_enabled(g))
    report.update(
        exporting=handle.is_exporting,
        span_groups=groups,
        run_id=config.run_id,
        sampler=sampler,
        resource=dict(provider.resource.attributes) if hasattr(provider, "resource") else {},
    )
    return handle, counter


def _wait_for_every_setup(report: Report, world_size: int, limit_s: float = 120.0) -> None:
    """Before the kill: until every rank's report of this attempt holds its resource (at most
    ``limit_s``). torchrun tears the whole group down when one worker dies, and on a loaded
    machine a peer can still be importing nemo-lens then: tests read every rank's resource."""
    out = report.paths[1].parent
    attempt = report.data["attempt"]
    deadline = time.monotonic() + limit_s
    for r in range(world_size):
        path = out / f"lens-worker-rank{r}-attempt{attempt}.json"
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                if "resource" in json.loads(path.read_text()):
                    break
            time.sleep(0.05)


def _env_float(name: str) -> float | None:
    """pretrain_hybrid.py's reading of a stamp: stripped, empty or unparsable is None."""
    val = os.environ.get(name, "").strip()
    try:
        return float(val) if val else None
    except ValueError:
        return None


def launch_stamps() -> dict[str, float | None]:
    """The start-up stamps ``pretrain_hybrid.py`` hands ``set_startup_timestamps`` (no NVRx)."""
    return {
        "launch_script_start": _env_float("LENS_LAUNCH_SCRIPT_START_TIME"),
        "launch_script_presrun": _env_float("LENS_LAUNCH_SCRIPT_PRESRUN_TIME"),
        "slurm_job_start_time": _env_float("SLURM_JOB_START_TIME"),
        "program_start": _PROGRAM_START_TIME,
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    report = Report(rank, attempt)
    try:
        handle, counter = setup(args, rank, world_size, local_rank, report)
    except Exception as exc:  # as in Megatron-LM: nothing catches it, the worker dies
        report.update(error=f"{type(exc).__name__}: {exc}")
        raise
    if os.environ.get("LENS_WORKER_SEED_RANDOM") == "1":
        random.seed(args.seed)  # the same --seed on every data-parallel rank, as Megatron-LM's

    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace import Link

    tracer = handle.tracer
    job_on = is_span_group_enabled("job")
    iter_seconds = float(os.environ.get("LENS_WORKER_ITER_SECONDS", "0.005"))
    burst = int(os.environ.get("LENS_WORKER_BURST", "0"))
    kill_at = int(os.environ.get("LENS_WORKER_KILL_AT", "0"))
    kill_rank = int(os.environ.get("LENS_WORKER_KILL_RANK", "0"))
    fail_at = int(os.environ.get("LENS_WORKER_FAIL_AT", "0"))
    hang_at = int(os.environ.get("LENS_WORKER_HANG_AT", "0"))
    hang_rank = int(os.environ.get("LENS_WORKER_HANG_RANK", "0"))
    microbatches = max(
        1, (args.global_batch_size or args.micro_batch_size) // args.micro_batch_size
    )
    microbatches = max(1, microbatches // max(1, world_size))

    # --- megatron.startup: the root of this incarnation's own trace ---------------------------
    # Megatron-LM's training.py:_start_otel_job_spans with pretrain_hybrid.py's stamps: a
    # backdated pre_startup (SLURM's job start -> the launch script's start, a trace of its own),
    # and, when START <= PRESRUN <= the program's start, the start-up anchored at START with
    # launch_script and container_load children; else the start-up starts at the program's start.
    stamps = launch_stamps()
    report.update(launch_stamps=stamps)
    launch_start, presrun = stamps["launch_script_start"], stamps["launch_script_presrun"]
    slurm_start = stamps["slurm_job_start_time"]

    def backdated(name: str, start: float | None, end: float | None) -> None:
        if not job_on or start is None or end is None:
            return
        span = tracer.start_span(name, start_time=int(start * 1e9))
        span.set_attribute("is_goodput_span", True)
        span.end(end_time=int(end * 1e9))

    startup = startup_ctx = token = None
    if job_on:
        if launch_start is not None and slurm_start is not None and slurm_start < launch_start:
            backdated("pre_startup", slurm_start, launch_start)
        fold = (
            launch_start is not None
            and presrun is not None
            and launch_start <= presrun <= _PROGRAM_START_TIME
        )
        startup = tracer.start_span(
            "megatron.startup",
            context=otel_context.Context(),
            start_time=int((launch_start if fold else _PROGRAM_START_TIME) * 1e9),
        )
        startup.set_attribute("is_goodput_span", True)
        startup.set_attribute("megatron.model_type", "GPT")
        startup_ctx = startup.get_span_context()
        token = otel_context.attach(trace.set_span_in_context(startup))
        if fold:
            backdated("megatron.startup.launch_script", launch_start, presrun)
            backdated("megatron.startup.container_load", presrun, _PROGRAM_START_TIME)
        backdated("megatron.startup.imports", _PROGRAM_START_TIME, _MAIN_ENTRY_TIME)
    with managed_span("model_init", "megatron.startup.model_init", tracer, is_goodput_span=True):
        time.sleep(iter_seconds)
    with managed_span("data_loading", "megatron.startup.dataloader", tracer, is_goodput_span=True):
        time.sleep(iter_seconds)
    start_iter = 0
    if args.load and Path(args.load).is_dir():
        load = managed_span(
            "load_checkpoint", "megatron.checkpoint.load", tracer, is_goodput_span=True
        )
        io_read = managed_span(
            "load_checkpoint", "megatron.checkpoint.load.io_read", tracer, is_goodput_span=True
        )
        with load, io_read:
            time.sleep(iter_seconds)
    if startup is not None:
        otel_context.detach(token)
        startup.end()
        startup = None  # ended (training.py's _end_otel_startup_span: None once closed)

    # --- the loop: one megatron.train trace per save interval ----------------------------------
    block = block_token = None
    save_interval = args.save_interval or 0

    def reroot() -> None:
        nonlocal block, block_token
        if not job_on:
            return
        links = (
            [Link(block.get_span_context())]
            if block is not None
            else ([Link(startup_ctx)] if startup_ctx is not None else [])
        )
        end_block()
        block = tracer.start_span("megatron.train", context=otel_context.Context(), links=links)
        block.set_attribute("is_goodput_span", True)
        block_token = otel_context.attach(trace.set_span_in_context(block))

    def end_block() -> None:
        nonlocal block, block_token
        if block is not None:
            otel_context.detach(block_token)
            block.end()
            block, block_token = None, None

    def end_job_spans() -> None:
        """training.py:_end_otel_job_spans: end the current block and the start-up (innermost
        first), then shut telemetry down (nemo-lens 0.2.0 ends what is still open, marked
        ``nemo.span.truncated``; 0.1.0 drops it). Every exit path runs it; shutdown once."""
        nonlocal startup, token
        end_block()
        if startup is not None:
            otel_context.detach(token)
            startup.end()
            startup = None
        if not shut_down:
            shut_down.append(True)
            handle.shutdown()

    shut_down: list[bool] = []
    if handle.is_exporting:
        # training.py's hard-terminate SIGTERM handler (installed only when telemetry exports):
        # end and export the tree now, then the default action.
        def on_sigterm(signum, frame) -> None:
            with contextlib.suppress(Exception):
                end_job_spans()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, on_sigterm)

    # Megatron-LM's eight instruments as megatron/training/training_metrics.py creates them: only
    # the step duration has a unit.
    meter = handle.meter
    step_hist = meter.create_histogram("megatron.training.step_duration_ms", unit="ms")
    gauges = {
        key: meter.create_gauge(f"megatron.training.{key}")
        for key in ("loss", "throughput_tflops", "grad_norm", "learning_rate", "tokens_per_sec",
                    "memory_allocated_gb")
    }  # fmt: skip
    # skipped_iters: Megatron adds to it only when an iteration was skipped (none here).
    meter.create_counter("megatron.training.skipped_iters")
    tokens_per_iter = (args.global_batch_size or args.micro_batch_size) * args.seq_length
    first = True
    stop_file = os.environ.get("LENS_WORKER_STOP_FILE")
    after_stop = int(os.environ.get("LENS_WORKER_AFTER_STOP", "3"))

    def iterations():
        if not stop_file:
            yield from range(start_iter + 1, args.train_iters + 1)
            return
        left = None
        for iteration in itertools.count(start_iter + 1):
            if left is None and iteration > args.train_iters and Path(stop_file).exists():
                left = after_stop
            if left is not None:
                if left == 0:
                    return
                left -= 1
            report.update(iteration=iteration)
            yield iteration

    for step, iteration in enumerate(iterations()):
        if (save_interval > 0 and step % save_interval == 0) or (save_interval <= 0 and step == 0):
            reroot()
        if kill_at == iteration and rank == kill_rank and attempt == "0":
            _wait_for_every_setup(report, world_size)
            os.kill(os.getpid(), signal.SIGKILL)
        if fail_at == iteration:
            raise RuntimeError(f"lens worker: injected failure at iteration {iteration}")
        t0 = time.perf_counter()
        first_cm = (
            managed_span("first_iteration", "megatron.train.first_iteration", tracer,
                         is_goodput_span=True, **{"megatron.iteration": iteration})
            if first else contextlib.nullcontext()
        )  # fmt: skip
        with first_cm, managed_span(
            "step", "megatron.train.iteration", tracer, is_goodput_span=True,
            **{"megatron.iteration": iteration},
        ) as step_span:  # fmt: skip
            if hang_at == iteration and rank == hang_rank and attempt == "0":
                report.update(hung=iteration)
                time.sleep(3600)  # the hang: a rank stuck inside its iteration
            if first and burst:
                for _ in range(burst):
                    tracer.start_span("lens_worker.burst").end()
            with managed_span(
                "forward_backward", "megatron.train.iteration.forward_backward", tracer,
                is_goodput_span=True, num_microbatches=microbatches,
            ):  # fmt: skip
                for _ in range(microbatches):
                    with managed_span("microbatch", "megatron.microbatch.forward", tracer):
                        for layer in range(1, args.num_layers + 1):
                            with managed_span("layer", "megatron.layer.forward", tracer,
                                              **{"megatron.layer_number": layer}):  # fmt: skip
                                with managed_span("layer", "megatron.layer.self_attention", tracer):
                                    pass
                                with managed_span("layer", "megatron.layer.mlp", tracer):
                                    pass
                    with managed_span("microbatch", "megatron.microbatch.backward", tracer):
                        time.sleep(iter_seconds)
            if world_size > 1:
                with managed_span("communication", "megatron.grad_sync.start", tracer):
                    pass
                with managed_span("communication", "megatron.grad_sync.finish", tracer):
                    pass
            with managed_span(
                "optimizer", "megatron.train.iteration.optimizer", tracer, is_goodput_span=True
            ) as opt:
                if opt is not None:
                    opt.set_attribute("megatron.update_successful", True)
            if step_span is not None:
                step_span.set_attribute("megatron.skipped", False)
        first = False
        elapsed_ms = (time.perf_counter() - t0) * 1000
        step_hist.record(elapsed_ms)
        if iteration % max(1, args.log_interval) == 0:
            # Known values a test can find again: the loss 10/i, the learning rate 1e-3/i and
            # the grad norm 1 + 1/i of iteration i.
            gauges["loss"].set(10.0 / iteration)
            gauges["learning_rate"].set(1e-3 / iteration)
            gauges["grad_norm"].set(1.0 + 1.0 / iteration)
            gauges["tokens_per_sec"].set(tokens_per_iter / max(elapsed_ms / 1e3, 1e-9))
            gauges["throughput_tflops"].set(1.0)
            gauges["memory_allocated_gb"].set(1.5)
        if args.save and save_interval > 0 and iteration % save_interval == 0:
            with managed_span("checkpoint", "megatron.checkpoint.save", tracer,
                              is_goodput_span=True, **{"megatron.iteration": iteration}):  # fmt: skip
                with managed_span(
                    "checkpoint",
                    "megatron.checkpoint.save.state_dict",
                    tracer,
                    is_goodput_span=True,
                ):
                    pass
                with managed_span(
                    "checkpoint", "megatron.checkpoint.save.io_write", tracer, is_goodput_span=True
                ):
                    time.sleep(iter_seconds)
        if args.eval_interval and iteration % args.eval_interval == 0 and args.eval_iters > 0:
            with managed_span(
                "evaluate", "megatron.evaluate", tracer, **{"megatron.eval_iters": args.eval_iters}
            ):
                for k in range(1, args.eval_iters + 1):
                    with managed_span(
                        "evaluate",
                        "megatron.evaluate.step",
                        tracer,
                        **{"megatron.eval_iteration": k},
                    ):
                        pass
    end_job_spans()
    report.update(emitted=counter.ended if counter is not None else 0, finished=True)
    return 0


if __name__ == "__main__":
    _MAIN_ENTRY_TIME = time.time()  # pretrain_hybrid.py: right after entering __main__
    sys.exit(main(sys.argv[1:]))
