"""Ranks that share span and trace ids (nemo-lens 0.1.0 on data-parallel ranks seeded alike,
Lens #28): every reader keys spans by rank as well as id, through the span store and the JSON
reader alike, at volume. The real nemo-lens pair: tests/integration/test_lens_shared_ids.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.shared_ids import check_every_reader, rank_spans, shared_ids
from support.synthetic_traces import write_realistic_run

RANKS, STEPS = 4, 600


@pytest.mark.slow
def test_ranks_with_identical_ids_are_read_apart_by_every_reader(tmp_path: Path) -> None:
    run = tmp_path / "run"
    total = write_realistic_run(
        run, ranks=RANKS, steps=STEPS, pp=1, microbatches=2, layers=2, seed=28,
        ckpt_every=100, eval_every=150, seeded_alike=True,
    )  # fmt: skip
    spans = rank_spans(run)
    assert total > 50_000
    assert len(shared_ids(spans)) == len(spans[0])  # every id of a rank is every other rank's
    summary = check_every_reader(run, tmp_path, links_per_rank=1)
    assert summary["shared_root_ids"] == 2  # the start-up and the train block of each rank


def test_ranks_with_their_own_ids_get_no_note(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_realistic_run(run, ranks=2, steps=20, pp=1, microbatches=2, layers=2, seed=28)
    assert not shared_ids(rank_spans(run))
    assert check_every_reader(run, tmp_path, links_per_rank=1)["shared_root_ids"] == 0


def test_a_link_resolves_on_its_own_rank_else_on_the_one_rank_that_has_the_id() -> None:
    from mlaunch.trace.links import LinkTargets

    t: LinkTargets[str] = LinkTargets()
    t.add(0, "a", "rank 0's a")
    t.add(1, "a", "rank 1's a")
    t.add(2, "b", "rank 2's b")
    assert t.resolve(1, "a") == "rank 1's a"  # a train block's link to its own rank's block
    assert t.resolve(0, "b") == "rank 2's b"  # a pipeline receive's link to its sender
    assert t.resolve(3, "a") is None  # two other ranks have it: which one cannot be told
    assert t.resolve(0, "c") is None
