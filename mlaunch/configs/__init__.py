"""Ready-made ``mlaunch train`` configs (``--config NAME``), shipped as package data."""

from pathlib import Path

#: Where the shipped configs live. A config read from here is mlaunch's default, not the user's
#: choice: a value the user sets (a flag, a variable) wins over it (``mlaunch.settings``).
CONFIGS_DIR = Path(__file__).resolve().parent


def is_shipped(path: Path) -> bool:
    """Whether ``path`` is one of the shipped configs (its values are defaults)."""
    return path.resolve().parent == CONFIGS_DIR
