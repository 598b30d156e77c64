"""What showing the workers' output on the console (``--tee``) costs a run whose rank prints a lot.

Runs the same ``mlaunch train --script`` three ways, alternating their order each round:

- ``tee``: ``--tee`` (the launcher's follower reads the per-rank files and writes every line,
  prefixed, to its stdout: a pipe this benchmark drains, as a CI log or ``| tee`` would);
- ``off``: ``--no-tee`` (torchrun writes the files; nothing reaches the console);
- ``off2``: ``--no-tee`` again: the A/A control (the spread two identical configurations show
  on this machine, against which the tee/off ratio is read).

The script is a small training loop on 2 ranks (CPU matmuls of ``--work`` x ``--work``);
rank 1 prints ``--mb`` MB in 100-byte lines spread over its steps, rank 0 prints nothing. Each
rank records its step times; the table shows, per mode, the median step time of each rank, the
CPU time rank 1 spent in its steps (printing included: what tee could add to a rank), the
run's wall time, and the whole process tree's CPU (launcher + torchrun + workers, from
``wait4``), then the ratios ``tee/off`` and ``off2/off``. It also counts the lines that reached
the console (``tee`` must show all of them), and, last, the CPU the launcher's follower alone
spends on the same 10 MB (in this process, written to /dev/null), which the machine's noise
does not blur.

    python benchmarks/console_tee.py [--rounds 3] [--mb 10] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SCRIPT = """\
import json, os, sys, time
import torch
torch.set_num_threads(1)
rank = int(os.environ["RANK"])
steps, lines_per_step, work, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
a = torch.randn(work, work)
line = "x" * 84
times = []
cpu = time.process_time()
for step in range(steps):
    t = time.perf_counter()
    b = a
    for _ in range(4):
        b = torch.tanh(b @ a)
    if rank == 1:
        for i in range(lines_per_step):
            print(f"s{step:04d}:{i:06d}:{line}")
    times.append(time.perf_counter() - t)
with open(f"{out}/steps-rank{rank}.json", "w") as fh:
    json.dump({"steps": times, "cpu_s": time.process_time() - cpu}, fh)
"""


def run(mode: str, root: Path, n: int, args: argparse.Namespace, env: dict[str, str]) -> dict:
    """One ``mlaunch train`` of the script; its step times, wall time, CPU and console lines."""
    out = root / f"{mode}-{n}"
    out.mkdir()
    lines_per_step = args.mb * 1_000_000 // 100 // args.steps
    argv = [
        sys.executable, "-m", "mlaunch", "train", "--script", str(root / "script.py"),
        "--run-dir", str(out / "run"), "--no-otel-enabled",  # the console is what is measured
        "--tee" if mode == "tee" else "--no-tee",
        "--", str(args.steps), str(lines_per_step), str(args.work), str(out),
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv, env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    counted = {"lines": 0, "bytes": 0}

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            counted["bytes"] += len(line)
            counted["lines"] += line.startswith(b"[rank 1] s")

    reader = threading.Thread(target=drain)
    reader.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    reader.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed ({proc.returncode}): see {out}/run")
    steps = {r: json.loads((out / f"steps-rank{r}.json").read_text()) for r in (0, 1)}
    return {
        "step_ms": {r: 1000 * statistics.median(t["steps"][1:]) for r, t in steps.items()},
        "rank_cpu_s": {r: t["cpu_s"] for r, t in steps.items()},
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "console_lines": counted["lines"],
        "expected_lines": lines_per_step * args.steps,
    }


def follower_cpu_s(root: Path, mb: int) -> float:
    """CPU seconds the launcher's follower alone spends on ``mb`` MB of 100-byte lines (already
    in a rank's file) written to /dev/null: its own cost, free of the machine's noise."""
    from mlaunch.launcher.worker_output import RankMap, WorkerOutput

    folder = root / "follower" / "id_0" / "attempt_0" / "0"
    folder.mkdir(parents=True)
    (folder / "stdout.log").write_bytes((b"y" * 99 + b"\n") * (mb * 10_000))
    with open(os.devnull, "w") as sink:
        start = time.process_time()
        out = WorkerOutput(root / "follower", 0.0, 1, None, RankMap(0, 1, 1), sink.write)
        out.start().close()
        return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each mode (alternating)")
    parser.add_argument("--mb", type=int, default=10, help="MB rank 1 prints over the run")
    parser.add_argument("--steps", type=int, default=40, help="training steps per run")
    parser.add_argument("--work", type=int, default=512, help="matrix size of a step's work")
    args = parser.parse_args()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_", "MLAUNCH_", "SLURM_"))
    }
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    modes = ("tee", "off", "off2")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="mlaunch-bench-tee-") as tmp:
        root = Path(tmp)
        (root / "script.py").write_text(SCRIPT)
        for n in range(args.rounds):
            order = modes[n % 3 :] + modes[: n % 3]  # each mode first, middle and last in turn
            for mode in order:
                results[mode].append(run(mode, root, n, args, env))
                r = results[mode][-1]
                print(
                    f"  round {n} {mode:4}: step rank0 {r['step_ms'][0]:.2f} ms, rank1"
                    f" {r['step_ms'][1]:.2f} ms, wall {r['wall_s']:.2f} s, cpu {r['cpu_s']:.2f} s,"
                    f" console lines {r['console_lines']:,}",
                    flush=True,
                )

    def med(mode: str, key: str, rank: int | None = None) -> float:
        rows = results[mode]
        return statistics.median(r[key][rank] if rank is not None else r[key] for r in rows)

    print(
        f"\n{args.mb} MB printed by rank 1 over {args.steps} steps, {args.rounds} rounds; medians"
    )
    print(f"{'':24}{'tee':>10}{'off':>10}{'off2':>10}{'tee/off':>10}{'off2/off':>10}")
    for label, key, rank in (
        ("step ms, rank 0", "step_ms", 0),
        ("step ms, rank 1 (prints)", "step_ms", 1),
        ("rank 1 CPU s, its steps", "rank_cpu_s", 1),
        ("wall s", "wall_s", None),
        ("CPU s (whole tree)", "cpu_s", None),
    ):
        t, o, o2 = (med(m, key, rank) for m in modes)
        print(f"{label:24}{t:10.2f}{o:10.2f}{o2:10.2f}{t / o:10.3f}{o2 / o:10.3f}")
    with tempfile.TemporaryDirectory(prefix="mlaunch-bench-tee-") as tmp:
        cpu = statistics.median(follower_cpu_s(Path(tmp) / str(i), args.mb) for i in range(3))
    print(f"the follower alone: {cpu:.3f} s CPU for {args.mb} MB (median of 3, to /dev/null)")
    shown = [r["console_lines"] for r in results["tee"]]
    expected = results["tee"][0]["expected_lines"]
    print(f"console lines with tee: {shown} of {expected:,} each run")
    if any(s != expected for s in shown):
        raise SystemExit("tee lost lines")


if __name__ == "__main__":
    main()
