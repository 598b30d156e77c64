"""What mlaunch's instrumentation costs the trainer, and what the trainer costs against plain PyTorch.

Runs one small GPT config as separate processes, alternating telemetry off / ``default`` /
``per_step`` / ``all`` (file exporter, every rank exporting) for several rounds, plus a plain
PyTorch loop of the same model and batch with no mlaunch code. Prints the median step-time ratio of
each spec against off, and the trainer's tokens/s against the plain loop.

Goals: default <= 1.001, per_step <= 1.005, all <= 1.05; ``default`` exported with ``all`` in the
flight recorder (``default+rec``) <= 1.01; trainer / plain tokens/s >= 0.95.
Both wall time and process CPU time per step are reported; on a shared, loaded machine the CPU
time is the trustworthy one (the verdicts use it), on a dedicated machine both agree. A third
measure takes everything the run costs: the user + system CPU time of the whole process tree
(``getrusage(RUSAGE_CHILDREN)`` around each run: the trainer with every thread, the export
thread's encoding and writing, start-up, telemetry set-up and the flush at shutdown). It is shown
twice: per iteration of the run as it is (start-up included, so it depends on ``--iters``), and
per iteration at the margin, ``(tree CPU of the run - tree CPU of a SHORT-iteration run of the
same spec) / (iters - SHORT)``, which removes start-up and every fixed cost and keeps what each
iteration costs, the export thread's share included (the verdicts of that table use it).

Last, an estimate that process-to-process noise does not move: each kind of span's CPU cost,
measured alone in a process of its own (exported coarse and fine spans, a span only the flight
recorder keeps, the per-step calls with and without the recorder), times how many of each one
iteration of the config makes, over the CPU ms of a step with telemetry off; for every spec run,
``default+rec`` included.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The config: big enough that one step (tens of ms on one CPU thread) dwarfs timer noise, small
# enough that 13 processes finish in a few minutes.
LAYERS, HIDDEN, HEADS, SEQ, MICRO, GLOBAL = 4, 128, 4, 128, 4, 16
WARMUP = 5  # steps dropped from every run (allocator, first-iteration spans, caches)
SPECS = ["off", "default", "per_step", "all"]
#: A second telemetry-off process per round: its ratio to "off" is the process-to-process noise
#: floor, printed beside the goals so a reader can tell a real cost from a lucky process.
CONTROL = "off (again)"
#: ``default`` exported plus ``all`` kept by the flight recorder: its cost is the
#: recording on the training thread and the ring's sealing, never an export.
RECORDED = "default+rec"
GOALS = {"default": 1.001, "per_step": 1.005, "all": 1.05, RECORDED: 1.01}


def trainer_args(iters: int) -> list[str]:
    return [
        "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
        "--seq-length", str(SEQ), "--micro-batch-size", str(MICRO), "--global-batch-size", str(GLOBAL),
        "--train-iters", str(iters), "--log-interval", str(iters), "--eval-iters", "0",
    ]  # fmt: skip


def base_env(run_dir: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_"))
    }
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MLAUNCH_RUN_DIR=str(run_dir))
    return env


Sample = tuple[float, float]  # (wall ms, process CPU ms) of one step


def tree_cpu_s() -> float:
    """User + system CPU seconds of every waited-for child process tree so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


SHORT = WARMUP + 1  # iterations of the short run the marginal tree CPU subtracts


def run_trainer(spec: str, iters: int, workdir: Path, tag: str) -> tuple[list[Sample], float]:
    """One trainer process (single rank, no torchrun): its per-step times from progress.jsonl,
    and the whole process tree's CPU seconds (start-up and shutdown in)."""
    run_dir = workdir / tag
    env = base_env(run_dir)
    if not spec.startswith("off"):
        env.update(
            MEGATRON_OTEL_ENABLED="1",
            MEGATRON_OTEL_SPAN_GROUPS="default" if spec == RECORDED else spec,
            MEGATRON_OTEL_EXPORTER="file",
            MEGATRON_OTEL_EXPORT_STRATEGY="all_ranks",
        )
        if spec == RECORDED:
            env["MEGATRON_OTEL_RECORDER_GROUPS"] = "all"
    cpu0 = tree_cpu_s()
    subprocess.run(
        [sys.executable, "-m", "mlaunch.trainer", *trainer_args(iters)],
        env=env,
        cwd=workdir,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    tree_s = tree_cpu_s() - cpu0
    lines = (run_dir / "progress.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [(r["step_ms"], r["cpu_ms"]) for r in records][WARMUP:], tree_s


def run_plain(iters: int, workdir: Path) -> list[Sample]:
    out = subprocess.run(
        [sys.executable, __file__, "--plain-worker", "--iters", str(iters)],
        env=base_env(workdir / "plain"),
        cwd=workdir,
        check=True,
        capture_output=True,
        text=True,
    )
    return [tuple(x) for x in json.loads(out.stdout.strip().splitlines()[-1])][WARMUP:]


def plain_worker(iters: int) -> None:
    """The same GPT, batch, optimizer and step structure in plain PyTorch; prints step times."""
    import math

    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
            self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
            self.fc, self.out = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(256, HIDDEN), nn.Embedding(SEQ, HIDDEN)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.norm = nn.LayerNorm(HIDDEN)

        def forward(self, idx, targets):
            h = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for blk in self.blocks:
                h = blk(h)
            logits = F.linear(self.norm(h), self.tok.weight)
            return F.cross_entropy(logits.float().view(-1, 256), targets.reshape(-1))

    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    n_micro = GLOBAL // MICRO
    times = []
    for _ in range(iters):
        t0, cpu0 = time.perf_counter(), time.process_time()
        starts = torch.randint(0, len(data) - SEQ - 1, (GLOBAL,))
        sample = data[starts[:, None] + torch.arange(SEQ + 1)].long()
        opt.zero_grad(set_to_none=False)
        for x, y in zip(sample[:, :-1].split(MICRO), sample[:, 1:].split(MICRO), strict=True):
            (model(x, y) / n_micro).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if math.isfinite(norm.item()):  # .item(): the same host sync the trainer makes
            opt.step()
        times.append(((time.perf_counter() - t0) * 1e3, (time.process_time() - cpu0) * 1e3))
    print(json.dumps(times))


COST_N = 20000  # spans per cost measurement


#: The cost worker's kinds: through the exporter (``all`` exported) and through the flight
#: recorder alone (``default`` exported, ``all`` recorded, as :data:`RECORDED` runs).
EXPORTED_KINDS = ("coarse", "fine", "step")
RECORDED_KINDS = ("recorded", "step-rec")


def cost_worker(kind: str, n: int) -> None:
    """Process CPU time of ``n`` spans of one kind (coarse: SDK span; fine: the record path;
    step: set_iteration + record_step; recorded: a fine span only the flight recorder keeps;
    step-rec: the per-step calls with the recorder on, its block seal and slow check included)
    through the real runtime and file exporter, flush included. Prints milliseconds."""
    from mlaunch import telemetry
    from mlaunch.model.groups import SpanGroup
    from mlaunch.model.spans import Attr, SpanName
    from mlaunch.settings import load_telemetry_settings

    env = {
        "MEGATRON_OTEL_ENABLED": "1",
        "MEGATRON_OTEL_SPAN_GROUPS": "all",
        "MEGATRON_OTEL_EXPORTER": "file",
        "MEGATRON_OTEL_RUN_ID": "bench",
    }
    if kind in RECORDED_KINDS:
        env.update(MEGATRON_OTEL_SPAN_GROUPS="default", MEGATRON_OTEL_RECORDER_GROUPS="all")
    settings = load_telemetry_settings(environ=env)
    attrs = {Attr.ITERATION: 1}  # as the trainer passes them
    with telemetry.setup(settings, rank=0, world_size=1, run_dir=os.getcwd()):
        c0 = time.process_time()
        with telemetry.span(SpanGroup.JOB, SpanName.TRAIN):
            if kind == "coarse":
                for _ in range(n):
                    with telemetry.span(SpanGroup.STEP, SpanName.ITERATION, attrs):
                        pass
            elif kind in ("fine", "recorded"):
                for _ in range(n):
                    with telemetry.span(SpanGroup.LAYER, SpanName.LAYER_FORWARD, attrs):
                        pass
            elif kind in ("step", "step-rec"):
                for i in range(n):
                    telemetry.set_iteration(i + 1)
                    if kind == "step-rec":
                        telemetry.recorder_step(1.0)  # as the trainer's step does
                    telemetry.record_step(
                        i + 1,
                        step_ms=1.0,
                        loss=1.0,
                        grad_norm=1.0,
                        learning_rate=1.0,
                        tokens_per_sec=1.0,
                        tflops=1.0,
                        skipped=False,
                    )
    print(json.dumps((time.process_time() - c0) * 1e3))


def spans_per_step(spec: str) -> tuple[int, int]:
    """(coarse, fine) spans one iteration of this config emits, from the catalogue."""
    from mlaunch.model.groups import FINE_GRAINED_GROUPS
    from mlaunch.model.spans import CATALOGUE, Repeat, SpanName, Stages
    from mlaunch.model.spec import resolve

    groups = resolve(spec)
    micro = GLOBAL // MICRO
    per = {Repeat.ITERATION: 1, Repeat.MICROBATCH: micro, Repeat.LAYER: micro * LAYERS}
    coarse = fine = 0
    for d in CATALOGUE:
        if d.group not in groups or d.repeat not in per or d.stages is not Stages.ALL:
            continue  # one stage: no P2P spans
        if (
            d.name in (SpanName.GRAD_SYNC_START, SpanName.GRAD_SYNC_FINISH)
            or d.group == "activation_offload"
        ):
            continue  # one process, no offload
        if d.group in FINE_GRAINED_GROUPS:
            fine += per[d.repeat]
        else:
            coarse += per[d.repeat]
    return coarse, fine


def measure_costs(workdir: Path) -> dict[str, float]:
    """Milliseconds of CPU per span and per step's calls, of each of the cost worker's kinds."""

    def run(kind: str, n: int) -> float:
        d = workdir / f"cost-{kind}-{n}"
        d.mkdir()
        out = subprocess.run(
            [sys.executable, __file__, "--cost-worker", kind, "--iters", str(n)],
            env=base_env(d),
            cwd=d,
            check=True,
            capture_output=True,
            text=True,
        )
        return float(out.stdout.strip().splitlines()[-1])

    return {
        kind: (run(kind, COST_N) - run(kind, 0)) / COST_N
        for kind in (*EXPORTED_KINDS, *RECORDED_KINDS)
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds over all specs")
    p.add_argument("--iters", type=int, default=30, help="iterations per run")
    p.add_argument(
        "--specs",
        default=",".join(SPECS),
        help="the exported specs to run, comma separated (off is always run; the recorder "
        "configuration and the A/A control too)",
    )
    p.add_argument("--plain-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cost-worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.plain_worker:
        plain_worker(a.iters)
        return
    if a.cost_worker:
        cost_worker(a.cost_worker, a.iters)
        return
    specs = ["off", *(x for x in a.specs.split(",") if x.strip() and x != "off")]
    runs = [*specs, RECORDED, CONTROL]
    samples: dict[str, list[Sample]] = {s: [] for s in [*runs, "plain"]}
    trees: dict[str, list[float]] = {s: [] for s in runs}  # ms per iteration, start-up in
    margins: dict[str, list[float]] = {s: [] for s in runs}  # ms per iteration at the margin
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mlaunch-bench-") as tmp:
        workdir = Path(tmp)
        for r in range(a.rounds):
            order = runs if r % 2 == 0 else list(reversed(runs))  # alternate to spread drift
            for i, spec in enumerate(order):
                steps, tree_s = run_trainer(spec, a.iters, workdir, f"run{i}-{r}")
                _, short_s = run_trainer(spec, SHORT, workdir, f"short{i}-{r}")
                samples[spec] += steps
                trees[spec].append(tree_s / a.iters * 1e3)
                margins[spec].append((tree_s - short_s) / (a.iters - SHORT) * 1e3)
            samples["plain"] += run_plain(a.iters, workdir)
        costs = measure_costs(workdir)
    wall = {k: statistics.median(w for w, _ in v) for k, v in samples.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in samples.items()}
    try:
        load = f"{os.getloadavg()[0]:.1f}"
    except OSError:
        load = "?"
    print(
        f"config: {LAYERS} layers, hidden {HIDDEN}, seq {SEQ}, global batch {GLOBAL} "
        f"({GLOBAL // MICRO} microbatches of {MICRO}), 1 process, OMP_NUM_THREADS=1, "
        f"{a.rounds} rounds x {a.iters} iterations (first {WARMUP} dropped), exporter=file, "
        f"{os.cpu_count()} CPUs, load average {load}"
    )
    print(
        "CPU ms = process CPU time per step (all threads, export included): steady on a shared "
        "machine; wall ms is what a dedicated machine would show."
    )
    print(
        f"{'spec':<10} {'wall ms':>9} {'wall ratio':>11} {'CPU ms':>9} {'CPU ratio':>10} {'goal':>9}"
    )
    for spec in runs:
        goal = f"<= {GOALS[spec]}" if spec in GOALS else ""
        verdict = (
            ""
            if spec not in GOALS
            else ("ok" if cpu[spec] / cpu["off"] <= GOALS[spec] else "MISSED")
        )
        print(
            f"{spec:<11} {wall[spec]:>9.2f} {wall[spec] / wall['off']:>11.4f} {cpu[spec]:>9.2f} "
            f"{cpu[spec] / cpu['off']:>10.4f} {goal:>9} {verdict}"
        )
    for title, table in (
        ("per iteration of the run, start-up included", trees),
        (f"per iteration at the margin (run - {SHORT}-iteration run)", margins),
    ):
        tree = {k: statistics.median(v) for k, v in table.items()}
        print(
            f"whole process tree CPU (user + system, getrusage RUSAGE_CHILDREN), {title}; "
            "median of the rounds:"
        )
        for spec in runs:
            ratio = tree[spec] / tree["off"]
            if spec == "off":
                goal, verdict = "(baseline)", ""
            elif spec == CONTROL:
                goal, verdict = "(A/A control: the noise floor)", ""
            else:
                goal = f"<= {GOALS[spec]}"
                verdict = "ok" if ratio <= GOALS[spec] else "MISSED"
            print(f"  {spec:<11} {tree[spec]:>9.2f} ms  ratio {ratio:.4f} {goal} {verdict}")
    print(
        f"cost per span (CPU, export and flush included): coarse {costs['coarse'] * 1e3:.1f} us, "
        f"fine {costs['fine'] * 1e3:.1f} us; set_iteration + record_step {costs['step'] * 1e3:.1f} us;"
        f" with the recorder: a recorded span {costs['recorded'] * 1e3:.2f} us, the step's calls "
        f"{costs['step-rec'] * 1e3:.1f} us"
    )
    print(
        "estimated ratio = 1 + (spans per step x cost per span + per-step calls) / CPU ms of off "
        "(resolves what process-to-process noise hides):"
    )
    for spec in [*specs[1:], RECORDED]:
        # default+rec: default's spans exported; every other span of "all" kept by the recorder.
        rec = spec == RECORDED
        coarse, fine = spans_per_step("default" if rec else spec)
        recorded = sum(spans_per_step("all")) - coarse - fine if rec else 0
        extra = (
            coarse * costs["coarse"] + fine * costs["fine"] + recorded * costs["recorded"]
            + costs["step-rec" if rec else "step"]
        )  # fmt: skip
        est = 1 + extra / cpu["off"]
        kept = f" exported + {recorded:>3} recorded" if rec else ""
        print(
            f"  {spec:<9} {coarse:>3} coarse + {fine:>3} fine{kept} spans/step -> {est:.4f} "
            f"(goal <= {GOALS[spec]}) {'ok' if est <= GOALS[spec] else 'MISSED'}"
        )
    tokens = GLOBAL * SEQ
    for label, t in (("wall", wall), ("CPU", cpu)):
        ratio = t["plain"] / t["off"]
        print(
            f"tokens/s ({label}): trainer off {tokens / t['off'] * 1e3:.0f}, plain PyTorch "
            f"{tokens / t['plain'] * 1e3:.0f}, trainer/plain {ratio:.4f} (goal >= 0.95) "
            f"{'ok' if ratio >= 0.95 else 'MISSED'}"
        )
    print(f"wall time {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
