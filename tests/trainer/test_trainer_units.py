"""The trainer's pieces in one process, no torchrun: data determinism, stage splitting, the LR
schedule, checkpoint verification and fallback, activation offload."""

from __future__ import annotations

import argparse
import json

import torch

from mlaunch.model.gpt_shape import GPTConfig, count_parameters
from mlaunch.settings.trainer_cli import build_parser, validate
from mlaunch.trainer import checkpoint
from mlaunch.trainer.data import TokenData, default_corpus, load_corpus
from mlaunch.trainer.model import GPTStage
from mlaunch.trainer.offload import ActivationStash
from mlaunch.trainer.optim import lr_at


def test_default_corpus_is_deterministic_and_capped():
    a, b = default_corpus(cap=200_000), default_corpus(cap=200_000)
    assert a == b and 150_000 < len(a) <= 200_000 + 10_000


def test_the_default_corpus_walk_is_the_order_of_the_sorted_paths(tmp_path):
    # The walk stops at the cap instead of sorting every path first: it must give the files in
    # the order the sorted relative paths did, names that sort around a folder's included
    # ("a-b" < "a.py" < "a/..." < "a0"), and skip what the full listing skipped.
    from mlaunch.trainer.data import _python_files_in_order

    names = [
        "a.py", "a-b.py", "a0.py", "a/b.py", "a/c/d.py", "a_b/x.py", "A.py", "z.txt",
        "site-packages/s.py", "x/test/t.py", "x/tests.py", "é.py",
    ]  # fmt: skip
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    (tmp_path / "link").symlink_to(tmp_path / "a")  # rglob did not follow a folder's link
    listed = sorted(
        (
            p for p in tmp_path.rglob("*.py")
            if not {"site-packages", "test"} & set(p.relative_to(tmp_path).parts)
        ),
        key=lambda p: p.relative_to(tmp_path).as_posix(),
    )  # fmt: skip
    assert list(_python_files_in_order(tmp_path)) == listed
    assert len(listed) == 9


def test_a_folder_is_read_in_sorted_order(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    assert load_corpus(str(tmp_path)) == b"first\nsecond"


def test_batches_depend_only_on_seed_and_index_and_dp_rows_partition_the_global_batch():
    data = TokenData(bytes(range(256)) * 50, seq_length=8, eval_fraction=0.1, seed=3)
    whole = data.batch(5, global_batch=8, first_row=0, micro=2, num_micro=4)
    again = data.batch(5, global_batch=8, first_row=0, micro=2, num_micro=4)
    half = data.batch(5, global_batch=8, first_row=4, micro=2, num_micro=2)
    assert all(torch.equal(x, y) for x, y in zip(whole.tokens, again.tokens, strict=True))
    assert torch.equal(torch.cat(half.tokens), torch.cat(whole.tokens[2:]))
    assert torch.equal(whole.tokens[0][:, 1:], whole.targets[0][:, :-1])  # next-token targets
    other = data.batch(6, global_batch=8, first_row=0, micro=2, num_micro=4)
    assert not torch.equal(torch.cat(other.tokens), torch.cat(whole.tokens))


def test_a_model_split_into_stages_computes_the_unsplit_loss():
    cfg = GPTConfig(num_layers=4, hidden_size=32, num_heads=4, seq_length=16)
    full = GPTStage(cfg)
    full.init_weights(7)
    stages = [GPTStage(cfg, s, 4) for s in range(4)]
    for st in stages:
        st.init_weights(7)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    h = x
    for st in stages[:-1]:
        h = st(h)
    assert torch.allclose(stages[-1](h, y), full(x, y))
    assert torch.equal(stages[-1].tied_copy, full.tok_emb.weight)  # the tied head copy


def test_the_parameter_count_is_the_built_models_exactly():
    for tied in (True, False):
        cfg = GPTConfig(
            num_layers=3, hidden_size=24, num_heads=4, seq_length=16, tie_embeddings=tied
        )
        built = sum(p.numel() for p in GPTStage(cfg).parameters())
        assert count_parameters(cfg) == built


def test_lr_warms_up_then_decays_to_min_lr():
    ns = argparse.Namespace(lr=1.0, min_lr=0.1, lr_warmup_iters=4, train_iters=20)
    assert [lr_at(ns, i) for i in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert lr_at(ns, 12) < lr_at(ns, 8) and abs(lr_at(ns, 20) - 0.1) < 1e-12


def _fake_checkpoint(root, iteration, payload=b"weights"):
    d = root / checkpoint.iter_dir_name(iteration)
    (d / "mp_rank_00").mkdir(parents=True)
    (d / "mp_rank_00" / checkpoint.MODEL_FILE).write_bytes(payload)
    import hashlib

    entry = {
        "path": f"mp_rank_00/{checkpoint.MODEL_FILE}",
        "size": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    (d / checkpoint.MANIFEST_FILE).write_text(json.dumps({"files": [entry]}))
    (root / checkpoint.TRACKER_FILE).write_text(str(iteration))
    return d


def test_loading_falls_back_past_torn_and_unfinished_checkpoints(tmp_path):
    _fake_checkpoint(tmp_path, 10)
    torn = _fake_checkpoint(tmp_path, 20)
    (torn / "mp_rank_00" / checkpoint.MODEL_FILE).write_bytes(b"weightz")  # same size, bad hash
    unfinished = _fake_checkpoint(tmp_path, 30)
    (unfinished / checkpoint.MANIFEST_FILE).unlink()
    (tmp_path / ".tmp.iter_0000040").mkdir()  # a crashed save: never a candidate
    logs: list[str] = []
    assert checkpoint.find_valid_checkpoint(tmp_path, logs.append) == 10
    assert "iter_0000030 is invalid: no manifest" in logs[0]
    assert "iter_0000020 is invalid" in logs[1] and "sha256" in logs[1]


def test_offloaded_activations_give_the_same_gradients():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8)
    layer(x).sum().backward()
    expected = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    stash = ActivationStash(torch.device("cpu"), layer.parameters())
    with stash.hooks():
        out = layer(x).sum()
    assert stash.slots  # activations were captured
    stash.offload()
    stash.reload()
    out.backward()
    assert all(torch.allclose(p.grad, e) for p, e in zip(layer.parameters(), expected, strict=True))


def test_validate_is_reusable_by_the_launcher():
    ns = build_parser().parse_args(["--pipeline-model-parallel-size", "2", "--num-layers", "4"])
    assert validate(ns, 8) == []
    assert ns.global_batch_size == 2 * 4


def test_memory_and_gpu_identity_are_cuda_only() -> None:
    """Memory is the CUDA peak since the last record (Megatron-LM's figure); a CPU rank records
    none and has no GPU identity."""
    from mlaunch.trainer.device import peak_memory_gb
    from mlaunch.trainer.setup import gpu_identity

    cpu = torch.device("cpu")
    assert peak_memory_gb(cpu) is None
    assert gpu_identity(cpu) == {}


def test_train_blocks_follow_save_interval_else_k() -> None:
    """Iterations 1..N are block 0 (the save after N belongs to it); without saves, N = K."""
    from types import SimpleNamespace

    from mlaunch.model.segments import train_block
    from mlaunch.trainer.setup import block_iters

    settings = SimpleNamespace(trace_segment_iters=100)
    saving = argparse.Namespace(save="ck", save_interval=2)
    assert block_iters(saving, settings) == 2
    assert block_iters(argparse.Namespace(save=None, save_interval=None), settings) == 100
    assert [train_block(it, 2) for it in range(1, 7)] == [0, 0, 1, 1, 2, 2]
