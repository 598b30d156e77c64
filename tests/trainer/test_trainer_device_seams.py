"""The CPU seams of what a GPU machine needs: device-timed spans resolved at the step's
sync point (host clock, and a fake event class for the resolution arithmetic), deferred links,
CUDA RNG per device with a fake device, the ``--device cuda`` refusal, the parameter filter of
activation offload (views and autocast casts), gradient buckets launched during backward, and
the shared-save-directory check with two "nodes" on one machine."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from support.trainer_runs import TINY, clean_env

from mlaunch import envcontract, telemetry
from mlaunch.telemetry import _devicetime, _spans
from mlaunch.trainer.offload import ActivationStash, ParameterFilter, host_strides
from mlaunch.trainer.parallel import GradBuffer, device_problem

# ------------------------------------------------------------------------------------------------
# Device-timed spans


class FakeEvent:
    """A device event: ``at`` is when the device reaches it (None: not yet)."""

    def __init__(self, at: int | None) -> None:
        self.at = at


class FakeTimer:
    """Events whose device times the test sets; the anchor runs at ``anchor_wall``."""

    def __init__(self, times: list[int | None], anchor_wall: int) -> None:
        self.times = deque(times)
        self.anchor_wall = anchor_wall

    def record(self) -> FakeEvent:
        return FakeEvent(self.times.popleft())

    def done(self, event: FakeEvent) -> bool:
        return event.at is not None

    def elapsed_ns(self, first: FakeEvent, second: FakeEvent) -> int:
        return second.at - first.at

    def anchor_wall_ns(self, anchor: FakeEvent, now_ns: int) -> int:
        return self.anchor_wall


@pytest.fixture
def queue(monkeypatch):
    """A sampled root and a private export queue, no runtime."""
    q: deque = deque()
    monkeypatch.setattr(_spans.STATE, "queue", q)
    monkeypatch.setattr(_spans.STATE, "root_sampled", lambda trace_id, name: True)
    yield q
    _devicetime.reset()


def test_device_span_takes_the_device_times_at_the_sync_point(queue) -> None:
    # Device clock: span 1 runs 100..400, span 2 (nested) 150..250, anchor at 1000; the host
    # clock reads 5000 when the device reached the anchor, so device t -> 4000 + t.
    _devicetime.TIMER = FakeTimer([100, 150, 250, 400, 1000], anchor_wall=5000)
    with (
        _devicetime.DeviceTimedSpan("outer", {}) as outer,
        _devicetime.DeviceTimedSpan("inner", {}),
    ):
        pass
    assert not queue  # held back until the sync point
    anchor = _devicetime.mark()
    assert _devicetime.resolve(anchor) == 2
    spans = {s.name: s for s in queue}
    assert (spans["outer"].start, spans["outer"].end) == (4100, 4400)
    assert (spans["inner"].start, spans["inner"].end) == (4150, 4250)
    assert spans["inner"].parent_id == outer.span_id


def test_a_span_whose_end_has_not_run_waits_for_the_next_sync_or_leaves_host_timed(queue) -> None:
    # The optimizer's kernels run after the step's sync: their end event is not done yet.
    _devicetime.TIMER = FakeTimer([100, None, 50], anchor_wall=5000)
    with _devicetime.DeviceTimedSpan("late", {}) as late:
        pass
    host = (late.start, late.end)
    assert _devicetime.resolve(_devicetime.mark()) == 0 and not queue
    assert len(_devicetime.PENDING) == 1
    _devicetime.resolve(None, final=True)  # shutdown: out with its host times
    assert [s.name for s in queue] == ["late"] and (late.start, late.end) == host


def test_on_the_host_clock_resolution_keeps_the_host_times(queue) -> None:
    telemetry.set_event_timer(telemetry.HostClock())
    with _devicetime.DeviceTimedSpan("cpu", {}) as s:
        sum(range(1000))
    before = (s.start, s.end)
    anchor = telemetry.device_mark()
    telemetry.resolve_device_spans(anchor)
    assert [x.name for x in queue] == ["cpu"]
    # The span's times are its events' host times (a few microseconds from its own clock reads).
    assert abs(s.start - before[0]) < 5_000_000 and abs(s.end - before[1]) < 5_000_000
    assert s.end >= s.start


def test_a_deferred_link_is_read_at_the_sync_point(queue) -> None:
    ctx = [0] * 4
    with _devicetime.DeviceTimedSpan("linked", {}, lambda: list(ctx)) as s:
        pass
    assert not queue and s.links is None
    sender = telemetry.context_from_ints((1, 2, 3, 1))
    assert sender is not None
    ctx[:] = [1, 2, 3, 1]  # the device copy lands before the sync
    _devicetime.resolve(None)
    assert [x.name for x in queue] == ["linked"]
    assert s.links[0].context.span_id == sender.span_id


# ------------------------------------------------------------------------------------------------
# CUDA RNG per device, the --device check


def test_cuda_rng_is_saved_and_restored_for_this_workers_gpu_only(monkeypatch) -> None:
    from mlaunch.trainer import device

    calls: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda d: calls.append(("get", d)) or "S")
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d: calls.append(("set", s, d)))
    dev = torch.device("cuda", 1)
    assert device.cuda_rng_state(dev) == "S" and calls == [("get", dev)]
    calls.clear()
    device.restore_cuda_rng("S", dev, print)
    assert calls == [("set", "S", dev)]
    # An old checkpoint (one state per visible GPU) saved on 2 GPUs, resumed where the worker's GPU
    # is index 1: its own entry; resumed on GPU 3: no entry, a line, the RNG stays as seeded.
    calls.clear()
    device.restore_cuda_rng(["A", "B"], dev, print)
    assert calls == [("set", "B", dev)]
    calls.clear()
    lines: list[str] = []
    device.restore_cuda_rng(["A", "B"], torch.device("cuda", 3), lines.append)
    assert calls == [] and "none for GPU 3" in lines[0]
    assert device.cuda_rng_state(torch.device("cpu")) is None
    device.restore_cuda_rng("S", torch.device("cpu"), print)  # a GPU checkpoint resumed on CPU
    assert calls == []


def test_device_cuda_is_checked_against_cuda_and_the_gpu_count() -> None:
    env = {envcontract.DEVICE: "cuda", "LOCAL_WORLD_SIZE": "4"}
    assert "sees no CUDA device" in device_problem(env, lambda: False, lambda: 0)
    assert "sees 2 GPU(s)" in device_problem(env, lambda: True, lambda: 2)
    assert device_problem(env, lambda: True, lambda: 4) is None
    assert device_problem({}, lambda: False, lambda: 0) is None  # auto
    # Auto mode with more local ranks than GPUs refuses too (no fall-back to CPU) ...
    auto = {"LOCAL_WORLD_SIZE": "4"}
    problem = device_problem(auto, lambda: True, lambda: 2)
    assert problem is not None and "4 processes on this node, but it sees 2 GPU(s)" in problem
    assert "--device cpu" in problem
    assert device_problem(auto, lambda: True, lambda: 4) is None
    # ... and without GPUs it is CPU, any number of processes.
    assert device_problem(auto, lambda: False, lambda: 0) is None
    assert device_problem({envcontract.DEVICE: "cpu"}, lambda: False, lambda: 0) is None


@pytest.mark.slow
def test_a_worker_asked_for_cuda_without_cuda_refuses(tmp_path: Path) -> None:
    env = clean_env(tmp_path, **{envcontract.DEVICE: "cuda", "CUDA_VISIBLE_DEVICES": ""})
    out = subprocess.run(
        [sys.executable, "-m", "mlaunch.trainer", *TINY, "--train-iters", "1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert "error: device: --device cuda, but this worker sees no CUDA device" in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "progress.jsonl").exists()


@pytest.mark.parametrize(("device", "expected"), [("cuda", "cuda"), ("cpu", None), ("auto", None)])
def test_the_launcher_hands_device_cuda_to_the_workers(tmp_path, device, expected) -> None:
    env = clean_env(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "mlaunch", "train", "--device", device, "--print-env"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    line = f"export {envcontract.DEVICE}="
    found = [x.removeprefix(line) for x in out.stdout.splitlines() if x.startswith(line)]
    assert found == ([expected] if expected else [])


# ------------------------------------------------------------------------------------------------
# Activation offload: weights stay resident


def test_offload_skips_parameters_their_views_and_autocast_copies() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 32)
    filt = ParameterFilter(layer.parameters())
    w = layer.weight
    assert filt.is_parameter(w) and filt.is_parameter(w.t())
    assert filt.is_parameter(w.to(torch.bfloat16))  # a cast, as autocast makes
    assert filt.is_parameter(w.to(torch.bfloat16).t())
    x = torch.randn(4, 16, requires_grad=True)
    assert not filt.is_parameter(x) and not filt.is_parameter(x * 2)
    assert not filt.is_parameter(w * 2)  # computed from a weight: a real activation

    stash = ActivationStash(torch.device("cpu"), layer.parameters())
    with stash.hooks(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.nn.functional.gelu(layer(x)).sum()
    weight_shapes = {(32, 16), (16, 32), (32,)}
    assert stash.slots, "activations were captured"
    assert not [t.shape for t in stash.slots if tuple(t.shape) in weight_shapes]
    stash.offload()
    stash.reload()
    out.backward()
    assert layer.weight.grad is not None and x.grad is not None


# ------------------------------------------------------------------------------------------------
# Gradient buckets


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gradient_buckets_are_launched_during_the_last_backward_only() -> None:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        x = torch.randn(3, 8)
        model(x).sum().backward()
        model(x).sum().backward()
        expected = [p.grad.clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = None
        params = list(model.parameters())
        grads = GradBuffer(params, bucket_numel=80)  # one Linear (72 elements) per bucket
        assert len(grads.buckets) == 4
        group = dist.group.WORLD
        model(x).sum().backward()  # an earlier microbatch: accumulates, nothing launched
        assert grads.launched_in_backward == 0 and all(w is None for w in grads._works)
        grads.arm(group)
        model(x).sum().backward()  # the last one: every bucket completes inside backward
        assert grads.launched_in_backward == 4
        grads.start_remaining(group)
        grads.finish_all_reduce(1)
        for p, e in zip(params, expected, strict=True):
            assert torch.allclose(p.grad, e)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# Shared save directory: two "nodes" on one machine


def _node(rank: int, port: int, save: Path, tmp: Path) -> subprocess.Popen:
    run_dir = tmp / f"node{rank}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
        "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
        "-m", "mlaunch.trainer", *TINY, "--global-batch-size", "4", "--train-iters", "2",
        "--save", str(save),
    ]  # fmt: skip
    return subprocess.Popen(
        cmd, cwd=tmp, env=clean_env(run_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("shared", [False, True])
def test_a_save_directory_not_shared_by_every_node_stops_the_job(tmp_path, shared) -> None:
    port = _free_port()
    saves = [tmp_path / "ck", tmp_path / "ck"] if shared else [tmp_path / "a", tmp_path / "b"]
    procs = [_node(r, port, saves[r], tmp_path) for r in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    codes = [p.returncode for p in procs]
    if shared:
        assert codes == [0, 0], outs
        assert not list(saves[0].glob(".mlaunch-shared-check-*"))  # the token is cleaned up
        assert (saves[0] / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
        return
    assert all(c != 0 for c in codes), outs
    joined = "\n".join(outs)
    assert "is not shared between the nodes" in joined and "rank(s) 1" in joined, joined[-3000:]
    assert "Traceback" not in outs[0].split("is not shared")[0][-200:]
    assert not (saves[1] / "latest_checkpointed_iteration.txt").exists()
    assert os.path.isdir(saves[0])


# ------------------------------------------------------------------------------------------------
# Activation offload: what stays resident, strides kept


class FakeAttention(torch.autograd.Function):
    """What the memory-efficient SDPA backend saves in fp32: its input, its output (a transposed
    view) and its RNG seed and offset as CPU int64 scalars, whatever device the input is on."""

    seeds: list[torch.Tensor] = []

    @staticmethod
    def forward(ctx, q):
        out = (q * 3).transpose(1, 2)
        seed = torch.tensor(1234, dtype=torch.int64)
        offset = torch.tensor(7, dtype=torch.int64)
        FakeAttention.seeds = [seed, offset]
        ctx.save_for_backward(q, out, seed, offset)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, out, seed, offset = ctx.saved_tensors
        # A real kernel would read them on the host: they must still be the CPU scalars.
        assert (seed.device.type, int(seed), int(offset)) == ("cpu", 1234, 7)
        assert [seed.data_ptr(), offset.data_ptr()] == [t.data_ptr() for t in FakeAttention.seeds]
        return grad.transpose(1, 2) * 3 + q * (out.transpose(1, 2) * 0).sum()


def _fake_attention_grad(stash: ActivationStash | None) -> tuple[torch.Tensor, ActivationStash]:
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 8, requires_grad=True)
    with stash.hooks() if stash is not None else contextlib.nullcontext():
        out = FakeAttention.apply(q)
        loss = (out * torch.arange(out.numel()).view_as(out)).sum()
    if stash is not None:
        stash.offload()
        stash.reload()
    loss.backward()
    return q.grad, stash


def test_offload_keeps_cpu_scalars_and_tensors_off_its_device_resident() -> None:
    expected, _ = _fake_attention_grad(None)
    # A stash for a GPU on this CPU machine: every tensor here is off its device, so none is
    # stashed, and offload/reload make no CUDA call (they would fail on a CPU-only torch).
    grad, stash = _fake_attention_grad(ActivationStash(torch.device("cuda", 0), []))
    assert stash.slots == []
    assert torch.equal(grad, expected)
    # On its own device the big tensors go out and back; the tiny CPU scalars stay.
    grad, stash = _fake_attention_grad(ActivationStash(torch.device("cpu"), []))
    assert len(stash.slots) >= 2 and all(t.numel() == 2 * 4 * 8 * 8 for t in stash.slots)
    assert torch.equal(grad, expected)


class StrideSensitive(torch.autograd.Function):
    """Saves a view and, in backward, reads its memory as the strides forward saw (as a kernel
    that takes a layout for granted does), and records the strides it got back."""

    seen: list[tuple[int, ...]] = []

    @staticmethod
    def forward(ctx, x, view):
        ctx.save_for_backward(view)
        ctx.strides = view.stride()
        return x * view

    @staticmethod
    def backward(ctx, grad):
        (view,) = ctx.saved_tensors
        StrideSensitive.seen.append(view.stride())
        if view.stride() != ctx.strides:  # a non-dense view comes back dense: read it as it is
            return grad * view, None
        raw = torch.as_strided(view, view.shape, ctx.strides)  # wrong values if strides changed
        return grad * raw, None


def _strided_run(stash: ActivationStash | None, make_view) -> tuple[torch.Tensor, tuple]:
    torch.manual_seed(0)
    base = torch.randn(6, 16, 12)
    x = torch.randn(make_view(base).shape, requires_grad=True)
    StrideSensitive.seen = []
    with stash.hooks() if stash is not None else contextlib.nullcontext():
        loss = StrideSensitive.apply(x, make_view(base)).sum()
    if stash is not None:
        assert len(stash.slots) == 1
        stash.offload()
        (host,) = stash.slots
        host_strides = host.stride()
        stash.reload()
    else:
        host_strides = make_view(base).stride()
    loss.backward()
    return x.grad, (host_strides, StrideSensitive.seen[0])


@pytest.mark.parametrize(
    "make_view",
    [
        lambda b: b.transpose(1, 2),  # a transposed view (q/k/v, the attention output)
        lambda b: b.permute(2, 0, 1),
        lambda b: b.transpose(1, 2)[:, :, :5],  # not dense: same dimension order, dense strides
    ],
    ids=["transpose", "permute", "non-dense-slice"],
)
def test_offload_keeps_saved_tensors_strides_and_gradients(make_view) -> None:
    expected, (strides, _) = _strided_run(None, make_view)
    grad, (host, reloaded) = _strided_run(ActivationStash(torch.device("cpu"), []), make_view)
    view = make_view(torch.empty(6, 16, 12))
    if host_strides(view) == view.stride():  # dense
        assert host == reloaded == strides  # exact strides, on the host and back
    else:
        order = sorted(range(view.dim()), key=lambda i: -view.stride(i))
        assert sorted(range(view.dim()), key=lambda i: -host[i]) == order
        assert host == reloaded
    assert torch.equal(grad, expected)


def test_host_strides_of_dense_non_dense_and_overlapping_tensors() -> None:
    t = torch.empty(4, 5, 6)
    assert host_strides(t) == (30, 6, 1)
    assert host_strides(t.transpose(0, 2)) == (1, 6, 30)  # dense: its own strides
    assert host_strides(t[:, :2]) == (12, 6, 1)  # a slice: dense, same order
    assert host_strides(t.transpose(1, 2)[:, :3]) == (15, 1, 3)
    assert host_strides(torch.empty(4, 1).expand(4, 8)) is None  # overlapping: resident
    stash = ActivationStash(torch.device("cpu"), [])
    big = torch.randn(4, 1, requires_grad=True).expand(4, 64)
    assert stash._pack(big) is big and stash.slots == []


# ------------------------------------------------------------------------------------------------
# The step's host syncs: the stop vote, batch copies


def _stats_trainer():
    from mlaunch.trainer import loop

    tr = loop.Trainer.__new__(loop.Trainer)  # just what _reduce_stats reads
    tr.topo = SimpleNamespace(distributed=False, world_size=1, dp=1)
    tr.state = loop.TrainState()
    grad = torch.tensor([3.0, 4.0])
    tr.grads, tr.norm_grads = SimpleNamespace(flat=grad), [grad]
    tr.stop_flag = loop.StopFlag()
    tr.ctx = SimpleNamespace(p2p=SimpleNamespace(after_sync=lambda: None))
    tr._stop_vote = tr._slow_vote = None
    tr.recorder_slow, tr.recorder_trigger = False, None
    return tr


def test_the_stop_vote_is_filled_on_the_device_not_copied_from_the_host(monkeypatch) -> None:
    tr = _stats_trainer()
    loss = torch.tensor(2.5)

    def host_tensor(*args, **kwargs):
        raise AssertionError("torch.tensor in the stats: on a GPU a blocking host-to-device copy")

    monkeypatch.setattr(torch, "tensor", host_tensor)
    assert tr._reduce_stats(loss) == (5.0, 2.5, False)
    vote = tr._stop_vote
    assert vote is not None and vote.device == loss.device and vote.dtype == torch.float64
    tr.stop_flag.signal = 15
    assert tr._reduce_stats(loss)[2] is True
    assert tr._stop_vote is vote  # made once, filled in place every step
    # the flight recorder's slow flag rides on the same reduce, filled on the device likewise
    tr.recorder_slow = True
    tr._reduce_stats(loss)
    assert tr.recorder_trigger == "slow_iteration" and tr._slow_vote.device == loss.device
    assert tr._reduce_stats(None)[1] == 0.0


def test_batches_are_pinned_before_their_non_blocking_copies_on_cuda_only(monkeypatch) -> None:
    from mlaunch.trainer.device import batch_to_device

    pinned: set[int] = set()
    copies: list[tuple[bool, str, bool]] = []

    def pin_memory(self):
        out = self.clone()
        pinned.add(id(out))
        return out

    def to(self, device, non_blocking=False):
        copies.append((id(self) in pinned, str(device), non_blocking))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    batch = [torch.zeros(2, 4, dtype=torch.int64), torch.ones(2, 4, dtype=torch.int64)]
    out = batch_to_device(batch, torch.device("cuda", 1))
    assert copies == [(True, "cuda:1", True)] * 2 and len(out) == 2
    copies.clear()
    pinned.clear()
    batch_to_device(batch, torch.device("cpu"))  # no CUDA: nothing pinned (it would fail)
    assert copies == [(False, "cpu", False)] * 2 and not pinned
