"""Problems with a configuration, as values: what the user typed, what is wrong, its kind and
the "did you mean" word, so the CLI and doctor render one shape."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

#: What went wrong, for a reader that acts on it (doctor): ``unknown`` a name that is not a
#: setting (a variable, a file key or section); ``invalid`` a value a setting refuses;
#: ``conflict`` settings that disagree with each other; ``unreadable`` a config file that cannot
#: be read or parsed.
ProblemKind = Literal["unknown", "invalid", "conflict", "unreadable"]


class Problem(tuple[str, str]):
    """One problem with a configuration, as a value: what the user typed (``field``), what is
    wrong and how to fix it (``message``), its ``kind``, and the "did you mean" word
    (``suggestion``, None when there is none).

    It is also the pair ``(field, message)``: it unpacks, indexes and compares as that pair, the
    shape every renderer prints as ``field: message`` (which ``str()`` gives).
    """

    kind: ProblemKind
    suggestion: str | None

    def __new__(
        cls,
        field: str,
        message: str,
        kind: ProblemKind = "invalid",
        suggestion: str | None = None,
    ) -> Problem:
        self = super().__new__(cls, (field, message))
        self.kind = kind
        self.suggestion = suggestion
        return self

    @property
    def field(self) -> str:
        """What the user typed: a flag, a variable, ``FILE [section] key``."""
        return self[0]

    @property
    def message(self) -> str:
        """What is wrong and how to fix it."""
        return self[1]

    def __getnewargs__(self) -> tuple[Any, ...]:  # type: ignore[override]
        # Pickling rebuilds through __new__: give it every argument, not the bare pair.
        return (self[0], self[1], self.kind, self.suggestion)

    def __str__(self) -> str:
        return f"{self[0]}: {self[1]}"

    def __repr__(self) -> str:
        return (
            f"Problem({self[0]!r}, {self[1]!r}, kind={self.kind!r}, suggestion={self.suggestion!r})"
        )


def as_problem(item: Problem | tuple[str, str]) -> Problem:
    """``item`` as a :class:`Problem` (a bare ``(field, message)`` pair is an ``invalid`` one)."""
    return item if isinstance(item, Problem) else Problem(item[0], item[1])


class SettingsError(ValueError):
    """Invalid configuration: one :class:`Problem` per problem, in ``problems``."""

    def __init__(self, problems: Iterable[Problem | tuple[str, str]]) -> None:
        self.problems: list[Problem] = [as_problem(p) for p in problems]
        super().__init__("\n".join(str(p) for p in self.problems))


class UnknownName(ValueError):
    """A value that is not one of a list of names, with the closest name (``suggestion``) for
    the :class:`Problem` a validator's error becomes."""

    def __init__(self, message: str, suggestion: str | None) -> None:
        super().__init__(message)
        self.suggestion = suggestion
