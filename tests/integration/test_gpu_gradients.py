"""On a CUDA machine: tests that catch gradient mistakes and hidden host syncs, where
the losses of a few AdamW steps cannot (AdamW barely changes when every gradient is scaled by
the same factor, so a missing divide by the DP size or a bucket reduced twice gives the same
losses). Skipped without CUDA; those that need two GPUs skip on a one-GPU machine.

- a step makes exactly one host sync: steps run under ``torch.cuda.set_sync_debug_mode("error")``
  with only the documented ``.tolist()`` let through (plain, bf16, activation offload);
- the offload span is timed on the copy stream; offload keeps CPU RNG scalars resident and gives
  the gradients of a run without it, through real SDPA (fp32: the memory-efficient backend);
- DP=2 in fp32 with small buckets: ``grad_norm`` and the parameters after the last step equal the
  one-GPU run's at a tight tolerance, and every bucket was launched during backward;
- PP=2 with bf16 against one GPU; activation offload in fp32 and bf16 against no offload;
- resume with dropout on (a wrong CUDA RNG restore changes the masks);
- auto device mode with more local ranks than GPUs refuses with one line, exit 2.
"""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest
from support.trainer_runs import TINY, Run, clean_env, run_trainer, telemetry_env

from mlaunch import envcontract
from mlaunch.model.spans import SpanName
from mlaunch.otlp.otlp_json import read_spans

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

ITERS = 6
ARGS = [*TINY, "--train-iters", str(ITERS)]


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_two = pytest.mark.skipif("_gpus() < 2", reason="needs 2 CUDA GPUs")
needs_four = pytest.mark.skipif("_gpus() < 4", reason="needs 4 CUDA GPUs")


def ok(run: Run) -> Run:
    assert run.returncode == 0, run.output[-4000:]
    return run


def gpus(visible: str, **extra: str) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": visible, envcontract.DEVICE: "cuda", **extra}


def close(a: list[float], b: list[float], rel: float, what: str) -> None:
    assert len(a) == len(b) == ITERS, (what, a, b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert math.isclose(x, y, rel_tol=rel), f"{what}, iteration {i + 1}: {x} != {y}"


def grad_norms(run: Run) -> list[float]:
    return [r["grad_norm"] for r in run.progress() if "grad_norm" in r]


def final_params(save: Path, iteration: int = ITERS) -> dict:
    import torch

    shard = save / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    return torch.load(shard, map_location="cpu", weights_only=False)["model"]


# ------------------------------------------------------------------------------------------------
# In-process steps on one GPU


@pytest.fixture
def trainer_factory(tmp_path, monkeypatch):
    """A Trainer on cuda:0 in this process (no process group), built and with its data."""
    for name in ("MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

    def make(extra: list[str]):
        from mlaunch.settings.trainer_cli import parse_and_validate
        from mlaunch.trainer.loop import Trainer
        from mlaunch.trainer.parallel import init_distributed
        from mlaunch.trainer.setup import StopFlag

        args = parse_and_validate([*TINY, "--train-iters", "10", *extra])
        topo = init_distributed(args.pipeline_model_parallel_size)
        assert topo.device.type == "cuda" and not topo.distributed
        trainer = Trainer(args, topo, tmp_path, StopFlag())
        trainer.build_model()
        trainer.setup_data()
        trainer.tokens_per_iter = args.global_batch_size * args.seq_length  # as train_loop sets
        trainer.flops_per_iter = 1.0
        return trainer

    return make


@pytest.mark.parametrize(
    "extra",
    [[], ["--bf16"], ["--offload-activations"], ["--bf16", "--offload-activations"]],
    ids=["fp32", "bf16", "offload-fp32", "offload-bf16"],
)
def test_a_step_makes_exactly_one_host_sync(trainer_factory, extra) -> None:
    import torch

    from mlaunch import telemetry
    from mlaunch.telemetry import _devicetime
    from mlaunch.trainer.metrics import Progress

    trainer = trainer_factory(extra)
    progress = Progress(None)
    telemetry.set_event_timer(telemetry.CudaEventTimer())  # the anchor and its resolution too
    try:
        # The first iteration initialises lazily (cuBLAS handles, optimizer state, pinned
        # blocks of the caching host allocator): outside the check.
        trainer.iteration(progress, first=True)
        torch.cuda.set_sync_debug_mode("error")
        try:
            with pytest.raises(RuntimeError, match="synchroniz"):
                torch.ones((), device="cuda").item()  # the mode is on: a sync raises
            for _ in range(3):
                assert trainer.iteration(progress, first=False) is None
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        _devicetime.reset()
    assert trainer.state.iteration == 4
    assert trainer.state.skipped_iters == 0


def test_the_offload_span_is_timed_on_the_copy_stream(monkeypatch) -> None:
    import torch

    from mlaunch import telemetry
    from mlaunch.model.groups import SpanGroup
    from mlaunch.telemetry import _devicetime, _spans
    from mlaunch.trainer import offload

    queue: deque = deque()
    monkeypatch.setattr(_spans.STATE, "queue", queue)
    monkeypatch.setattr(_spans.STATE, "root_sampled", lambda trace_id, name: True)
    group = frozenset({SpanGroup.ACTIVATION_OFFLOAD.value})
    monkeypatch.setattr(telemetry, "_ENABLED", group)
    monkeypatch.setattr(telemetry, "_FINE", group)
    streams: list[int] = []

    class Timer(telemetry.CudaEventTimer):
        def record(self):
            streams.append(torch.cuda.current_stream().cuda_stream)
            return super().record()

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    layer = torch.nn.Linear(1024, 1024).to(dev)
    x = torch.randn(8192, 1024, device=dev, requires_grad=True)  # 32 MiB per saved activation
    stash = offload.ActivationStash(dev, layer.parameters())
    with stash.hooks():
        loss = torch.nn.functional.gelu(layer(x)).square().sum()
    telemetry.set_event_timer(Timer())
    try:
        stash.offload()
        offload_streams = list(streams)
        streams.clear()
        stash.reload()
        reload_streams = list(streams)
        loss.backward()
        anchor = telemetry.device_mark()
        torch.cuda.synchronize()
        assert telemetry.resolve_device_spans(anchor) == 2
    finally:
        _devicetime.reset()
    copy = offload._copy_stream(dev).cuda_stream
    compute = torch.cuda.current_stream(dev).cuda_stream
    assert copy != compute
    assert offload_streams == [copy, copy]  # the span's two events bracket the copies
    assert reload_streams == [compute, compute]  # what the compute stream waits for
    spans = {s.name: s for s in queue}
    off = spans[SpanName.ACTIVATION_OFFLOAD]
    assert off.end > off.start  # the copies' device time (on the compute stream it was ~0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offload_through_real_attention_gives_the_same_gradients(precision) -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from mlaunch.model.gpt_shape import GPTConfig
    from mlaunch.trainer.model import SelfAttention
    from mlaunch.trainer.offload import ActivationStash

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    cfg = GPTConfig(num_layers=1, hidden_size=256, num_heads=4, seq_length=256)
    torch.manual_seed(0)
    attn = SelfAttention(cfg).to(dev)
    x0 = torch.randn(4, 256, 256, device=dev)

    def autocast():
        if precision == "bf16":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def grads(stash: ActivationStash | None) -> list[torch.Tensor]:
        attn.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        # The memory-efficient backend: it saves its RNG seed and offset as CPU scalars.
        hooks = stash.hooks() if stash is not None else contextlib.nullcontext()
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION), autocast(), hooks:
            out = attn(x)
        if stash is not None:
            # Saved on the GPU only: the backend's CPU seed and offset stayed resident.
            assert stash.slots and all(t.device == dev for t in stash.slots)
            stash.offload()
            stash.reload()
        out.float().square().sum().backward()
        return [x.grad.clone(), *(p.grad.clone() for p in attn.parameters())]

    expected = grads(None)
    got = grads(ActivationStash(dev, attn.parameters()))
    # The backward kernel may accumulate with atomics: equal up to rounding, relative to the
    # gradient's scale (bf16: its 8-bit mantissa).
    rel = 1e-5 if precision == "fp32" else 2e-2
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=rel, atol=rel * float(e.abs().max()))


# ------------------------------------------------------------------------------------------------
# Real runs against one GPU


@pytest.fixture(scope="module")
def one_gpu_fp32(tmp_path_factory) -> tuple[Run, Path]:
    tmp = tmp_path_factory.mktemp("one-fp32")
    save = tmp / "ck"
    args = [*ARGS, "--save", str(save), "--save-interval", str(ITERS)]
    return ok(run_trainer(tmp, args, nproc=1, env=gpus("0"), name="one")), save


@needs_two
def test_data_parallel_gradients_and_parameters_match_one_gpu(tmp_path, one_gpu_fp32) -> None:
    one, one_save = one_gpu_fp32
    save = tmp_path / "ck"
    # ~5k elements per bucket: the tiny model's gradients travel in several buckets.
    args = [*ARGS, "--ddp-bucket-size", "5000", "--save", str(save), "--save-interval", str(ITERS)]
    dp = ok(run_trainer(tmp_path, args, nproc=2, env=gpus("0,1"), name="dp2"))
    records = dp.progress()
    assert len(records) == ITERS and all(r["grad_buckets"] >= 4 for r in records)
    # Every bucket was launched from inside the last backward (it overlaps backward).
    assert all(r["grad_buckets_in_backward"] == r["grad_buckets"] for r in records)
    # fp32: only the reduction order differs. A missing divide by the DP size doubles the norm,
    # a bucket reduced twice or never changes it well past this tolerance.
    close(grad_norms(dp), grad_norms(one), rel=1e-4, what="grad_norm")
    close(dp.losses(), one.losses(), rel=1e-5, what="loss")
    # And the parameters after the last step (a bucket never reduced leaves ranks apart).
    mine, ref = final_params(save), final_params(one_save)
    assert mine.keys() == ref.keys()
    diff = sum(float((mine[k].double() - ref[k].double()).abs().sum()) for k in ref)
    count = sum(ref[k].numel() for k in ref)
    assert diff / count < 1e-6, diff / count  # an AdamW step moves a weight by up to ~lr (3e-3)


@needs_two
def test_pipeline_parallel_with_bf16_matches_one_gpu(tmp_path) -> None:
    args = [*ARGS, "--bf16"]
    one = ok(run_trainer(tmp_path, args, nproc=1, env=gpus("0"), name="one-bf16"))
    env = gpus("0,1", **telemetry_env("all"))
    pp_args = [*args, "--pipeline-model-parallel-size", "2"]
    pp = ok(run_trainer(tmp_path, pp_args, nproc=2, env=env, name="pp2-bf16"))
    # Same kernels on the same microbatches, stage by stage: bf16 rounding, not layout.
    close(pp.losses(), one.losses(), rel=1e-2, what="loss")
    close(grad_norms(pp), grad_norms(one), rel=2e-2, what="grad_norm")
    receivers = read_spans(pp.run_dir / "telemetry" / "traces-rank1.jsonl")
    assert sum(s["name"] == SpanName.MICROBATCH_BACKWARD for s in receivers) == ITERS * 4


@needs_four
def test_pipeline_times_data_parallel_matches_one_gpu(tmp_path, one_gpu_fp32) -> None:
    one, _ = one_gpu_fp32
    args = [*ARGS, "--pipeline-model-parallel-size", "2", "--ddp-bucket-size", "5000"]
    both = ok(run_trainer(tmp_path, args, nproc=4, env=gpus("0,1,2,3"), name="pp2-dp2"))
    close(grad_norms(both), grad_norms(one), rel=1e-4, what="grad_norm")
    close(both.losses(), one.losses(), rel=1e-4, what="loss")
    assert all(r["grad_buckets_in_backward"] == r["grad_buckets"] for r in both.progress())


@pytest.mark.parametrize(("precision", "rel"), [("fp32", 1e-5), ("bf16", 1e-2)])
def test_activation_offload_gives_the_losses_and_norms_of_a_run_without(
    tmp_path, precision, rel
) -> None:
    args = [*ARGS, "--bf16"] if precision == "bf16" else ARGS
    plain = ok(run_trainer(tmp_path, args, nproc=1, env=gpus("0"), name="plain"))
    env = gpus("0", **telemetry_env("all"))
    off_args = [*args, "--offload-activations"]
    off = ok(run_trainer(tmp_path, off_args, nproc=1, env=env, name="offload"))
    close(off.losses(), plain.losses(), rel=rel, what="loss")
    close(grad_norms(off), grad_norms(plain), rel=rel, what="grad_norm")
    spans = read_spans(off.run_dir / "telemetry" / "traces-rank0.jsonl")
    offloads = [s for s in spans if s["name"] == SpanName.ACTIVATION_OFFLOAD]
    assert len(offloads) == ITERS * 4
    assert all(s["end_ns"] > s["start_ns"] for s in offloads)  # timed on the copy stream


def test_resume_with_dropout_continues_the_same_losses_on_a_gpu(tmp_path) -> None:
    args = [*ARGS, "--hidden-dropout", "0.2"]
    straight = ok(run_trainer(tmp_path, args, nproc=1, env=gpus("0"), name="straight"))
    ck = tmp_path / "ck"
    save = [*args, "--save", str(ck), "--save-interval", "3", "--exit-interval", "3"]
    first = ok(run_trainer(tmp_path, save, nproc=1, env=gpus("0"), name="a"))
    close(first.losses() + straight.losses()[3:], straight.losses(), rel=1e-6, what="loss")
    second = ok(run_trainer(tmp_path, [*args, "--load", str(ck)], nproc=1, env=gpus("0"), name="b"))
    assert [r["iteration"] for r in second.progress()] == [4, 5, 6]
    # The dropout masks come from the CUDA RNG the checkpoint restored.
    close(straight.losses()[:3] + second.losses(), straight.losses(), rel=1e-6, what="loss")


def test_auto_device_with_more_local_ranks_than_gpus_refuses(tmp_path) -> None:
    n = _gpus()
    env = clean_env(
        tmp_path, CUDA_VISIBLE_DEVICES=",".join(map(str, range(n))),
        LOCAL_WORLD_SIZE=str(n + 1), WORLD_SIZE=str(n + 1), RANK="0", LOCAL_RANK="0",
    )  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "mlaunch.trainer", *TINY, "--global-batch-size", str(2 * (n + 1)),
         "--train-iters", "1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"error: device: {n + 1} processes on this node, but it sees {n} GPU(s)" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "progress.jsonl").exists()
