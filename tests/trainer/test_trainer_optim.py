"""The trainer's AdamW: torch's arithmetic to the bit, torch's checkpoint layout, and no compiler.

It replaces ``torch.optim.AdamW`` only because every torch optimizer imports ``torch._dynamo`` (about
2 CPU-seconds a rank); these tests hold it to being the same optimizer otherwise.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mlaunch.trainer.optim import AdamW


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8)
    )


def _groups(model: torch.nn.Module, wd: float) -> list[dict]:
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": wd},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _train(model: torch.nn.Module, opt, steps: range, lrs=None) -> list[float]:
    losses = []
    for i in steps:
        g = torch.Generator().manual_seed(1000 + i)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
        for p in model.parameters():
            p.grad = None
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs(i)
        opt.step()
        losses.append(loss.item())
    return losses


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_steps_are_torchs_adamw_to_the_bit(wd: float) -> None:
    ours, theirs = _model(0), _model(0)
    kw = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8}
    schedule = lambda i: 3e-3 * (1 - i / 40)  # noqa: E731 - the lr changes every step, as the trainer's
    a = _train(ours, AdamW(_groups(ours, wd), **kw), range(25), schedule)
    b = _train(theirs, torch.optim.AdamW(_groups(theirs, wd), **kw), range(25), schedule)
    assert a == b
    assert _same_weights(ours, theirs)


def test_a_torch_adamw_checkpoint_resumes_here_and_ours_resumes_there() -> None:
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
    straight = _model(1)
    _train(straight, torch.optim.AdamW(_groups(straight, 0.05), **kw), range(20))

    # Ten steps with torch's, the state through a save (as the trainer writes it), ten with ours.
    first = _model(1)
    torch_opt = torch.optim.AdamW(_groups(first, 0.05), **kw)
    _train(first, torch_opt, range(10))
    saved = torch.load(_roundtrip(torch_opt.state_dict()), weights_only=True)
    ours = AdamW(_groups(first, 0.05), lr=0.5)  # the saved settings win over these
    ours.load_state_dict(saved)
    _train(first, ours, range(10, 20))
    assert _same_weights(first, straight)

    # And back: our state dict loads into torch's optimizer and carries on the same.
    back = _model(1)
    ours = AdamW(_groups(back, 0.05), **kw)
    _train(back, ours, range(10))
    torch_opt = torch.optim.AdamW(_groups(back, 0.05), **kw)
    torch_opt.load_state_dict(torch.load(_roundtrip(ours.state_dict()), weights_only=True))
    _train(back, torch_opt, range(10, 20))
    assert _same_weights(back, straight)


def test_a_checkpoint_of_another_model_is_refused_by_name() -> None:
    small = torch.nn.Linear(4, 4)
    opt = AdamW([{"params": list(small.parameters())}], lr=1e-3)
    other = AdamW(_groups(_model(0), 0.1), lr=1e-3)
    with pytest.raises(ValueError, match="other parameter groups"):
        opt.load_state_dict(other.state_dict())


def test_building_and_stepping_it_imports_no_compiler() -> None:
    code = (
        "import sys, torch\n"
        "from mlaunch.trainer.optim import AdamW\n"
        "m = torch.nn.Linear(4, 4)\n"
        "opt = AdamW([{'params': list(m.parameters())}], lr=1e-3)\n"
        "m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.load_state_dict(opt.state_dict())\n"
        "print(sorted(n for n in sys.modules if n.startswith('torch._dynamo')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _roundtrip(state: dict):
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf
