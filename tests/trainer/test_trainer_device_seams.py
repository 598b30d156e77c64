"""The CPU seams of what a GPU machine needs (issue 15): device-timed spans resolved at the step's
sync point (host clock, and a fake event class for the resolution arithmetic), deferred links,
CUDA RNG per device with a fake device, the ``--device cuda`` refusal, the parameter filter of
activation offload (views and autocast casts), gradient buckets launched during backward, and
the shared-save-directory check with two "nodes" on one machine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.trainer_runs import TINY, clean_env

from mlaunch import envcontract, telemetry
from mlaunch.telemetry import _devicetime, _spans
from mlaunch.trainer.offload import ActivationStash, ParameterFilter
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
    from mlaunch.trainer import loop

    calls: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda d: calls.append(("get", d)) or "S")
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d: calls.append(("set", s, d)))
    dev = torch.device("cuda", 1)
    assert loop.cuda_rng_state(dev) == "S" and calls == [("get", dev)]
    calls.clear()
    loop.restore_cuda_rng("S", dev, print)
    assert calls == [("set", "S", dev)]
    # An old checkpoint (one state per visible GPU) saved on 2 GPUs, resumed where the worker's GPU
    # is index 1: its own entry; resumed on GPU 3: no entry, a line, the RNG stays as seeded.
    calls.clear()
    loop.restore_cuda_rng(["A", "B"], dev, print)
    assert calls == [("set", "B", dev)]
    calls.clear()
    lines: list[str] = []
    loop.restore_cuda_rng(["A", "B"], torch.device("cuda", 3), lines.append)
    assert calls == [] and "none for GPU 3" in lines[0]
    assert loop.cuda_rng_state(torch.device("cpu")) is None
    loop.restore_cuda_rng("S", torch.device("cpu"), print)  # a GPU checkpoint resumed on CPU
    assert calls == []


def test_device_cuda_is_checked_against_cuda_and_the_gpu_count() -> None:
    env = {envcontract.DEVICE: "cuda", "LOCAL_WORLD_SIZE": "4"}
    assert "sees no CUDA device" in device_problem(env, lambda: False, lambda: 0)
    assert "sees 2 GPU(s)" in device_problem(env, lambda: True, lambda: 2)
    assert device_problem(env, lambda: True, lambda: 4) is None
    assert device_problem({}, lambda: False, lambda: 0) is None  # auto
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
