"""The model's shape and size, without torch: the byte-level vocabulary, the configuration of
the GPT, and its exact parameter count.

Below the trainer and the doctor alike (standard library only): the trainer builds its model
from :class:`GPTConfig`; the launcher side (doctor's checkpoint size estimate) counts the same
parameters here without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Byte-level tokens: every byte value is a token.
VOCAB_SIZE = 256


@dataclass(frozen=True)
class GPTConfig:
    """Model shape."""

    num_layers: int
    hidden_size: int
    num_heads: int
    seq_length: int
    vocab_size: int = VOCAB_SIZE
    tie_embeddings: bool = True
    hidden_dropout: float = 0.0  # no parameters: not part of the count


def gpt_config(shape: Any, hidden_dropout: float = 0.0) -> GPTConfig:
    """The GPT's shape from anything that names it with Megatron-LM's arguments
    (``num_layers``, ``hidden_size``, ``num_attention_heads``, ``seq_length``,
    ``untie_embeddings``): the trainer's parsed arguments, or the settings' model section."""
    return GPTConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_heads=shape.num_attention_heads,
        seq_length=shape.seq_length,
        tie_embeddings=not shape.untie_embeddings,
        hidden_dropout=hidden_dropout,
    )


def count_parameters(cfg: GPTConfig) -> int:
    """Parameters of the whole (unsplit) model, exactly as the trainer builds it.

    Per layer: qkv and output projections (4h² + 4h), the MLP (8h² + 5h) and two layer norms
    (4h); then the token and position embeddings, the final norm (2h), and a head matrix only
    when it is not tied to the token embedding.
    """
    h, L = cfg.hidden_size, cfg.num_layers
    per_layer = 12 * h * h + 13 * h
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * h
    return L * per_layer + cfg.vocab_size * h + cfg.seq_length * h + 2 * h + head


def train_flops_per_token(cfg: GPTConfig) -> int:
    """Forward and backward FLOPs per token: 6N for the weights (N: :func:`count_parameters`),
    plus the attention scores (12 x layers x hidden size x sequence length)."""
    return 6 * count_parameters(cfg) + 12 * cfg.num_layers * cfg.hidden_size * cfg.seq_length
