"""Value parsers shared by every source and section: booleans, ``k=v`` lists, URLs, paths."""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator

#: The words a boolean setting takes, in any case (pydantic alone would also take t/y/f/n).
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def parse_bool(value: Any) -> Any:
    """``1/true/yes/on`` and ``0/false/no/off`` in any case; anything else is an error (pydantic
    alone would also take ``t``, ``y``, ``f``, ``n``)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        v = value.strip().lower()
        if v in TRUE_WORDS:
            return True
        if v in FALSE_WORDS:
            return False
    raise ValueError(f"expected a boolean (1/true/yes/on or 0/false/no/off), got {value!r}")


Bool = Annotated[bool, BeforeValidator(parse_bool)]


def parse_key_values(value: Any, what: str, *, secret: bool = False) -> dict[str, str]:
    """``k1=v1,k2=v2`` (URL-encoded values) as used by OTEL_RESOURCE_ATTRIBUTES / _HEADERS.

    ``secret``: a malformed entry is named by its position only (it may hold a token)."""
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    out: dict[str, str] = {}
    for n, item in enumerate(str(value).split(","), 1):
        if not item.strip():
            continue
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            shown = f"#{n} (not shown: a secret)" if secret else repr(item.strip())
            raise ValueError(f"malformed {what} entry {shown}: expected key=value")
        out[urllib.parse.unquote(key.strip())] = urllib.parse.unquote(val.strip())
    return out


def check_url(value: str | None) -> str | None:
    if value is None:
        return None
    from mlaunch.endpoints import parse_endpoint

    parse_endpoint(value)  # EndpointError (a ValueError) with a redacted message
    return value.strip()


def not_blank(value: str | None) -> str | None:
    """Reject an empty or blank text value: for a path or a name, ``""`` is never meant (``--script
    ""`` used to launch mlaunch's own trainer, ``--save ""`` reached the workers)."""
    if value is not None and not value.strip():
        raise ValueError("must not be empty (omit it to use the default)")
    return value


def path_is(check: Any, path: str) -> bool:
    """``check(Path(path))``, with an unusable path (a 5,000-character name: ENAMETOOLONG, which
    pathlib re-raises) counting as "no" instead of escaping as an OSError traceback."""
    try:
        return bool(check(Path(path)))
    except OSError:
        return False


#: An OTLP export timeout above this many seconds is almost surely milliseconds (older docs and
#: other SDKs give OTEL_EXPORTER_OTLP_TIMEOUT in ms; the Python SDK reads seconds).
LONG_OTLP_TIMEOUT_S = 600.0


def otlp_timeout_warning(name: str, seconds: float) -> tuple[str, str] | None:
    """``(what is wrong, the fix)`` for an OTLP export timeout of ``seconds`` given as ``name``
    (a variable, flag or config key) that looks like milliseconds; None when it is plausible."""
    if seconds <= LONG_OTLP_TIMEOUT_S:
        return None
    # A variable, a flag, or a config file's "FILE [section] key".
    sep = "=" if name.isupper() else " " if name.startswith("--") else " = "
    return (
        f"{name}{sep}{seconds:g} looks like milliseconds, but the Python SDK reads seconds: each"
        f" export to an unreachable collector would wait {seconds:,.0f} s"
        f" ({seconds / 3600:.1f} h)",
        f"set {name}{sep}{seconds / 1000:g} (seconds)",
    )


def module_problem(name: str, cwd: Path) -> str | None:
    """Why ``python -m name`` run in ``cwd`` would not find the module (None: it would).

    The search is the import system's, without executing anything: no package's
    ``__init__.py`` runs (``importlib.util.find_spec`` of a dotted name imports the parents,
    which would run user code in a dry run). A worker's ``python -m`` puts its working
    directory first on ``sys.path``, so ``cwd`` is searched first; then this interpreter's
    finders (the workers' interpreter is this one)."""
    import importlib.machinery
    import sys

    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        return f"{name!r} is not a module name (dotted Python identifiers, e.g. pkg.train)"
    spec: Any = None
    for depth, part in enumerate(parts):
        full = ".".join(parts[: depth + 1])
        if full in sys.modules and getattr(sys.modules[full], "__spec__", None) is not None:
            spec = sys.modules[full].__spec__
            continue
        if depth == 0:
            spec = importlib.machinery.PathFinder.find_spec(part, [str(cwd)])
            for finder in sys.meta_path if spec is None else ():
                find = getattr(finder, "find_spec", None)
                if (spec := find(part, None) if find else None) is not None:
                    break
        else:
            where = spec.submodule_search_locations
            if where is None:
                return f"{'.'.join(parts[:depth])!r} is a module, not a package: it has no {part!r}"
            spec = importlib.machinery.PathFinder.find_spec(full, list(where))
        if spec is None:
            return f"no module named {full!r} from {cwd} (the workers run `python -m {name}` there)"
    if spec.submodule_search_locations is not None:
        main = importlib.machinery.PathFinder.find_spec(
            f"{name}.__main__", list(spec.submodule_search_locations)
        )
        if main is None:
            return f"{name!r} is a package without __main__.py: `python -m` cannot run it"
    return None


#: Signals a process cannot catch: naming one as a preemption signal is a mistake.
_UNCATCHABLE = frozenset({"SIGKILL", "SIGSTOP"})


def preempt_signals(
    spec: str | tuple[str, ...] | None, environ: dict[str, str] | os._Environ[str] | None = None
) -> tuple[str, ...]:
    """The graceful-stop signal names: ``spec`` (the flag), else ``$MLAUNCH_PREEMPT_SIGNALS``,
    else SIGTERM, plus SIGUSR1 under SLURM (its warning before the time limit, with
    ``--signal=USR1@<s>``). Names may omit ``SIG`` and any case; raises ValueError naming a bad one."""
    import signal

    from mlaunch.envcontract import PREEMPT_SIGNALS

    if isinstance(spec, tuple):  # already parsed (validate may run twice on one namespace)
        return spec
    env = os.environ if environ is None else environ
    text = spec if spec is not None else env.get(PREEMPT_SIGNALS, "").strip()
    if not text:
        return ("SIGTERM", "SIGUSR1") if env.get("SLURM_JOB_ID") else ("SIGTERM",)
    names: list[str] = []
    for part in text.split(","):
        word = part.strip().upper()
        if not word:
            continue
        name = word if word.startswith("SIG") else "SIG" + word
        if name in _UNCATCHABLE:
            raise ValueError(
                f"{part.strip()!r} cannot be caught by a process; use e.g. SIGTERM,SIGUSR1"
            )
        if not isinstance(getattr(signal, name, None), signal.Signals) or name.startswith("SIG_"):
            raise ValueError(f"{part.strip()!r} is not a signal name; use e.g. SIGTERM,SIGUSR1")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"{text!r} names no signal; use e.g. SIGTERM,SIGUSR1")
    return tuple(names)
