"""What a checkpoint restores besides its files' layout (:mod:`mlaunch.trainer.checkpoint`): the
training state (iteration, data position, skipped iterations, the fp16 loss scale), and one
stage's whole checkpoint state (model, optimizer, schedule, RNGs, model shape) with its restore.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mlaunch.trainer.device import cuda_rng_state, restore_cuda_rng
from mlaunch.trainer.optim import AdamW, lr_at
from mlaunch.trainer.parallel import Topology


@dataclass
class TrainState:
    iteration: int = 0  # iterations completed
    consumed_samples: int = 0  # the data position
    skipped_iters: int = 0
    loss_scale: float = 1.0
    good_steps: int = 0  # fp16: finite steps since the loss scale last changed

    @classmethod
    def fresh(cls, args: argparse.Namespace) -> TrainState:
        """The state before the first iteration (fp16 starts its loss scale at 2**16)."""
        return cls(loss_scale=2.0**16 if args.fp16 else 1.0)

    def update_loss_scale(self, skipped: bool) -> None:
        """fp16 dynamic loss scaling: halve on overflow, double after 1000 clean steps."""
        if skipped:
            self.loss_scale = max(1.0, self.loss_scale / 2)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps % 1000 == 0:
                self.loss_scale *= 2


def architecture(args: argparse.Namespace, topo: Topology) -> dict[str, Any]:
    """The model shape and pipeline size a checkpoint was saved for (a resume must match)."""
    return {
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "seq_length": args.seq_length,
        "num_attention_heads": args.num_attention_heads,
        "pipeline_stages": topo.pp,
        "tied": not args.untie_embeddings,
    }


def checkpoint_state(
    state: TrainState,
    model: torch.nn.Module,
    optimizer: AdamW,
    args: argparse.Namespace,
    topo: Topology,
) -> dict[str, Any]:
    """This stage's checkpoint (Megatron-LM's keys), every tensor copied to the host."""

    def cpu(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().to("cpu", copy=True)
        if isinstance(x, dict):
            return {k: cpu(v) for k, v in x.items()}
        if isinstance(x, list):
            return [cpu(v) for v in x]
        return x

    s = state
    return {
        "iteration": s.iteration,
        "model": cpu(model.state_dict()),
        "optimizer": cpu(optimizer.state_dict()),
        "scheduler": {"iteration": s.iteration, "lr": lr_at(args, max(1, s.iteration))},
        "loss_scaler": {"scale": s.loss_scale, "good_steps": s.good_steps},
        "data": {"consumed_samples": s.consumed_samples, "seed": args.seed},
        "skipped_iters": s.skipped_iters,
        "rng": {
            "python": random.getstate(),
            "torch": torch.get_rng_state(),
            "cuda": cuda_rng_state(topo.device),
        },
        "arch": architecture(args, topo),
    }


def restore_checkpoint_state(
    ckpt: dict[str, Any],
    where: str,
    state: TrainState,
    model: torch.nn.Module,
    optimizer: AdamW,
    args: argparse.Namespace,
    topo: Topology,
    log: Callable[[str], None],
) -> None:
    """Load :func:`checkpoint_state`'s ``ckpt`` (read from ``where``) into the model, optimizer,
    state and RNGs; a checkpoint of another shape is refused."""
    arch = architecture(args, topo)
    if ckpt["arch"] != arch:
        raise ValueError(
            f"checkpoint in {where} was saved for {ckpt['arch']}, but this run is "
            f"{arch}; resume with the same model shape and pipeline size"
        )
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    s = state
    s.iteration = ckpt["iteration"]
    s.consumed_samples = ckpt["data"]["consumed_samples"]
    s.skipped_iters = ckpt["skipped_iters"]
    s.loss_scale = ckpt["loss_scaler"]["scale"]
    s.good_steps = ckpt["loss_scaler"]["good_steps"]
    random.setstate(ckpt["rng"]["python"])
    torch.set_rng_state(ckpt["rng"]["torch"])
    restore_cuda_rng(ckpt["rng"]["cuda"], topo.device, log)
