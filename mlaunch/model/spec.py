"""Span-group spec resolution (``MEGATRON_OTEL_SPAN_GROUPS``, ``--otel-span-groups``)."""

from __future__ import annotations

import difflib

from mlaunch.model.groups import PRESETS, SpanGroup

_GROUP_NAMES: frozenset[str] = frozenset(g.value for g in SpanGroup)
#: Every word a spec part may be (without the ``-`` exclusion prefix), presets first.
VALID_WORDS: tuple[str, ...] = tuple(PRESETS) + tuple(g.value for g in SpanGroup)

#: Words that are neither a group nor a preset but that a user has good reason to type, and the
#: word they mean. Megatron-LM's own ``--otel-span-groups`` help names a preset ``full`` that does
#: not exist (nemo-lens raises on it too); ``all`` is what it means. They are refused all the same
#: (mlaunch and nemo-lens must read a spec alike), only with the right "did you mean": edit
#: similarity alone does not reach ``all`` from ``full``.
MISNAMED_WORDS: dict[str, str] = {"full": "all"}

#: Longest bad part quoted in full in an error message; longer ones are cut (``.part`` keeps all).
_SHOWN_PART = 60


def quoted(text: str, limit: int = _SHOWN_PART) -> str:
    """``repr(text)``, cut to ``limit`` characters plus the full length when longer, so a
    10,000-character value does not become a 10,000-character error line."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[: limit - 3]!r}... ({len(text)} characters)"


class SpanSpecError(ValueError):
    """A span-group spec has a part that is neither a group nor a preset."""

    def __init__(self, part: str, suggestion: str | None) -> None:
        self.part = part
        self.suggestion = suggestion
        hint = f" (did you mean {suggestion!r}?)" if suggestion else ""
        super().__init__(
            f"unknown span group or preset {quoted(part)}{hint}; valid words: {', '.join(VALID_WORDS)}"
            " (prefix a word with '-' to exclude it)"
        )


def closest_word(
    word: str, candidates: tuple[str, ...] | list[str], cutoff: float = 0.6
) -> str | None:
    """The closest candidate to ``word`` by edit similarity, or None when none is at least
    ``cutoff`` similar (0..1; difflib's ratio)."""
    matches = difflib.get_close_matches(word, candidates, n=1, cutoff=cutoff)
    return matches[0] if matches else None


def _groups_of(word: str, original: str) -> frozenset[SpanGroup]:
    if word in PRESETS:
        return PRESETS[word]
    if word in _GROUP_NAMES:
        return frozenset({SpanGroup(word)})
    raise SpanSpecError(original, MISNAMED_WORDS.get(word) or closest_word(word, list(VALID_WORDS)))


def resolve(spec: str) -> frozenset[SpanGroup]:
    """Resolve a comma-separated spec of presets and groups into the set of enabled groups.

    Parts are stripped and lower-cased; empty parts are ignored; the result is the union of all
    parts. mlaunch's extension: a part ``-word`` removes that group or preset's groups after all
    additions, so order never matters. Without ``-`` parts the result equals Megatron-LM's
    ``MegatronSpanGroup.resolve``. Raises :class:`SpanSpecError` naming the first bad part.
    """
    added: set[SpanGroup] = set()
    removed: set[SpanGroup] = set()
    for raw in spec.split(","):
        part = raw.strip().lower()
        if not part:
            continue
        if part.startswith("-"):
            word = part[1:].strip()
            if not word:
                raise SpanSpecError(raw.strip(), None)
            removed |= _groups_of(word, raw.strip())
        else:
            added |= _groups_of(part, raw.strip())
    return frozenset(added - removed)


def format_groups(groups: frozenset[SpanGroup] | set[SpanGroup]) -> str:
    """The groups in catalogue order, comma separated (a canonical, re-resolvable spec)."""
    return ",".join(g.value for g in SpanGroup if g in groups)
