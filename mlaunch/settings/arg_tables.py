"""The tables derived from the training settings' metadata (:mod:`.args`): which setting is
which argument of mlaunch's trainer and of Megatron-LM's scripts.

Above the schema (they read its sections), while the metadata classes are below it (the schema's
fields carry them), so neither module imports the other.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from mlaunch.settings.args import TRAINING_SECTIONS, Arg, NotPassed, arg_of
from mlaunch.settings.schema import SECTIONS

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo


def training_fields() -> Iterator[tuple[str, str, FieldInfo, Arg | NotPassed]]:
    """``(section, field name, field, its metadata)`` of every training setting, in order."""
    for section in TRAINING_SECTIONS:
        for name, info in SECTIONS[section].model_fields.items():
            yield section, name, info, arg_of(info)


def trainer_args() -> dict[str, str]:
    """Settings path -> the trainer's argument (``--bf16/--fp16`` for a choice of switches)."""
    return {
        f"{section}.{name}": "/".join(arg.flags(name))
        for section, name, _, arg in training_fields()
        if isinstance(arg, Arg)
    }


def not_trainer_args() -> dict[str, str]:
    """Settings path -> why mlaunch's trainer does not take it."""
    return {
        f"{section}.{name}": arg.why
        for section, name, _, arg in training_fields()
        if isinstance(arg, NotPassed)
    }


def megatron_only_args() -> dict[str, tuple[str, Any]]:
    """Settings path -> (Megatron-LM's argument, the default it is left out at), for settings
    mlaunch's trainer does not have."""
    return {
        f"{section}.{name}": (arg.megatron, info.default)
        for section, name, info, arg in training_fields()
        if isinstance(arg, NotPassed) and arg.megatron is not None
    }


def megatron_unknown() -> frozenset[str]:
    """Paths of trainer arguments Megatron-LM's pretrain_gpt.py would reject (mlaunch-only)."""
    return frozenset(
        f"{section}.{name}"
        for section, name, _, arg in training_fields()
        if isinstance(arg, Arg) and arg.megatron is None
    )


def megatron_lists() -> frozenset[str]:
    """Paths whose value a Megatron-LM script takes as a list of arguments (split on white
    space), as Megatron-LM itself splits a ``--data-args-path`` file."""
    return frozenset(
        f"{section}.{name}"
        for section, name, _, arg in training_fields()
        if isinstance(arg, Arg) and arg.megatron_list
    )


def megatron_renames() -> dict[str, str]:
    """Paths whose Megatron-LM argument is spelled differently from the trainer's."""
    return {
        f"{section}.{name}": arg.megatron
        for section, name, _, arg in training_fields()
        if isinstance(arg, Arg) and isinstance(arg.megatron, str)
    }
