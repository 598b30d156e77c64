"""Property-based fuzzing of the span-spec parser (hypothesis).

For any text, :func:`mlaunch.model.spec.resolve` either returns a frozenset of span groups or
raises :class:`SpanSpecError` naming one bad part of the spec: never another exception. Specs built
from valid words resolve to exactly the union of the added words minus the excluded ones, in any
order, case and spacing. ``mlaunch groups resolve`` agrees with the parser and never shows a
traceback.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from mlaunch.cli import build_app
from mlaunch.model.groups import PRESETS, SpanGroup
from mlaunch.model.spec import VALID_WORDS, SpanSpecError, format_groups, quoted, resolve

FUZZ = settings(
    max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)

#: A spec part: a valid word, a near miss, or anything at all (unicode, separators, blanks).
valid_word = st.sampled_from(VALID_WORDS)
near_miss = valid_word.map(lambda w: w[:-1] + "x")
part = st.one_of(
    valid_word,
    valid_word.map(lambda w: "-" + w),
    near_miss,
    st.text(max_size=12),
    st.sampled_from(["", " ", "-", "--all", "- layer", "\u200b", "défault", "ALL", "\t"]),
)
spec_text = st.one_of(st.text(max_size=200), st.lists(part, max_size=8).map(",".join))


def groups_of(word: str) -> frozenset[SpanGroup]:
    """The groups one valid word stands for."""
    return PRESETS[word] if word in PRESETS else frozenset({SpanGroup(word)})


@FUZZ
@given(spec_text)
def test_any_text_resolves_to_groups_or_names_the_bad_part(spec: str) -> None:
    try:
        result = resolve(spec)
    except SpanSpecError as exc:
        parts = [raw.strip() for raw in spec.split(",")]
        assert exc.part in parts, (exc.part, parts)
        assert exc.part.strip(), "an empty part is ignored, never an error"
        assert quoted(exc.part) in str(exc)
        bare = exc.part.lower().removeprefix("-").strip()
        assert bare not in VALID_WORDS, "a valid word was rejected"
        return
    assert isinstance(result, frozenset)
    assert all(isinstance(g, SpanGroup) for g in result)


@FUZZ
@given(
    adds=st.lists(valid_word, max_size=6),
    removes=st.lists(valid_word, max_size=3),
    upper=st.lists(st.booleans(), min_size=9, max_size=9),
    pad=st.sampled_from(["", " ", "  ", "\t"]),
    order=st.randoms(use_true_random=False),
)
def test_valid_words_resolve_to_union_minus_exclusions_in_any_order_and_case(
    adds: list[str], removes: list[str], upper: list[bool], pad: str, order
) -> None:
    words = adds + ["-" + w for w in removes]
    words = [w.upper() if u else w for w, u in zip(words, upper + [False] * 9, strict=False)]
    order.shuffle(words)
    spec = ",".join(pad + w + pad for w in words) + ("," if pad else "")
    expected = frozenset().union(*map(groups_of, adds)) - frozenset().union(
        *map(groups_of, removes)
    )
    assert resolve(spec) == expected
    assert resolve(format_groups(expected)) == expected  # the canonical form round-trips


@settings(max_examples=60, deadline=None, database=None)
@given(spec_text)
def test_groups_resolve_agrees_with_the_parser_and_never_crashes(spec: str) -> None:
    # "--" so a spec starting with "-" ("-layer") is the argument, not an option.
    result = CliRunner().invoke(build_app("groups"), ["groups", "resolve", "--json", "--", spec])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert "Traceback" not in result.output
    try:
        expected = resolve(spec)
    except SpanSpecError:
        assert result.exit_code == 2, result.output
        return
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["groups"] == [g.value for g in SpanGroup if g in expected]
