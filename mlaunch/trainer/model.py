"""A GPT decoder, built as one pipeline stage's share of the layers.

Stage 0 owns the token and position embeddings, the last stage owns the final norm and the LM head
(tied to the input embedding by default, like Megatron-LM), and every stage owns
``num_layers / pp`` pre-norm blocks. Weights are initialised from (seed, global parameter name), so
a model split over any number of stages starts bit-identical to the unsplit one.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from mlaunch import telemetry
from mlaunch.model.gpt_shape import GPTConfig
from mlaunch.model.groups import SpanGroup
from mlaunch.model.spans import Attr, SpanName


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (
            z.view(b, t, self.num_heads, c // self.num_heads).transpose(1, 2) for z in (q, k, v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size)
        self.proj = nn.Linear(4 * cfg.hidden_size, cfg.hidden_size)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block; ``layer_number`` is global and 1-based, as in Megatron."""

    def __init__(self, cfg: GPTConfig, layer_number: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden_size)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)  # identity at 0, and in eval()
        # Built once: the span call sits on the per-layer hot path.
        self._span_attrs = {Attr.LAYER_NUMBER.value: layer_number}

    def forward(self, x):
        span = telemetry.device_span  # one attribute lookup for the three spans
        with span(SpanGroup.LAYER, SpanName.LAYER_FORWARD, self._span_attrs):
            with span(SpanGroup.LAYER, SpanName.LAYER_SELF_ATTENTION):
                x = x + self.dropout(self.attn(self.ln1(x)))
            with span(SpanGroup.LAYER, SpanName.LAYER_MLP):
                x = x + self.dropout(self.mlp(self.ln2(x)))
        return x


class GPTStage(nn.Module):
    """The layers of pipeline stage ``stage`` of ``pp`` (the whole model when ``pp == 1``)."""

    def __init__(self, cfg: GPTConfig, stage: int = 0, pp: int = 1) -> None:
        super().__init__()
        self.cfg = cfg
        self.is_first = stage == 0
        self.is_last = stage == pp - 1
        per_stage = cfg.num_layers // pp
        self.layer_offset = stage * per_stage
        if self.is_first:
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.pos_emb = nn.Embedding(cfg.seq_length, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, self.layer_offset + i + 1) for i in range(per_stage))
        if self.is_last:
            self.norm = nn.LayerNorm(cfg.hidden_size)
            # A tied head on a stage without the embedding keeps its own copy of the embedding
            # matrix; the trainer sums the two copies' gradients so they stay identical.
            if not cfg.tie_embeddings or not self.is_first:
                self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def tied_copy(self) -> nn.Parameter | None:
        """The last stage's copy of the tied embedding (PP > 1, tied), else None."""
        if self.cfg.tie_embeddings and self.is_last and not self.is_first:
            return self.head.weight
        return None

    def global_name(self, name: str) -> str:
        """The parameter's name in the unsplit model (what the initialisation is keyed on)."""
        if name.startswith("layers."):
            _, idx, rest = name.split(".", 2)
            return f"layers.{int(idx) + self.layer_offset}.{rest}"
        if name == "head.weight" and self.cfg.tie_embeddings:
            return "tok_emb.weight"
        return name

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2 initialisation, each tensor drawn from its own generator keyed on its global
        name, so the result does not depend on how the layers are split into stages."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.num_layers)
        for name, p in self.named_parameters():
            gname = self.global_name(name)
            g = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(gname.encode()))
            if gname.endswith(".bias"):
                value = torch.zeros(p.shape)
            elif ".ln" in gname or gname.startswith("norm."):
                value = torch.ones(p.shape)
            else:
                std = residual_std if gname.endswith("proj.weight") else 0.02
                value = torch.randn(p.shape, generator=g) * std
            p.copy_(value)

    def forward(self, x, targets=None):
        """Stage 0 takes token ids, later stages the previous stage's hidden states. The last
        stage returns the mean cross-entropy against ``targets`` (or logits without them)."""
        if self.is_first:
            pos = torch.arange(x.shape[1], device=x.device)
            h = self.tok_emb(x) + self.pos_emb(pos)
        else:
            h = x
        for layer in self.layers:
            h = layer(h)
        if not self.is_last:
            return h
        h = self.norm(h)
        weight = self.head.weight if hasattr(self, "head") else self.tok_emb.weight
        logits = F.linear(h, weight)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
