"""Sampling: a greedy completion of a held-out prompt through the pipeline, the text an
evaluation shows (``--sample-tokens``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from mlaunch import telemetry
from mlaunch.model.groups import SpanGroup as G
from mlaunch.model.spans import Attr, text_completion_name
from mlaunch.trainer.data import TokenData, decode
from mlaunch.trainer.model import GPTStage
from mlaunch.trainer.parallel import P2P, Topology

PROMPT_TOKENS = 16  # text-completion prompt length (held-out bytes)


def model_display_name(args: argparse.Namespace) -> str:
    """The model's name in GenAI spans (``gen_ai.request.model``)."""
    return f"mlaunch-gpt-{args.num_layers}l-{args.hidden_size}h"


@torch.no_grad()
def complete(
    model: GPTStage,
    p2p: P2P,
    autocast: Callable[[], Any],
    data: TokenData,
    args: argparse.Namespace,
    topo: Topology,
) -> str | None:
    """Greedy completion of a held-out prompt, through the pipeline, inside a GenAI
    ``text_completion <model>`` span: a root span of its own (GenAI convention; the catalogue
    gives it no parent), with nothing traced below it. Returns the text on the last stage."""
    model_name = model_display_name(args)
    prompt_len = min(PROMPT_TOKENS, args.seq_length - 1)
    tokens = data.prompt(prompt_len).tolist()
    attrs = {
        Attr.GEN_AI_OPERATION: "text_completion",
        Attr.GEN_AI_REQUEST_MODEL: model_name,
        Attr.GEN_AI_INPUT_TOKENS: prompt_len,
        Attr.GEN_AI_OUTPUT_TOKENS: args.sample_tokens,
    }
    name = text_completion_name(model_name)
    with telemetry.span(G.INFERENCE, name, attrs, root=True), telemetry.suppressed():
        for _ in range(args.sample_tokens):
            window = tokens[-args.seq_length :]
            # Right-padded to the fixed shape the P2P buffers expect; causal attention keeps
            # the padding from influencing the positions that matter.
            x = torch.zeros((1, args.seq_length), dtype=torch.int64, device=topo.device)
            x[0, : len(window)] = torch.tensor(window, device=topo.device)
            h = p2p.recv_forward(0)
            with autocast():
                out = model(x if model.is_first else h, None)
            nxt = None
            if model.is_last:
                nxt = out[0, len(window) - 1].argmax().reshape(1)
            else:
                p2p.send_forward(out)
            if topo.pp > 1 and (topo.is_first_stage or topo.is_last_stage):
                nxt = p2p.exchange_token(nxt)
            tokens.append(int(nxt.item()) if nxt is not None else 0)
    return decode(tokens[prompt_len:]) if topo.is_last_stage else None
