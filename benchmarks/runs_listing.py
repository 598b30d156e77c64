"""How long ``mlaunch runs DIR`` takes over 1,000 run directories.

    python benchmarks/runs_listing.py [--runs 1000] [--repeats 5] [--template RUN_DIR]

Builds DIR from a real run directory (``--template``; by default a tiny ``mlaunch train``
run made here first, which takes a few seconds): each of the ``--runs`` copies has every file of
the template (hard links, so the shape and sizes are real: logs, telemetry, checkpoints) with its
own launcher record and progress written to make a quarter of them completed, failed (an error
file), preempted (a signal and a checkpoint after the start: resumable) and running; plus ten
foreign and ten corrupt folders. Then it times whole ``python -m mlaunch runs DIR --json``
processes, interleaved: twice over DIR (the A/A control: two labels of the same measurement, whose
difference is the noise), and over an empty folder (the process's start-up alone). For each it
prints the median wall time and the median CPU time of the child process (user + system, which
other load on the machine barely moves), and the listing's own cost per run directory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLAUNCH_", "OTEL_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def make_template(where: Path) -> Path:
    """A real tiny run: the built-in trainer, 20 iterations, a checkpoint at 10 and 20."""
    run_dir = where / "template"
    subprocess.run(
        [sys.executable, "-m", "mlaunch", "train", "--run-dir", str(run_dir), "--train-iters",
         "20", "--save-interval", "10", "--log-interval", "1"],
        cwd=where, env=_env(), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return run_dir


def _copy(template: Path, dest: Path) -> None:
    """Every file of ``template`` under ``dest``, hard-linked (the files the variants rewrite
    are replaced, never written through the link)."""
    for root, _, files in os.walk(template):
        rel = Path(root).relative_to(template)
        (dest / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            os.link(Path(root) / name, dest / rel / name)


def _replace(path: Path, text: str) -> None:
    path.unlink(missing_ok=True)
    path.write_text(text)


def build(template: Path, folder: Path, n: int) -> Counter:
    """``n`` run directories from ``template`` under ``folder``, a quarter in each state; the
    states they should be listed in (the listing is checked against it)."""
    record = json.loads((template / "launcher-node0.json").read_text())
    progress = (template / "progress.jsonl").read_text().splitlines()
    expected: Counter = Counter()
    now = time.time()
    for i in range(n):
        dest = folder / f"run{i:04d}"
        _copy(template, dest)
        started = now - 3600 * (n - i)
        rec = {**record, "run_id": f"run{i:04d}", "started": started, "ended": started + 60,
               "exit_code": 0, "signal": None, "failures": []}  # fmt: skip
        kind = ("completed", "failed", "preempted", "running")[i % 4]
        if kind == "failed":
            rec.update(exit_code=1, failures=[{"rank": 1, "local_rank": 1, "node": 0,
                                               "exception_type": "RuntimeError",
                                               "message": "boom", "log": None}])  # fmt: skip
            (dest / "error-rank1.json").write_text(
                json.dumps({"rank": 1, "exception_type": "RuntimeError", "message": "boom"})
            )
            os.utime(dest / "error-rank1.json", (started + 30, started + 30))
        elif kind == "preempted":
            rec.update(exit_code=128 + signal.SIGTERM, signal="SIGTERM")
            _replace(dest / "progress.jsonl", "\n".join(progress[: len(progress) // 2]) + "\n")
            tracker = dest / "checkpoints" / "latest_checkpointed_iteration.txt"
            _replace(tracker, "10\n")
            os.utime(tracker, (started + 50, started + 50))
        elif kind == "running":
            rec.update(ended=None, exit_code=None, host="another-host")
        _replace(dest / "launcher-node0.json", json.dumps(rec, indent=1))
        expected[kind] += 1
    for i in range(10):
        (folder / f"foreign{i}").mkdir()
        (folder / f"foreign{i}" / "notes.txt").write_text("not a run\n")
        (folder / f"corrupt{i}").mkdir()
        (folder / f"corrupt{i}" / "resolved.json").write_text('{"run_id": ')
    expected["not a run"] += 10
    expected["corrupt"] += 10
    return expected


def _list(folder: Path) -> tuple[float, float, str]:
    """(wall seconds, child CPU seconds, output) of one ``mlaunch runs FOLDER --json``."""
    cpu, t = _children_cpu(), time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "mlaunch", "runs", str(folder), "--json"],
        env=_env(), check=True, capture_output=True, text=True,
    )  # fmt: skip
    return time.perf_counter() - t, _children_cpu() - cpu, out.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--template", type=Path, help="a real run directory to copy (default: make one)"
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        template = args.template or make_template(where)
        folder, empty = where / "runs", where / "empty"
        folder.mkdir()
        empty.mkdir()
        expected = build(template, folder, args.runs)
        # The listing must be right before its time means anything.
        _, _, out = _list(folder)
        rows = json.loads(out)
        got = Counter(r["state"] for r in rows)
        if got != expected:
            sys.exit(f"wrong listing: expected {dict(expected)}, got {dict(got)}")
        starts = [r["started"] for r in rows if r["started"] is not None]
        if starts != sorted(starts, reverse=True):
            sys.exit("wrong listing: not newest first")
        _list(empty)  # warm-up of the interpreter's files
        times: dict[str, list[tuple[float, float]]] = {"A1": [], "A2": [], "empty": []}
        for _ in range(args.repeats):
            for label, target in (("A1", folder), ("empty", empty), ("A2", folder)):
                wall, cpu, _ = _list(target)
                times[label].append((wall, cpu))
        print(f"mlaunch runs over {args.runs} run directories (+20 foreign/corrupt),"
              f" {args.repeats} interleaved repeats, medians:")  # fmt: skip
        med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
               for k, v in times.items()}  # fmt: skip
        for label, what in (("A1", "DIR"), ("A2", "DIR again (A/A control)"),
                            ("empty", "an empty folder (start-up)")):  # fmt: skip
            wall, cpu = med[label]
            print(f"  {what:<28} wall {wall * 1e3:7.1f} ms   cpu {cpu * 1e3:7.1f} ms")
        a_a = abs(med["A1"][1] - med["A2"][1])
        own = (med["A1"][1] + med["A2"][1]) / 2 - med["empty"][1]
        print(f"  A/A difference (noise)       cpu {a_a * 1e3:7.1f} ms")
        print(f"  the listing itself           cpu {own * 1e3:7.1f} ms"
              f" ({own / args.runs * 1e6:.0f} us per run directory)")  # fmt: skip
        if args.template is None:
            shutil.rmtree(template, ignore_errors=True)


if __name__ == "__main__":
    main()
