"""Span-spec resolution: Megatron-LM's rules, the '-name' extension, and errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlaunch.model import PRESETS, SpanGroup, SpanSpecError, format_groups, resolve
from mlaunch.model.spec import VALID_WORDS, closest_word

WORDS = list(VALID_WORDS)


def reference_resolve(spec: str) -> frozenset[str]:
    """Megatron-LM / nemo-lens ``MegatronSpanGroup.resolve`` semantics, written out plainly:
    comma-split, strip, lower-case, skip empties, union of presets and groups, unknown = error."""
    out: set[str] = set()
    for part in spec.split(","):
        word = part.strip().lower()
        if not word:
            continue
        if word in PRESETS:
            out |= {g.value for g in PRESETS[word]}
        elif word in {g.value for g in SpanGroup}:
            out.add(word)
        else:
            raise ValueError(word)
    return frozenset(out)


def test_single_words() -> None:
    assert resolve("default") == PRESETS["default"]
    assert resolve("layer") == {SpanGroup.LAYER}
    assert resolve("") == frozenset()
    assert resolve(" , ,") == frozenset()


def test_union_of_presets_and_groups() -> None:
    assert resolve("default,microbatch") == PRESETS["default"] | {SpanGroup.MICROBATCH}


def test_exclusion_removes_after_all_additions() -> None:
    assert resolve("all,-layer") == PRESETS["all"] - {SpanGroup.LAYER}
    assert resolve("-layer,all") == resolve("all,-layer")
    assert resolve("all,-per_step") == PRESETS["all"] - PRESETS["per_step"]
    assert resolve("layer,-layer") == frozenset()


@pytest.mark.parametrize(
    ("spec", "bad", "suggestion"),
    [
        ("per_stepp", "per_stepp", "per_step"),
        ("default, layr", "layr", "layer"),
        ("all,-layers", "-layers", "layer"),
        ("zzzz", "zzzz", None),
        # Megatron-LM's --otel-span-groups help names a preset `full`; none exists
        ("full", "full", "all"),
        ("per_step, FULL", "FULL", "all"),
        ("all,-full", "-full", "all"),
        ("all,-", "-", None),
    ],
)
def test_errors_name_the_bad_part_and_suggest(spec: str, bad: str, suggestion: str | None) -> None:
    with pytest.raises(SpanSpecError) as info:
        resolve(spec)
    assert info.value.part == bad
    assert info.value.suggestion == suggestion
    message = str(info.value)
    assert repr(bad) in message
    assert "per_step" in message and "trace_region" in message  # lists the valid words
    if suggestion:
        assert f"did you mean {suggestion!r}" in message


parts = st.lists(st.sampled_from(WORDS), min_size=0, max_size=8)
decorate = st.sampled_from([str.upper, str.lower, str.title, lambda w: f"  {w}\t", lambda w: w])


@given(parts, st.randoms())
def test_resolution_ignores_order(words: list[str], rnd) -> None:
    shuffled = list(words)
    rnd.shuffle(shuffled)
    assert resolve(",".join(words)) == resolve(",".join(shuffled))


@given(st.lists(st.tuples(st.sampled_from(WORDS), decorate), max_size=8))
def test_resolution_ignores_case_and_whitespace(items) -> None:
    plain = ",".join(w for w, _ in items)
    fancy = ",".join(f(w) for w, f in items)
    assert resolve(fancy) == resolve(plain)


@given(parts, parts)
def test_resolution_is_idempotent(adds: list[str], removes: list[str]) -> None:
    spec = ",".join(adds + [f"-{w}" for w in removes])
    once = resolve(spec)
    assert resolve(format_groups(once)) == once


@given(parts, st.sampled_from(WORDS))
def test_excluding_y_never_leaves_y(adds: list[str], y: str) -> None:
    result = resolve(",".join([*adds, f"-{y}"]))
    assert not (result & resolve(y))


@given(parts)
def test_matches_the_reference_without_the_extension(words: list[str]) -> None:
    spec = ",".join(words)
    assert {g.value for g in resolve(spec)} == reference_resolve(spec)


@given(st.text(max_size=30))
def test_arbitrary_text_either_resolves_or_raises_a_spec_error(text: str) -> None:
    try:
        result = resolve(text)
    except SpanSpecError as exc:
        assert exc.part
    else:
        assert result <= PRESETS["all"]


def test_closest_word_takes_a_stricter_cutoff() -> None:
    names = ["OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER"]
    assert closest_word("OTEL_SERVICE_NAM", names, cutoff=0.85) == "OTEL_SERVICE_NAME"
    assert closest_word("OTEL_SERV", names) == "OTEL_SERVICE_NAME"  # close enough at 0.6
    assert closest_word("OTEL_SERV", names, cutoff=0.85) is None
