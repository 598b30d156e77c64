"""Config lookup for ``--config``: a TOML path, else the name of a shipped config."""

from __future__ import annotations

import tomllib
from pathlib import Path

from mlaunch.configs import CONFIGS_DIR
from mlaunch.model.spec import quoted
from mlaunch.settings import Problem, SettingsError

#: The config ``mlaunch train`` runs without ``--config``.
DEFAULT_CONFIG = "tiny"


def shipped_configs() -> list[str]:
    """The names of the shipped configs (``--config NAME``)."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.toml"))


def resolve_config(value: str | None, cwd: Path) -> Path:
    """The config file for ``--config VALUE``: a path, else a shipped config's name.

    A bare name (no directory part) that is not a file in ``cwd`` names a shipped config, with or
    without ``.toml``. Raises :class:`SettingsError` naming ``--config``.
    """
    name = DEFAULT_CONFIG if value is None else value
    try:
        given = Path(name).expanduser()
        path = given if given.is_absolute() else cwd / given
        if path.is_file():
            return path
        if len(given.parts) == 1:
            shipped = CONFIGS_DIR / (name if name.endswith(".toml") else f"{name}.toml")
            if shipped.is_file():
                return shipped
        is_dir = path.is_dir()
    except (OSError, RuntimeError) as exc:  # name too long, bad ~user, ...: not a usable path
        raise SettingsError(
            [Problem("--config", f"{quoted(name)}: {os_reason(exc)}", "unreadable")]
        ) from None
    if is_dir:
        raise SettingsError(
            [
                Problem(
                    "--config",
                    f"{str(path)!r} is a directory, not a TOML config file",
                    "unreadable",
                )
            ]
        )
    from mlaunch.model.spec import closest_word

    shipped_names = shipped_configs()
    close = closest_word(name.removesuffix(".toml"), shipped_names)
    hint = f" (did you mean {close!r}?)" if close else ""
    raise SettingsError(
        [
            Problem(
                "--config",
                f"no config file {quoted(name)} and no shipped config of that name{hint};"
                f" shipped: {', '.join(shipped_names)}",
                "unknown",
                close,
            )
        ]
    )


def os_reason(exc: BaseException) -> str:
    """An OS error as its reason alone (``File name too long``), without the repeated path."""
    return getattr(exc, "strerror", None) or str(exc)


def config_launch_keys(path: Path) -> set[str]:
    """The ``[launch]`` keys a config file sets (unreadable files: none; load_settings reports)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return set()
    launch = data.get("launch")
    return set(launch) if isinstance(launch, dict) else set()
