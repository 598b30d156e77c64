"""Every setting as a flag, generated from the settings model: ``mlaunch train`` and ``mlaunch
sbatch`` take the same ones, so a new settings field is one edit in :mod:`mlaunch.settings`.

Flags are taken as text and converted by the settings layer, so a bad value is reported like
every other problem (``--num-layers: ...``, exit 2) rather than by Click. A boolean setting
gets ``--flag`` and a hidden ``--no-flag``.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

import typer
from pydantic_core import PydanticUndefined

from mlaunch.cli.errors import PlainErrorsCommand, fail
from mlaunch.settings import CHOICES, SECTIONS, flag_name
from mlaunch.settings.schema import attribute_docs

_PANELS = {
    "launch": "Launch (torchrun)",
    "telemetry": "Telemetry (MEGATRON_OTEL_*)",
    "telemetry.otel": "OpenTelemetry (OTEL_*)",
    "model": "Model",
    "training": "Training",
    "parallelism": "Parallelism",
}


def _fields(prefix: str, model: Any) -> list[tuple[str, Any, Any]]:
    """``(path, field, the model that holds it)`` of every setting under ``model``."""
    out: list[tuple[str, Any, Any]] = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and hasattr(ann, "model_fields"):
            out += _fields(f"{prefix}.{name}", ann)
        else:
            out.append((f"{prefix}.{name}", info, model))
    return out


@functools.cache
def _all_fields() -> list[tuple[str, Any, Any]]:
    return [field for section, model in SECTIONS.items() for field in _fields(section, model)]


def setting_paths() -> list[tuple[str, Any]]:
    """Every settings path with its pydantic field, in section order."""
    return [(path, info) for path, info, _ in _all_fields()]


def _docstring(path: str, model: Any) -> str:
    """The setting's attribute docstring (its help text)."""
    return attribute_docs(model).get(path.rsplit(".", 1)[1], "")


def _leaf_types(ann: Any) -> list[Any]:
    if typing.get_origin(ann) is typing.Annotated:
        return _leaf_types(typing.get_args(ann)[0])
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return [t for a in typing.get_args(ann) for t in _leaf_types(a) if t is not type(None)]
    return [ann]


def _metavar(ann: Any) -> tuple[bool, str]:
    """(is a boolean flag, metavar) for a field annotation."""
    leaves = _leaf_types(ann)
    if bool in leaves:
        return True, ""
    leaf = leaves[0] if leaves else str
    if typing.get_origin(leaf) is Literal:
        # The names go in the help text: a wide metavar column cut option names at 80 columns.
        return False, "NAME"
    if typing.get_origin(leaf) is dict or leaf is dict:
        return False, "K=V,..."
    return False, {int: "INT", float: "FLOAT"}.get(leaf, "TEXT")


def _literal_choices(ann: Any) -> tuple[str, ...]:
    """The names a Literal field takes (empty for other fields)."""
    leaves = _leaf_types(ann)
    if leaves and typing.get_origin(leaves[0]) is Literal:
        return tuple(map(str, typing.get_args(leaves[0])))
    return ()


def _param_name(path: str) -> str:
    """The command parameter of the setting at ``path``."""
    return "s__" + path.replace(".", "__")


def _shown(value: Any) -> str:
    """A default as ``--help`` shows it ('' for none worth showing)."""
    if value is None or value is PydanticUndefined or callable(value):
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str | int | float):
        return str(value)
    if isinstance(value, frozenset | set | tuple | list) and value:
        return ",".join(sorted(map(str, value)))
    return ""


@functools.cache
def default_config_values() -> tuple[str, dict[str, Any]]:
    """(file name, {dotted path: value}) of the config plain ``mlaunch train`` runs: its values,
    not the schema's, are the defaults a plain run uses ('', {} when it cannot be read: the run
    itself reports that)."""
    import tomllib

    from mlaunch.launcher.configs import CONFIGS_DIR, DEFAULT_CONFIG

    path = CONFIGS_DIR / f"{DEFAULT_CONFIG}.toml"
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return "", {}

    def flat(prefix: str, table: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in table.items():
            dotted = f"{prefix}.{key}" if prefix else key
            out.update(flat(dotted, value) if isinstance(value, dict) else {dotted: value})
        return out

    return path.name, flat("", data)


def _default_text(path: str, info: Any) -> str:
    """`` (default: X)`` (not ``[...]``: Rich markup would eat it): the value plain ``mlaunch
    train`` uses, its default config's where that sets it (with the schema's, for a config that
    leaves it out); '' for unset ones."""
    schema = _shown(info.default)
    name, values = default_config_values()
    if path in values:
        plain = _shown(values[path])
        if plain == schema:
            return f" (default: {plain})"
        return f" (default: {plain} from {name}" + (f", else {schema})" if schema else ")")
    return f" (default: {schema})" if schema else ""


def setting_parameters() -> list[inspect.Parameter]:
    """One keyword parameter per setting (and a hidden negative one per boolean setting), for a
    command's signature."""
    params = []
    for path, info, model in _all_fields():
        is_bool, metavar = _metavar(info.annotation)
        flag = flag_name(path)
        panel = _PANELS[
            "telemetry.otel" if path.startswith("telemetry.otel.") else path.split(".")[0]
        ]
        # Field docstrings use reST ``literals`` and hard line breaks; --help shows flowing text.
        help_text = " ".join(_docstring(path, model).replace("``", "").split())
        if choices := CHOICES.get(path) or _literal_choices(info.annotation):
            help_text += f" One of: {', '.join(choices)}."
        help_text += _default_text(path, info)
        if is_bool:
            # One visible name per flag: a second column of --no-... names left too little
            # room at 80 columns and Rich cut option names (--otlp-traces-sa...). The negative
            # form still works, hidden, and the help says so.
            negative = f"--no-{flag.removeprefix('--')}"
            option = typer.Option(
                None, flag, help=f"{help_text} ({negative} turns it off.)",
                rich_help_panel=panel, show_default=False,
            )  # fmt: skip
            params.append(
                inspect.Parameter(
                    _negative_name(path),
                    inspect.Parameter.KEYWORD_ONLY,
                    default=typer.Option(None, negative, hidden=True),
                    annotation=bool | None,
                )  # fmt: skip
            )
            ann: Any = bool | None
        else:
            option = typer.Option(
                None, flag, help=help_text, metavar=metavar, rich_help_panel=panel,
                show_default=False,
            )  # fmt: skip
            ann = str | None
        params.append(
            inspect.Parameter(
                _param_name(path), inspect.Parameter.KEYWORD_ONLY, default=option, annotation=ann
            )
        )
    return params


def _negative_name(path: str) -> str:
    """The command parameter of a boolean setting's hidden ``--no-`` flag."""
    return "n__" + path.replace(".", "__")


def given_settings(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The command's setting parameters by settings path (None where a flag was not given)."""
    paths = {_param_name(path): path for path, _ in setting_paths()}
    return {paths[k]: v for k, v in kwargs.items() if k in paths}


def apply_negative_flags(kwargs: dict[str, Any], flags: dict[str, Any]) -> None:
    """Set each boolean setting whose ``--no-`` flag was given to False in ``flags``; a setting
    given both ways exits 2 naming both."""
    for path, _ in setting_paths():
        if kwargs.get(_negative_name(path)):
            if flags.get(path):
                name = flag_name(path)
                raise fail([(name, f"{name} and --no-{name[2:]} exclude each other")])
            flags[path] = False


def passthrough_parameter() -> tuple[str, Any, Any]:
    """``[-- ARGS]``: what goes to the entry point unchanged (last in a command's own list)."""
    return (
        "args",
        list[str] | None,
        typer.Argument(
            None, metavar="[-- ARGS]", help="Passed unchanged to the entry point.",
            show_default=False,
        ),
    )  # fmt: skip


def register_command(
    app: typer.Typer,
    name: str,
    command: Callable[..., None],
    own: list[tuple[str, Any, Any]],
) -> None:
    """Add ``command`` to ``app`` as ``name`` taking its ``own`` (name, annotation, default)
    parameters followed by every setting flag; it receives them all as keyword arguments."""
    kw = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter(p, kw, default=d, annotation=a) for p, a, d in own]
    signature = inspect.Signature(params + setting_parameters())
    command.__signature__ = signature  # type: ignore[attr-defined]
    app.command(
        name, cls=PlainErrorsCommand, context_settings={"help_option_names": ["-h", "--help"]}
    )(command)
