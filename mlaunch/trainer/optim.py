"""AdamW with decoupled weight decay, written out instead of ``torch.optim.AdamW``, and the
learning-rate schedule (:func:`lr_at`).

Why not torch's: every ``torch.optim.Optimizer`` imports ``torch._dynamo`` the first time it adds
a parameter group (its methods are wrapped to keep the compiler out), and that import costs each
rank about 2 CPU-seconds and some 100 MB at startup, as much as ``import torch`` itself, for a
trainer that never compiles. The update is the same arithmetic as torch's AdamW, op for op, in the
order of its single-tensor path (``torch._foreach_*`` ops, which on a CPU run that path's kernels
one tensor at a time and on CUDA are the multi-tensor kernels torch would pick there), so CPU
losses are bit-identical to it. :meth:`state_dict` has torch's layout, so checkpoints saved with
``torch.optim.AdamW`` resume here and the other way round.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["AdamW", "build_optimizer", "lr_at"]


class AdamW:
    """AdamW over parameter groups (dicts with ``params`` and optional ``weight_decay``/``lr``)."""

    def __init__(
        self,
        groups: Iterable[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        self.param_groups: list[dict[str, Any]] = []
        for group in groups:
            params = list(group["params"])
            self.param_groups.append({**defaults, **group, "params": params})
        # Per parameter, as torch keeps it: the step count (a float32 scalar on the CPU) and the
        # two moments. Made at the first step, so a model that never steps holds no state.
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if p not in self.state:
                    self.state[p] = {
                        "step": torch.tensor(0.0, dtype=torch.float32),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }
            self._update(group, params)

    def _update(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        lr, (beta1, beta2), eps, wd = (
            group["lr"], group["betas"], group["eps"], group["weight_decay"],
        )  # fmt: skip
        states = [self.state[p] for p in params]
        grads = [p.grad for p in params]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1)
        if wd != 0:
            torch._foreach_mul_(params, 1 - lr * wd)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        # The bias corrections from each parameter's own count, as floats: torch's arithmetic.
        counts = [s.item() for s in steps]
        step_sizes = [-(lr / (1 - beta1**n)) for n in counts]
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denoms, [(1 - beta2**n) ** 0.5 for n in counts])
        torch._foreach_add_(denoms, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denoms, step_sizes)

    # ---- checkpoints, in torch.optim's layout -----------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        index: dict[torch.Tensor, int] = {}
        groups = []
        for group in self.param_groups:
            ids = []
            for p in group["params"]:
                index[p] = len(index)
                ids.append(index[p])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, **_TORCH_FLAGS,
                           "params": ids})  # fmt: skip
        state = {index[p]: dict(s) for p, s in self.state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Take a :meth:`state_dict` (or ``torch.optim.AdamW``'s): the groups' settings and each
        parameter's state, moved to the parameter's device and dtype (the step stays a CPU float).
        """
        groups = saved["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            len(g["params"]) != len(mine["params"])
            for g, mine in zip(groups, self.param_groups, strict=True)
        ):
            raise ValueError(
                "the optimizer state in the checkpoint has other parameter groups than this model"
            )
        state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for g, mine in zip(groups, self.param_groups, strict=True):
            for key in ("lr", "betas", "eps", "weight_decay"):
                mine[key] = tuple(g[key]) if key == "betas" else g[key]
            for i, p in zip(g["params"], mine["params"], strict=True):
                s = saved["state"].get(i)
                if s is None:
                    continue
                state[p] = {
                    "step": s["step"].detach().to(torch.float32, copy=True).cpu(),
                    "exp_avg": s["exp_avg"].to(device=p.device, dtype=p.dtype, copy=True),
                    "exp_avg_sq": s["exp_avg_sq"].to(device=p.device, dtype=p.dtype, copy=True),
                }
        self.state = state


#: The settings ``torch.optim.AdamW`` writes into each saved group besides the hyperparameters,
#: with the values this update amounts to: a checkpoint from here loads there unchanged.
_TORCH_FLAGS: dict[str, Any] = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}


def build_optimizer(params: list[torch.Tensor], args: argparse.Namespace) -> AdamW:
    """The trainer's AdamW over ``params``: weight decay on the matrices only (biases and norms
    have none, as in Megatron-LM), Megatron's betas and eps, ``--lr`` until :func:`lr_at` sets
    each step's rate."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def lr_at(args: argparse.Namespace, iteration: int) -> float:
    """Linear warm-up to ``--lr``, then cosine decay to ``--min-lr`` at ``--train-iters``."""
    if args.lr_warmup_iters and iteration <= args.lr_warmup_iters:
        return args.lr * iteration / args.lr_warmup_iters
    span = max(1, args.train_iters - args.lr_warmup_iters)
    ratio = min(1.0, (iteration - args.lr_warmup_iters) / span)
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)
