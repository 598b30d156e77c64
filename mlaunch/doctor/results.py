"""What every doctor check returns: a verdict (pass / warn / fail), a message and a one-line fix,
and the counts, JSON shape and exit code derived from a list of them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Literal

Status = Literal["pass", "warn", "fail"]
STATUSES: tuple[Status, ...] = ("pass", "warn", "fail")

#: Seconds a network probe (TCP connect, OTLP export, peer identification) may take.
NET_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True, slots=True)
class CheckResult:
    """One check's verdict: ``fix`` is a one-line remedy ("" when there is nothing to do)."""

    name: str
    status: Status
    message: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        """The JSON form: ``{"name", "status", "message", "fix"}``."""
        return {"name": self.name, "status": self.status, "message": self.message, "fix": self.fix}


def ok(name: str, message: str, fix: str = "") -> CheckResult:
    """A passing result."""
    return CheckResult(name, "pass", message, fix)


def warn(name: str, message: str, fix: str) -> CheckResult:
    """A warning: the run may start, but something is likely wrong."""
    return CheckResult(name, "warn", message, fix)


def fail(name: str, message: str, fix: str) -> CheckResult:
    """A failure: fix this before running."""
    return CheckResult(name, "fail", message, fix)


def summarize(results: Iterable[CheckResult]) -> dict[str, int]:
    """``{"pass": n, "warn": n, "fail": n}``."""
    counts = dict.fromkeys(STATUSES, 0)
    for r in results:
        counts[r.status] += 1
    return counts


def to_json(results: Sequence[CheckResult]) -> dict[str, Any]:
    """The pinned ``--json`` shape: ``{"checks": [...], "summary": {...}}``."""
    return {"checks": [r.to_dict() for r in results], "summary": summarize(results)}


def exit_code(results: Iterable[CheckResult]) -> int:
    """0 when nothing fails, 1 otherwise."""
    return 1 if any(r.status == "fail" for r in results) else 0
