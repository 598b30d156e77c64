"""How a worker's spans are split into traces: the one rule, as code and as one sentence.

The trainer, the telemetry runtime, its flight recorder and the launch summary compute blocks
with :func:`block_iterations`; the ``--otel-trace-segment-iters`` help, ``mlaunch groups list``,
the span tree and the docs say :data:`TRACE_SEGMENTS`. Three descriptions had drifted apart (one
said a block per save interval, one every N, none that saves win).
"""

from __future__ import annotations

#: Iterations per trace of a run that does not save periodically, unless set.
DEFAULT_SEGMENT_ITERS = 100

#: The rule in one sentence: every description of trace segmentation is this text.
TRACE_SEGMENTS = (
    "Start-up is one trace per worker start; training starts a new trace (a megatron.train"
    " block) every --save-interval iterations when the run saves periodically, else every"
    " --otel-trace-segment-iters iterations."
)


def block_iterations(save_interval: int | None, segment_iters: int | None) -> int:
    """Iterations per ``megatron.train`` block (each a trace), by :data:`TRACE_SEGMENTS`:
    ``save_interval`` when the run saves periodically (pass 0 or None when it does not save,
    whatever its ``--save-interval``), else ``segment_iters``."""
    if save_interval and save_interval > 0:
        return int(save_interval)
    return max(1, int(segment_iters or DEFAULT_SEGMENT_ITERS))


def train_block(iteration: int, block_iters: int) -> int:
    """The ``megatron.train`` block of a (1-based) iteration: iterations 1..N are block 0, so the
    save after iteration N (N = save_interval) still belongs to block 0, as in Megatron-LM."""
    return max(0, iteration - 1) // max(1, block_iters)
