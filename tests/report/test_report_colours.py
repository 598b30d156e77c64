"""The report's group colours come from the one group definition: every group has its own."""

from __future__ import annotations

from mlaunch.model.groups import GROUPS, SpanGroup
from mlaunch.trace.report.style import GROUP_COLOURS, OTHER_GROUP, group_order


def test_every_group_has_a_colour_of_its_own_and_other_comes_last() -> None:
    assert list(GROUP_COLOURS) == [str(g) for g in GROUPS] + [OTHER_GROUP]
    assert set(GROUPS) == set(SpanGroup)
    assert len(set(GROUP_COLOURS.values())) == len(GROUP_COLOURS)
    assert group_order(OTHER_GROUP) == len(GROUPS)
    assert group_order("a-user-script's-group") == len(GROUPS) + 1
