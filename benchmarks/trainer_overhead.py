"""What mlaunch's instrumentation costs the trainer, and what the trainer costs against plain PyTorch.

Runs one small GPT config as separate processes, alternating telemetry off / ``default`` /
``per_step`` / ``all`` (file exporter, every rank exporting) for several rounds, plus a plain
PyTorch loop of the same model and batch with no mlaunch code. Prints the median step-time ratio of
each spec against off, and the trainer's tokens/s against the plain loop.

Goals: default <= 1.001, per_step <= 1.005, all <= 1.05; trainer / plain tokens/s >= 0.95.
Both wall time and process CPU time per step are reported; on a shared, loaded machine the CPU
time is the trustworthy one (the verdicts use it), on a dedicated machine both agree.

    python benchmarks/trainer_overhead.py [--rounds 3] [--iters 40]
"""

from __future__ import annotations

import argparse
import json
import os
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
GOALS = {"default": 1.001, "per_step": 1.005, "all": 1.05}


def trainer_args(iters: int) -> list[str]:
    return [
        "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
        "--seq-length", str(SEQ), "--micro-batch-size", str(MICRO), "--global-batch-size", str(GLOBAL),
        "--train-iters", str(iters), "--log-interval", str(iters), "--eval-iters", "0",
    ]  # fmt: skip


def base_env(run_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_"))}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MLAUNCH_RUN_DIR=str(run_dir))
    return env


Sample = tuple[float, float]  # (wall ms, process CPU ms) of one step


def run_trainer(spec: str, iters: int, workdir: Path, tag: str) -> list[Sample]:
    """One trainer process (single rank, no torchrun); its per-step times from progress.jsonl."""
    run_dir = workdir / tag
    env = base_env(run_dir)
    if spec != "off":
        env.update(
            MEGATRON_OTEL_ENABLED="1", MEGATRON_OTEL_SPAN_GROUPS=spec,
            MEGATRON_OTEL_EXPORTER="file", MEGATRON_OTEL_EXPORT_STRATEGY="all_ranks",
        )
    subprocess.run(
        [sys.executable, "-m", "mlaunch.trainer", *trainer_args(iters)],
        env=env, cwd=workdir, check=True, stdout=subprocess.DEVNULL,
    )
    lines = (run_dir / "progress.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [(r["step_ms"], r["cpu_ms"]) for r in records][WARMUP:]


def run_plain(iters: int, workdir: Path) -> list[Sample]:
    out = subprocess.run(
        [sys.executable, __file__, "--plain-worker", "--iters", str(iters)],
        env=base_env(workdir / "plain"), cwd=workdir, check=True, capture_output=True, text=True,
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds over all specs")
    p.add_argument("--iters", type=int, default=30, help="iterations per run")
    p.add_argument("--plain-worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.plain_worker:
        plain_worker(a.iters)
        return
    samples: dict[str, list[Sample]] = {s: [] for s in [*SPECS, "plain"]}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mlaunch-bench-") as tmp:
        workdir = Path(tmp)
        for r in range(a.rounds):
            order = SPECS if r % 2 == 0 else list(reversed(SPECS))  # alternate to spread drift
            for spec in order:
                samples[spec] += run_trainer(spec, a.iters, workdir, f"{spec}-{r}")
            samples["plain"] += run_plain(a.iters, workdir)
    wall = {k: statistics.median(w for w, _ in v) for k, v in samples.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in samples.items()}
    try:
        load = f"{os.getloadavg()[0]:.1f}"
    except OSError:
        load = "?"
    print(f"config: {LAYERS} layers, hidden {HIDDEN}, seq {SEQ}, global batch {GLOBAL} "
          f"({GLOBAL // MICRO} microbatches of {MICRO}), 1 process, OMP_NUM_THREADS=1, "
          f"{a.rounds} rounds x {a.iters} iterations (first {WARMUP} dropped), exporter=file, "
          f"{os.cpu_count()} CPUs, load average {load}")
    print("CPU ms = process CPU time per step (all threads, export included): steady on a shared "
          "machine; wall ms is what a dedicated machine would show.")
    print(f"{'spec':<10} {'wall ms':>9} {'wall ratio':>11} {'CPU ms':>9} {'CPU ratio':>10} {'goal':>9}")
    for spec in SPECS:
        goal = f"<= {GOALS[spec]}" if spec in GOALS else ""
        verdict = "" if spec not in GOALS else ("ok" if cpu[spec] / cpu["off"] <= GOALS[spec] else "MISSED")
        print(f"{spec:<10} {wall[spec]:>9.2f} {wall[spec] / wall['off']:>11.4f} {cpu[spec]:>9.2f} "
              f"{cpu[spec] / cpu['off']:>10.4f} {goal:>9} {verdict}")
    tokens = GLOBAL * SEQ
    for label, t in (("wall", wall), ("CPU", cpu)):
        ratio = t["plain"] / t["off"]
        print(f"tokens/s ({label}): trainer off {tokens / t['off'] * 1e3:.0f}, plain PyTorch "
              f"{tokens / t['plain'] * 1e3:.0f}, trainer/plain {ratio:.4f} (goal >= 0.95) "
              f"{'ok' if ratio >= 0.95 else 'MISSED'}")
    print(f"wall time {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
