"""The workers' command line: the model/training/parallelism settings as arguments of mlaunch's
trainer or of a Megatron-LM script, and the checks that the arguments after ``--`` do not
contradict them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlaunch.launcher import lens_names
from mlaunch.rundir import layout as lay
from mlaunch.settings import Problem, Settings, arg_tables
from mlaunch.settings.trainer_cli import build_parser, validate

# The argument tables below derive from the settings' field metadata (mlaunch.settings.args,
# tabled by mlaunch.settings.arg_tables), where each model/training/parallelism setting says how it
# reaches a training script.

#: Settings path -> the trainer's argument (Megatron-LM names). A bool path is a store_true flag.
#: Paths missing here have no argument: see :data:`NOT_TRAINER_ARGS`.
TRAINER_ARGS: dict[str, str] = arg_tables.trainer_args()
#: Settings of the model/training/parallelism sections that are deliberately not passed.
NOT_TRAINER_ARGS: dict[str, str] = arg_tables.not_trainer_args()
#: Megatron-LM arguments mlaunch's trainer does not have, passed to scripts when not the default.
MEGATRON_ONLY_ARGS: dict[str, tuple[str, Any]] = arg_tables.megatron_only_args()
#: mlaunch-only trainer arguments that Megatron-LM's pretrain_gpt.py would reject.
MEGATRON_UNKNOWN: frozenset[str] = arg_tables.megatron_unknown()
#: Where Megatron-LM spells an argument differently from mlaunch's trainer.
MEGATRON_RENAMES: dict[str, str] = arg_tables.megatron_renames()
#: Settings a Megatron-LM script takes as a list of arguments (``--data-path 0.3 /a 0.7 /b``).
MEGATRON_LISTS: frozenset[str] = arg_tables.megatron_lists()
#: Megatron-LM's data sources (``megatron/training/arguments.py``): at most one kind per run,
#: and mlaunch translates none of them but ``--data-path`` (from ``data_path``), so after ``--``
#: each passes through verbatim (weighted lists included) unless ``data_path`` is also given.
MEGATRON_DATA_ARGS: tuple[str, ...] = (
    "--data-path",
    "--train-data-path",
    "--valid-data-path",
    "--test-data-path",
    "--data-args-path",
    "--per-split-data-args-path",
    "--mock-data",
)


def _arg_value(path: str, value: Any) -> list[str]:
    flag = TRAINER_ARGS[path]
    if "/" in flag:  # a choice of switches (--bf16/--fp16): the default value has none
        return [f"--{value}"] if f"--{value}" in flag.split("/") else []
    if isinstance(value, bool):
        return [flag] if value else []
    if value is None:
        return []
    return [flag, str(value)]


def restart_save_interval(train_iters: int) -> int:
    """The save interval ``mlaunch train`` uses with ``--max-restarts`` > 0 and none given."""
    return max(1, train_iters // 10)


def trainer_args(settings: Settings, run_dir: Path, *, megatron: bool = False) -> list[str]:
    """The model/training/parallelism settings as trainer arguments (Megatron-LM names).

    ``megatron`` leaves out mlaunch-only arguments and uses Megatron-LM's spellings, for
    ``--script pretrain_gpt.py``.
    """
    t = settings.training
    values: dict[str, Any] = {}
    for path in TRAINER_ARGS:
        section, _, fld = path.partition(".")
        values[path] = getattr(getattr(settings, section), fld)
    # The settings' conventions, spelled the way the trainer's parser wants them:
    # save_interval 0 = "only at the end" (omit); with an interval and no directory, save under
    # the run directory; eval_interval 0 = "never" (the trainer wants >= 1: no eval batches).
    interval = t.save_interval
    if settings.launch.max_restarts > 0 and interval == 0:
        # An elastic restart resumes from the newest checkpoint: without periodic saves it would
        # start over. Every tenth of the run loses at most 10% of the work to one failure.
        interval = restart_save_interval(t.train_iters)
        values["training.save_interval"] = interval
    own = run_dir / lay.CHECKPOINTS_DIR
    if interval == 0:
        values["training.save_interval"] = None
        if t.save is None and _holds_files(own):
            # A rerun in a run directory that saved checkpoints (with --save-interval, or by a
            # restart or a signal) resumes from them and saves there at the end, like the run
            # that wrote them, instead of starting over at iteration 1 because the interval was
            # not repeated. The summary says "resuming from".
            values["training.save"] = str(own)
    elif t.save is None:
        values["training.save"] = str(own)
    # Resume from the save directory when it already holds something: --load defaults to --save.
    save = values["training.save"]
    if t.load is None and save is not None and _holds_files(Path(save)):
        values["training.load"] = save
    if t.eval_interval == 0:
        values["training.eval_interval"] = None
        values["training.eval_iters"] = 0
    args: list[str] = []
    for path, value in values.items():
        if megatron and path in MEGATRON_UNKNOWN:
            continue
        part = _arg_value(path, value)
        if megatron and part and path in MEGATRON_RENAMES:
            part[0] = MEGATRON_RENAMES[path]
        if megatron and len(part) == 2 and path in MEGATRON_LISTS:
            part = [part[0], *part[1].split()]  # nargs='*': one argument per prefix or weight
        args += part
    if megatron:
        for path, (flag, default) in MEGATRON_ONLY_ARGS.items():
            section, _, fld = path.partition(".")
            value = getattr(getattr(settings, section), fld)
            if value != default:
                args += [flag, str(value)]
    return args


def _holds_files(save: Path) -> bool:
    """Whether a save directory already holds something a resume would start from."""
    try:
        return save.is_dir() and any(save.iterdir())
    except OSError:  # unusable path: build_plan reports it under --save
        return False


def otel_flags(settings: Settings) -> list[str]:
    """Megatron-LM's own ``--otel-*`` flags (for ``--script``/``--module`` targets), in the
    reference's language and each one argv item (see :mod:`mlaunch.launcher.lens_names`)."""
    return lens_names.worker_args(settings)


def shadowed_settings(
    passthrough: Sequence[str],
    extra: Sequence[str] = (),
    *,
    passed: Sequence[str] = (),
    only: bool = False,
) -> list[Problem]:
    """A setting repeated after ``--`` would silently win in the workers (argparse keeps the last
    value) while the summary, resolved.json and the checkpoint plan show the other one.
    ``extra``: further arguments mlaunch resolves itself (the ``--otel-*`` flags); ``only``: check
    those alone (the model/training arguments are the user's when mlaunch passes none).
    ``passed``: arguments the entry point owns here, which go through after ``--`` as they are."""
    owned = set() if only else {f for spelled in TRAINER_ARGS.values() for f in spelled.split("/")}
    owned = (owned | set(extra)) - set(passed)
    problems = []
    for token in passthrough:
        flag = token.split("=", 1)[0]
        if flag in owned:
            problems.append(
                Problem(
                    "-- ARGS",
                    f"{flag} is a setting of mlaunch train: give it before '--' (mlaunch train"
                    f" {flag} ...) so the summary, resolved.json and the workers agree",
                )
            )
    return problems


def megatron_data_problems(settings: Settings, passthrough: Sequence[str]) -> list[Problem]:
    """``data_path`` given before ``--`` and a Megatron-LM data source after it: Megatron-LM
    takes a single data source (its argument check asserts it), and a repeated ``--data-path``
    would silently win over the one the summary shows."""
    if settings.training.data_path is None:
        return []
    given = sorted({t.split("=", 1)[0] for t in passthrough} & set(MEGATRON_DATA_ARGS))
    return [
        Problem(
            "-- ARGS",
            f"{flag} after '--' and {settings.label('training.data_path')} before it: Megatron-LM"
            " takes a single data source; give the prefixes once (after '--' they pass through"
            " verbatim)",
            "conflict",
        )
        for flag in given
    ]


def check_trainer_args(args: Sequence[str], world_size: int) -> list[Problem]:
    """Run the trainer's own parser and checks here, so a bad pass-through argument fails before
    any process starts (the parser is standard library and settings only)."""
    parser = build_parser()

    class _Bad(Exception):
        pass

    def _error(message: str) -> None:
        raise _Bad(message)

    parser.error = _error  # type: ignore[method-assign]  # argparse would print usage and exit
    try:
        ns = parser.parse_args(list(args))
    except _Bad as exc:
        return [Problem("-- ARGS", f"the trainer rejects its arguments: {exc}")]
    return validate(ns, world_size)


#: Megatron-LM's entry-point scripts (pretrain_gpt.py, pretrain_bert.py, pretrain_mamba.py ...).
MEGATRON_SCRIPT_GLOB = "pretrain_*.py"
#: The package a Megatron-LM checkout has beside its entry points, and its module prefix.
MEGATRON_PACKAGE = "megatron"


def megatron_entry_point(settings: Settings, cwd: Path) -> str | None:
    """Why ``--script``/``--module`` is Megatron-LM's entry point, or None when it is not."""
    launch = settings.launch
    if launch.module:
        name = launch.module.strip()
        return f"module {name}" if name.split(".")[0] == MEGATRON_PACKAGE else None
    if not launch.script:
        return None
    script = cwd / Path(launch.script).expanduser()
    if script.match(MEGATRON_SCRIPT_GLOB):
        return f"Megatron-LM entry point {script.name}"
    if (script.parent / MEGATRON_PACKAGE).is_dir():
        return f"a {MEGATRON_PACKAGE}/ package beside {script.name}"
    return None


def resolve_megatron_args(settings: Settings, cwd: Path) -> tuple[bool, str]:
    """(pass Megatron-LM's arguments?, why) for a script/module: an explicit setting (flag,
    variable or config file: the ``megatron`` config sets it) wins; unset, only a Megatron-LM
    entry point gets them (an ordinary argparse script would exit 2 on the first one)."""
    value = settings.launch.megatron_args
    if value is not None:
        return bool(value), f"{settings.label('launch.megatron_args')} = {str(value).lower()}"
    why = megatron_entry_point(settings, cwd)
    if why is not None:
        return True, why
    return False, "not a Megatron-LM entry point"
