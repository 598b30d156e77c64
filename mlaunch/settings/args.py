"""How a model, training or parallelism setting reaches a training script, as field metadata.

Each field of those sections carries one :class:`Arg` (mlaunch's trainer takes it) or
:class:`NotPassed` (it does not, and why) in its ``Annotated`` type. Everything that used to be a
table of its own derives from that one place: the trainer's argument parser
(:func:`mlaunch.settings.trainer_cli.build_parser`), the launcher's argument list and its Megatron-LM
spellings (:mod:`mlaunch.launcher.plan`), through the tables of :mod:`.arg_tables`. Adding a
setting to a section is then one change. The metadata is here, below the schema that uses it; the
tables, which read the schema, are above it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

#: The sections whose settings are training arguments (Megatron-LM's names).
TRAINING_SECTIONS: tuple[str, ...] = ("model", "training", "parallelism")


class _Same:
    """The marker for "as the setting": the same default, or the same name in Megatron-LM."""

    def __repr__(self) -> str:
        return "SAME"


SAME: Any = _Same()


@dataclass(frozen=True)
class Arg:
    """A setting mlaunch's trainer takes as an argument.

    ``help`` is the trainer's ``--help`` line (the setting's docstring is ``mlaunch train``'s);
    ``group`` the trainer's help group (default: the section's name). ``bare_default`` is the
    trainer's default when run without the launcher, only where the setting's default cannot be
    its own: an unset value the trainer derives (``None``) or a value outside the setting's range
    with a trainer-only meaning (``keep_last`` 0 = keep all); the launcher always passes the
    setting's value. ``megatron`` is Megatron-LM's spelling (:data:`SAME`: the trainer's; None:
    Megatron-LM has no such argument, so a ``--script pretrain_gpt.py`` never gets it).
    ``choices``: a text setting given as one ``--VALUE`` switch per value (``--bf16``/``--fp16``
    for the precision), value -> help; the default value has no switch.
    """

    help: str = ""
    group: str | None = None
    bare_default: Any = SAME
    megatron: Any = SAME
    choices: Mapping[str, str] = field(default_factory=dict)
    megatron_list: bool = False
    """Megatron-LM takes a list here (``nargs='*'``): the value is split on white space into
    separate arguments for a Megatron-LM script (``--data-path 0.3 /a 0.7 /b``)."""

    def flags(self, name: str) -> tuple[str, ...]:
        """The trainer's argument(s) for field ``name``."""
        if self.choices:
            return tuple(f"--{value}" for value in self.choices)
        return ("--" + name.replace("_", "-"),)


@dataclass(frozen=True)
class NotPassed:
    """A setting mlaunch's trainer does not take (``why``). ``megatron``: Megatron-LM's argument
    for it, passed to a Megatron-LM script when the value is not the default."""

    why: str
    megatron: str | None = None


def arg_of(info: FieldInfo) -> Arg | NotPassed:
    """The :class:`Arg` or :class:`NotPassed` a training field carries."""
    for item in info.metadata:
        if isinstance(item, Arg | NotPassed):
            return item
    raise LookupError("a model/training/parallelism setting without Arg or NotPassed metadata")
