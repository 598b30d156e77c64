"""The sources of a configuration: flags, the environment, a TOML file. Each holds the values it
gives as a tree and, per dotted path, where each came from (:class:`Source`)."""

from __future__ import annotations

import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from mlaunch.configs import is_shipped
from mlaunch.envcontract import FALLBACK_PREFIX, PRIMARY_PREFIX
from mlaunch.model.spec import closest_word, quoted
from mlaunch.settings.names import ALIAS_KEYS, OTEL_ENV, TELEMETRY_KEYS, flag_name
from mlaunch.settings.problems import Problem
from mlaunch.settings.schema import SECTIONS, Source
from mlaunch.settings.values import TRUE_WORDS


class Layer:
    """A source holding a nested dict and, per dotted path, where each value came from."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}  # dotted path -> raw value
        self.origin: dict[str, Source] = {}

    def set(self, path: str, value: Any, origin: Source) -> None:
        self.values[path] = value
        self.origin[path] = origin

    def tree(self) -> dict[str, Any]:
        """The values as nested dicts, as the model takes them."""
        tree: dict[str, Any] = {}
        for path, value in self.values.items():
            *parents, leaf = path.split(".")
            node = tree
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        return tree


class FlagSource(Layer):
    """Command-line flags: ``{dotted path: value}``; ``None`` means not given."""

    def __init__(self, flags: Mapping[str, Any]) -> None:
        super().__init__()
        for path, value in flags.items():
            if value is not None:
                self.set(path, value, Source("flag", flag_name(path)))


class EnvSource(Layer):
    """``MEGATRON_OTEL_*`` with ``NEMO_LENS_*`` fallback, plus the standard ``OTEL_*`` variables.

    Collects problems (typos, conflicting aliases) in ``problems`` instead of raising, so every
    problem of a configuration is reported at once.
    """

    def __init__(self, environ: Mapping[str, str]) -> None:
        super().__init__()
        self.problems: list[Problem] = []
        valid = list(TELEMETRY_KEYS) + list(ALIAS_KEYS)
        for name in sorted(environ):
            for prefix in (PRIMARY_PREFIX, FALLBACK_PREFIX):
                if name.startswith(prefix) and name[len(prefix) :] not in valid:
                    close = closest_word(name[len(prefix) :], valid)
                    meant = prefix + close if close else None
                    hint = f"did you mean {meant}? " if meant else ""
                    self.problems.append(
                        Problem(
                            name,
                            f"unknown variable; {hint}valid keys: {', '.join(valid)}",
                            "unknown",
                            meant,
                        )
                    )
        for key, field in TELEMETRY_KEYS.items():
            found = self._lookup(environ, key)
            if found is not None:
                var, value = found
                if var.endswith("SAMPLING_STRATEGY"):
                    value = self._sampling_strategy(var, value)
                    if value is None:
                        continue
                self.set(f"telemetry.{field}", value, Source("env", var))
        for var, (section, field) in OTEL_ENV.items():
            value = environ.get(var, "").strip()
            if value:
                self.set(f"{section}.{field}", value, Source("env", var))

    def _lookup(self, environ: Mapping[str, str], key: str) -> tuple[str, str] | None:
        aliases = [a for a, target in ALIAS_KEYS.items() if target == key]
        for prefix in (PRIMARY_PREFIX, FALLBACK_PREFIX):
            given = [
                (prefix + k, environ[prefix + k].strip())
                for k in [key, *aliases]
                if environ.get(prefix + k, "").strip()
            ]
            if not given:
                continue
            if len(given) > 1 and len({self._norm(k, v) for k, v in given}) > 1:
                shown = " and ".join(f"{k}={v!r}" for k, v in given)
                self.problems.append(
                    Problem(given[0][0], f"conflicts with its alias: {shown}; set one", "conflict")
                )
            return given[0]
        return None

    @staticmethod
    def _norm(var: str, value: str) -> str:
        if var.endswith("SAMPLING_STRATEGY"):
            return "true" if value.lower() == "rank_aware" else "false"
        if var.endswith("SAMPLER_ENABLED"):
            return "true" if value.lower() in TRUE_WORDS else "false"
        return value.lower()

    def _sampling_strategy(self, var: str, value: str) -> str | None:
        v = value.lower()
        if v == "rank_aware":
            return "true"
        if v in ("none", "off", "default"):
            return "false"
        self.problems.append(
            Problem(var, f"unknown sampling strategy {value!r}; use rank_aware or none")
        )
        return None


class FileSource(Layer):
    """A TOML config file; unknown sections and keys are problems with a did-you-mean."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.problems: list[Problem] = []
        self.path = path
        #: One of mlaunch's shipped configs (``--config tiny``, or none given): its values are
        #: mlaunch's defaults, not the user's choice (see ``loading``).
        self.shipped = is_shipped(path)
        try:
            # utf-8-sig: an editor's byte-order mark (Windows Notepad) is not TOML, but not an error.
            data = tomllib.loads(path.read_text(encoding="utf-8-sig"))
        except FileNotFoundError:
            self.problems.append(Problem(str(path), "config file not found", "unreadable"))
            return
        except (OSError, UnicodeDecodeError) as exc:
            self.problems.append(
                Problem(str(path), f"cannot read config file ({exc})", "unreadable")
            )
            return
        except tomllib.TOMLDecodeError as exc:
            self.problems.append(Problem(str(path), f"not valid TOML: {exc}", "unreadable"))
            return
        self._walk(path, data, "", None)

    def _walk(
        self, path: Path, data: Mapping[str, Any], prefix: str, model: type[BaseModel] | None
    ) -> None:
        for key, value in data.items():
            if model is None:  # top level: keys are sections
                where, known, what = f"{path} [{key}]", list(SECTIONS), "section"
            else:
                where, known, what = (
                    f"{path} [{prefix.rstrip('.')}] {key}",
                    list(model.model_fields),
                    "key",
                )
            if key not in known:
                close = closest_word(key, known)
                hint = f" (did you mean {close!r}?)" if close else ""
                self.problems.append(
                    Problem(
                        where, f"unknown {what}{hint}; valid: {', '.join(known)}", "unknown", close
                    )
                )
                continue
            sub = SECTIONS[key] if model is None else _submodel(model.model_fields[key])
            if (
                sub is None
                and isinstance(value, bool)
                and model is not None
                and not _mentions_bool(model.model_fields[key].annotation)
            ):
                # pydantic would take true as 1 (``train_iters = true`` ran one iteration).
                self.problems.append(
                    Problem(
                        where, f"expected a number or text, got a boolean ({str(value).lower()})"
                    )
                )
                continue
            if (
                sub is None
                and isinstance(value, str)
                and _looks_numeric(value)
                and model is not None
                and _is_number_only(model.model_fields[key].annotation)
            ):
                # Refused like a boolean: TOML has numbers, and a quoted one is usually a
                # mistake (pydantic would convert it silently).
                self.problems.append(
                    Problem(
                        where,
                        f"expected a number, got text {quoted(value)}; write it without quotes:"
                        f" {key} = {value.strip()}",
                    )
                )
                continue
            if sub is None:
                self.set(f"{prefix}{key}", value, Source("file", where))
            elif isinstance(value, dict):
                self._walk(path, value, f"{prefix}{key}.", sub)
            else:
                self.problems.append(Problem(where, f"expected a table ([{prefix}{key}])"))


def _mentions_bool(annotation: Any) -> bool:
    """Whether a field's annotation accepts a boolean (``bool``, ``Bool``, ``Bool | None``)."""
    if annotation is bool:
        return True
    return any(_mentions_bool(arg) for arg in typing.get_args(annotation))


def _looks_numeric(text: str) -> bool:
    """Whether ``text`` reads as a number (``"30"``, ``"1e-4"``; not ``"two"``)."""
    try:
        float(text.strip().replace("_", ""))
    except ValueError:
        return False
    return True


def _is_number_only(annotation: Any) -> bool:
    """Whether a field takes numbers and no text (``int``, ``float``, ``int | None``)."""
    if annotation is str:
        return False
    args = typing.get_args(annotation)
    if args:
        return any(_is_number_only(a) for a in args) and not any(a is str for a in args)
    return annotation in (int, float)


def _submodel(field_or_model: Any) -> type[BaseModel] | None:
    if isinstance(field_or_model, type) and issubclass(field_or_model, BaseModel):
        return field_or_model
    ann = getattr(field_or_model, "annotation", None)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    return None
