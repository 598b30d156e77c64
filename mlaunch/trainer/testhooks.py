"""The trainer's test hooks: faults a test injects through ``MLAUNCH_TEST_*`` variables
(:mod:`mlaunch.envcontract` names them; the launcher never sets them). Each costs one environment
lookup per iteration when unset. Their names keep the underscore they had in the recipe: they
are no trainer API, and a failure's traceback names them (a test reads ``_maybe_fail`` there).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from mlaunch import envcontract


def _maybe_poison(iteration: int, flat_grads: torch.Tensor) -> None:
    """The test hook MLAUNCH_TEST_NAN_AT_ITERATION=k: a NaN gradient at iteration k, before the
    all-reduce, as a real overflow would arrive."""
    at = os.environ.get(envcontract.NAN_AT_ITERATION)
    if at and int(at) == iteration:
        flat_grads[0] = float("nan")


def _maybe_fail(iteration: int, rank: int) -> None:
    """The test hook: MLAUNCH_TEST_FAIL_AT_ITERATION=k (and optionally MLAUNCH_TEST_FAIL_RANK=r)."""
    at = os.environ.get(envcontract.FAIL_AT_ITERATION)
    if not at or int(at) != iteration:
        return
    only = os.environ.get(envcontract.FAIL_RANK)
    if only is None or only == "" or int(only) == rank:
        raise RuntimeError(
            f"injected failure at iteration {iteration} on rank {rank} ({envcontract.FAIL_AT_ITERATION})"
        )


def _maybe_slow(iteration: int, rank: int) -> None:
    """The test hook: MLAUNCH_TEST_SLOW_AT_ITERATION=k (and optionally MLAUNCH_TEST_SLOW_RANK=r)
    makes iteration k sleep 2 s on that rank, for the flight recorder's slow trigger."""
    at = os.environ.get(envcontract.SLOW_AT_ITERATION)
    if not at or int(at) != iteration:
        return
    only = os.environ.get(envcontract.SLOW_RANK)
    if not only or int(only) == rank:
        time.sleep(2.0)


def _maybe_pause() -> None:
    """The test hook MLAUNCH_TEST_ITERATION_PAUSE=S: every iteration sleeps S seconds, so an
    open-ended test job idles between its few ms of compute instead of training flat out."""
    pause = os.environ.get(envcontract.ITERATION_PAUSE)
    if pause:
        time.sleep(float(pause))


def _slow_forward_hook(iteration: int, rank: int) -> Callable[[int], None] | None:
    """The test hook MLAUNCH_TEST_SLOW_FORWARD_AT=k,k,... (and optionally MLAUNCH_TEST_SLOW_RANK=r):
    a 1 s sleep inside the first microbatch's forward of those iterations, so a straggler is late
    in a known phase. None (no call per microbatch) when it does not apply."""
    at = os.environ.get(envcontract.SLOW_FORWARD_AT)
    if not at or iteration not in {int(k) for k in at.split(",") if k.strip()}:
        return None
    only = os.environ.get(envcontract.SLOW_RANK)
    if only and int(only) != rank:
        return None
    return lambda microbatch: time.sleep(1.0) if microbatch == 0 else None
