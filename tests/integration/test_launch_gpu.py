"""On a CUDA machine: the trainer over NCCL on real GPUs (skipped without CUDA; the tests that need
two GPUs skip on a one-GPU machine). What they pin:

- the launcher's ``--device cuda`` run on one GPU with bf16 (the original smoke test);
- PP=2 over NCCL: P2P with the span context staged through pinned memory, its links resolved at
  the step's sync, device-timed microbatch and P2P spans;
- DP=2 with bf16 and the bucketed all-reduce overlapping backward, against one GPU;
- save on two GPUs, resume where the worker sees one (the CUDA RNG state is per device);
- activation offload on a copy stream gives the losses of a run without it;
- a ``torch.cuda._sleep`` of known length inside a device-timed span is that span's duration.

The tests that catch gradient mistakes and hidden syncs are in test_gpu_gradients.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import pytest
from support.trainer_runs import TINY, Run, run_trainer, telemetry_env

from mlaunch.model.spans import SpanName
from mlaunch.otlp.otlp_json import read_spans

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.distributed]

ITERS = 6
ARGS = [*TINY, "--train-iters", str(ITERS)]


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_two = pytest.mark.skipif("_gpus() < 2", reason="needs 2 CUDA GPUs")


def ok(run: Run) -> Run:
    assert run.returncode == 0, run.output[-4000:]
    return run


def gpus(visible: str, **extra: str) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": visible, "MLAUNCH_DEVICE": "cuda", **extra}


def close(a: list[float], b: list[float], rel: float) -> None:
    assert len(a) == len(b), (a, b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert math.isclose(x, y, rel_tol=rel), f"iteration {i + 1}: {x} != {y}"


def test_tiny_run_on_cuda_with_nccl_and_bf16(tmp_path: Path) -> None:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("MEGATRON_OTEL_", "NEMO_LENS_"))
    }
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable, "-m", "mlaunch", "train", "--device", "cuda", "--nproc-per-node", "1",
            "--global-batch-size", "4", "--train-iters", "5", "--precision", "bf16",
            "--run-dir", str(run_dir),
        ],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(x) for x in (run_dir / "progress.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "eval_loss" not in r] == [1, 2, 3, 4, 5]
    spans = read_spans(run_dir / "telemetry" / "traces-rank0.jsonl")
    resource = spans[0]["resource"]
    assert resource["host.gpu.count"] >= 1
    assert resource["megatron.precision"] == "bf16"


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory) -> Run:
    tmp = tmp_path_factory.mktemp("gpu1")
    return ok(run_trainer(tmp, ARGS, nproc=1, env=gpus("0"), name="one"))


@needs_two
def test_pipeline_parallel_over_nccl_links_and_times_spans(tmp_path, one_gpu) -> None:
    env = gpus("0,1", **telemetry_env("all"))
    pp = ok(run_trainer(tmp_path, [*ARGS, "--pipeline-model-parallel-size", "2"], nproc=2, env=env))
    close(pp.losses(), one_gpu.losses(), rel=1e-3)
    senders = read_spans(pp.run_dir / "telemetry" / "traces-rank0.jsonl")
    receivers = read_spans(pp.run_dir / "telemetry" / "traces-rank1.jsonl")
    sent = {s["span_id"] for s in senders if s["name"] == SpanName.P2P_SEND_FORWARD}
    linked = [s for s in receivers if s["name"] == SpanName.PP_RECV_FORWARD_LINKED]
    assert linked and all(s["links"] and s["links"][0]["span_id"] in sent for s in linked)
    micro = [s for s in receivers if s["name"] == SpanName.MICROBATCH_FORWARD]
    assert len(micro) == ITERS * 4 and all(s["end_ns"] >= s["start_ns"] for s in micro)


@needs_two
def test_data_parallel_with_bf16_and_overlapped_buckets_matches_one_gpu(tmp_path) -> None:
    args = [*ARGS, "--bf16"]
    one = ok(run_trainer(tmp_path, args, nproc=1, env=gpus("0"), name="one-bf16"))
    env = gpus("0,1", **telemetry_env("all"))
    dp = ok(run_trainer(tmp_path, args, nproc=2, env=env, name="dp2-bf16"))
    close(dp.losses(), one.losses(), rel=2e-2)  # bf16 autocast: reduction order differs
    spans = read_spans(dp.run_dir / "telemetry" / "traces-rank0.jsonl")
    names = [s["name"] for s in spans]
    assert names.count(SpanName.GRAD_SYNC_FINISH) == ITERS


@needs_two
def test_save_on_two_gpus_and_resume_where_the_worker_sees_one(tmp_path) -> None:
    ck = tmp_path / "ck"
    save = [*ARGS, "--save", str(ck), "--save-interval", "3", "--exit-interval", "3"]
    first = ok(run_trainer(tmp_path, save, nproc=2, env=gpus("0,1"), name="save"))
    assert [r["iteration"] for r in first.progress()] == [1, 2, 3]
    resume = [*ARGS, "--load", str(ck), "--save", str(ck)]
    second = ok(run_trainer(tmp_path, resume, nproc=1, env=gpus("1"), name="resume"))
    assert [r["iteration"] for r in second.progress()] == list(range(4, ITERS + 1))
    assert all(math.isfinite(x) for x in second.losses())
    # And back: saved on one GPU, resumed on two.
    third = ok(run_trainer(tmp_path, [*resume, "--train-iters", str(ITERS + 2)], nproc=2,
                           env=gpus("0,1"), name="resume2"))  # fmt: skip
    assert [r["iteration"] for r in third.progress()] == [ITERS + 1, ITERS + 2]


@needs_two
def test_activation_offload_on_a_copy_stream_gives_the_same_losses(tmp_path) -> None:
    args = [*ARGS, "--pipeline-model-parallel-size", "2"]
    plain = ok(run_trainer(tmp_path, args, nproc=2, env=gpus("0,1"), name="plain"))
    off = ok(
        run_trainer(
            tmp_path, [*args, "--offload-activations"], nproc=2, env=gpus("0,1"), name="offload"
        )
    )
    close(off.losses(), plain.losses(), rel=1e-5)


def test_a_gpu_sleep_inside_a_device_timed_span_is_its_duration(monkeypatch) -> None:
    import torch

    from mlaunch import telemetry
    from mlaunch.telemetry import _devicetime, _spans

    queue: deque = deque()
    monkeypatch.setattr(_spans.STATE, "queue", queue)
    monkeypatch.setattr(_spans.STATE, "root_sampled", lambda trace_id, name: True)
    torch.cuda.set_device(0)
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    # Calibrate: how long does a sleep of this many cycles take (host clock around a sync)?
    cycles = 50_000_000
    t0 = time.perf_counter_ns()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    expected = time.perf_counter_ns() - t0
    assert expected > 5_000_000, "the sleep is long enough to measure"

    telemetry.set_event_timer(telemetry.CudaEventTimer())
    try:
        t0 = time.perf_counter_ns()
        with _devicetime.DeviceTimedSpan("sleep", {}) as s:
            torch.cuda._sleep(cycles)
        enqueue = time.perf_counter_ns() - t0
        assert not queue  # not resolved before the sync point
        anchor = telemetry.device_mark()
        torch.cuda.synchronize()  # the test's stand-in for the step's .tolist()
        assert telemetry.resolve_device_spans(anchor) == 1
    finally:
        _devicetime.reset()
    duration = s.end - s.start
    assert enqueue < expected / 5, "the host only enqueued the sleep"
    assert abs(duration - expected) < 0.1 * expected + 200_000, (duration, expected)
