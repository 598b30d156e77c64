"""The launch plan: validated settings -> everything ``mlaunch train`` will do, decided up front.

:func:`build_plan` is pure apart from reading the config file (and the trainer's argument parser):
it creates nothing, starts nothing and never imports torch. The run id is chosen here, once; the
torchrun command line, the worker environment, the exporting ranks and the summary all derive from
the one :class:`LaunchPlan`, so ``--dry-run`` shows exactly what a real launch would run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlaunch import envcontract as ec
from mlaunch.launcher import reference
from mlaunch.model.spans import estimate_spans_per_iteration
from mlaunch.model.spec import quoted
from mlaunch.model.strategies import exporting_ranks
from mlaunch.settings import (
    OTEL_ENV,
    SECRET_ENV,
    TELEMETRY_KEYS,
    Problem,
    Settings,
    SettingsError,
    Source,
    as_problem,
    choose_run_id,
    flag_name,
    is_run_id,
    load_settings,
    redact,
)
from mlaunch.settings import args as setting_args

#: Where the shipped example configs live (package data; top-level ``configs`` links here).
CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
#: The config ``mlaunch train`` runs without ``--config``.
DEFAULT_CONFIG = "tiny"
#: The trainer's module (``python -m mlaunch.trainer``).
TRAINER_MODULE = "mlaunch.trainer"
#: Rendezvous port used under SLURM when MASTER_PORT is not set (torchrun's own default).
SLURM_DEFAULT_PORT = 29500
#: torchrun, run as a module of the launcher's own interpreter.
TORCHRUN_MODULE = "torch.distributed.run"
#: torchrun's log file for its own output (the agent's, not the workers').
TORCHRUN_LOG = "torchrun.log"
REDACTED = "<redacted>"

# The argument tables below derive from the settings' field metadata (mlaunch.settings.args),
# where each model/training/parallelism setting says how it reaches a training script.

#: Settings path -> the trainer's argument (Megatron-LM names). A bool path is a store_true flag.
#: Paths missing here have no argument: see :data:`NOT_TRAINER_ARGS`.
TRAINER_ARGS: dict[str, str] = setting_args.trainer_args()
#: Settings of the model/training/parallelism sections that are deliberately not passed.
NOT_TRAINER_ARGS: dict[str, str] = setting_args.not_trainer_args()
#: Megatron-LM arguments mlaunch's trainer does not have, passed to scripts when not the default.
MEGATRON_ONLY_ARGS: dict[str, tuple[str, Any]] = setting_args.megatron_only_args()
#: mlaunch-only trainer arguments that Megatron-LM's pretrain_gpt.py would reject.
MEGATRON_UNKNOWN: frozenset[str] = setting_args.megatron_unknown()
#: Where Megatron-LM spells an argument differently from mlaunch's trainer.
MEGATRON_RENAMES: dict[str, str] = setting_args.megatron_renames()


@dataclass(frozen=True)
class LaunchPlan:
    """Everything one ``mlaunch train`` invocation will do."""

    settings: Settings
    config: Path
    """The config file the settings were read from."""
    run_id: str
    """Chosen once (RUN_ID setting, SLURM_JOB_ID, else fresh); shared by every rank."""
    run_dir: Path
    log_dir: Path
    """torchrun's ``--log-dir`` (per node, so nodes sharing a run directory never collide)."""
    argv: list[str]
    """The full torchrun command line."""
    worker_env: dict[str, str]
    """What mlaunch sets for the workers (real secrets included: child process only)."""
    removed_env: tuple[str, ...]
    """Inherited variables dropped so workers see one truth (NEMO_LENS_*, stale aliases)."""
    child_env: dict[str, str] = field(repr=False)
    """The complete environment of the torchrun process."""
    exporting_ranks: list[int]
    spans_per_iteration: list[int]
    """Estimated spans per iteration and exporting rank, per pipeline stage."""
    slurm: bool = False
    embedded_receiver: bool = False
    """A script run whose workers send OTLP to the launcher's embedded receiver on loopback (the
    ``file`` exporter in the reference's language). The plan leaves ``OTEL_EXPORTER_OTLP_ENDPOINT``
    and ``_PROTOCOL`` unset (and drops inherited ones): the launcher sets them when it has started
    the receiver."""
    env_notes: tuple[str, ...] = ()
    megatron_args_reason: str = ""
    """For a script/module: why Megatron-LM's arguments are (not) passed, for the summary."""
    """Environment the plan added on its own (e.g. CUDA_DEVICE_MAX_CONNECTIONS), for the summary."""

    # ---- derived views -------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Total worker processes."""
        return self.settings.world_size

    @property
    def traces_dir(self) -> Path:
        """Where the file exporter writes (one file per exporting rank)."""
        return self.run_dir / ec.TELEMETRY_DIR

    @property
    def progress_file(self) -> Path:
        """The trainer's progress records."""
        return self.run_dir / ec.PROGRESS_FILE

    def shown_env(self, show_secrets: bool = False) -> dict[str, str]:
        """:attr:`worker_env` as it may be displayed or written: secrets redacted unless asked."""
        if show_secrets:
            return dict(self.worker_env)
        return {k: redact(k, v) for k, v in self.worker_env.items()}

    def env_lines(self, show_secrets: bool = False) -> list[str]:
        """``export K=V`` lines a shell can source; every value ``shlex.quote``d, so spaces,
        quotes, ``$``, backticks and newlines survive. A redacted secret is a comment, so sourcing
        the file never sets a header to the marker."""
        lines = []
        for name, value in self.shown_env(show_secrets).items():
            if name in SECRET_ENV and not show_secrets and value:
                lines.append(
                    f"# export {name}={REDACTED}  (a secret; rerun with --show-secrets to include it)"
                )
            else:
                lines.append(f"export {name}={shlex.quote(value)}")
        return lines

    def resolved_env_text(self, show_secrets: bool = False) -> str:
        """The content of ``resolved.env``."""
        head = [
            f"# mlaunch: the worker environment of run {self.run_id}.",
            "# Source it (`. resolved.env`) to run a worker by hand with the same configuration.",
        ]
        return "\n".join(head + self.env_lines(show_secrets)) + "\n"

    def command_text(self) -> str:
        """The torchrun command, shell-quoted (never holds a secret: those travel in the env)."""
        return shlex.join(self.argv) + "\n"

    def resolved_json(self, show_secrets: bool = False) -> dict[str, Any]:
        """Every setting with its value and source, plus the run's decisions (secrets redacted)."""
        return {
            "run_id": self.run_id,
            "run_dir": str(self.run_dir),
            "config": str(self.config),
            "world_size": self.world_size,
            "exporting_ranks": self.exporting_ranks,
            "span_groups": sorted(g.value for g in self.settings.telemetry.groups),
            "spans_per_iteration": self.spans_per_iteration,
            "embedded_receiver": self.embedded_receiver,
            "command": self.argv,
            "environment": self.shown_env(show_secrets),
            "settings": settings_table(self.settings, show_secrets=show_secrets),
            **(
                {}
                if self.settings.uses_builtin_trainer
                else {"reference": reference.reference_view(self.settings)}
            ),
        }

    def resolved_json_text(self, show_secrets: bool = False) -> str:
        """The content of ``resolved.json``."""
        return json.dumps(self.resolved_json(show_secrets), indent=2, default=str) + "\n"


# --------------------------------------------------------------------------------------------
# Settings views


def _walk(prefix: str, value: Any) -> list[tuple[str, Any]]:
    """Flatten the settings dump to dotted leaves; mappings that are values (headers, resource
    attributes) stay whole."""
    if isinstance(value, dict) and (prefix in ("", "telemetry.otel") or "." not in prefix):
        out: list[tuple[str, Any]] = []
        for key, sub in value.items():
            out += _walk(f"{prefix}.{key}" if prefix else key, sub)
        return out
    return [(prefix, value)]


def settings_table(settings: Settings, *, show_secrets: bool = False) -> dict[str, dict[str, Any]]:
    """``{dotted path: {"value", "source"}}`` for every setting (secret header values redacted)."""
    table: dict[str, dict[str, Any]] = {}
    for path, value in _walk("", settings.model_dump()):
        if path == "telemetry.otel.headers" and not show_secrets:
            value = {k: REDACTED for k in value}
        table[path] = {"value": value, "source": str(settings.source(path))}
    return table


# --------------------------------------------------------------------------------------------
# Config files


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
            [Problem("--config", f"{quoted(name)}: {_why(exc)}", "unreadable")]
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


def _why(exc: BaseException) -> str:
    """An OS error as its reason alone (``File name too long``), without the repeated path."""
    return getattr(exc, "strerror", None) or str(exc)


def _config_launch_keys(path: Path) -> set[str]:
    """The ``[launch]`` keys a config file sets (unreadable files: none; load_settings reports)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return set()
    launch = data.get("launch")
    return set(launch) if isinstance(launch, dict) else set()


def unwritable_reason(path: Path) -> str | None:
    """Why a directory could not be created (or written) at ``path``, or None when it can.

    Checks the nearest existing ancestor, so a run directory under a regular file or in a
    read-only place fails here, before anything is created, not in ``mkdir`` or in a worker.
    """
    try:
        if path.exists() and not path.is_dir():
            return f"{quoted(str(path))} exists and is not a directory"
        probe = path
        while not probe.exists():
            if probe.parent == probe:
                return f"{quoted(str(path))}: no existing parent directory"
            probe = probe.parent
        if not probe.is_dir():
            return (
                f"{quoted(str(path))} cannot be created: {str(probe)!r} is a file, not a directory"
            )
        if not os.access(probe, os.W_OK | os.X_OK):
            return f"{quoted(str(path))} cannot be created: {str(probe)!r} is not writable"
    except OSError as exc:  # e.g. a 5,000-character name: ENAMETOOLONG from stat itself
        return f"{quoted(str(path))} cannot be used: {_why(exc)}"
    return None


# --------------------------------------------------------------------------------------------
# SLURM


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list such as ``node[01-04,07],gpu7`` (no ``scontrol`` needed).

    Ranges keep their zero padding; several bracket groups in one name expand as a product.
    """
    items: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    items.append(nodelist[start:])
    hosts: list[str] = []
    for item in (s.strip() for s in items):
        if item:
            hosts += _expand_one(item)
    return hosts


def _expand_one(name: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if not match:
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    values: list[str] = []
    for part in match.group(1).split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if sep and lo.isdigit() and hi.isdigit():
            width = len(lo)
            values += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
        elif part:
            values.append(part)
    return [head + v + rest for v in values for rest in _expand_one(tail)]


def slurm_launch_values(environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """Launch settings SLURM determines: ``{path: (value, variable)}`` (empty outside SLURM)."""
    job = environ.get("SLURM_JOB_ID", "").strip()
    if not job:
        return {}
    out: dict[str, tuple[Any, str]] = {"launch.rdzv_id": (job, "SLURM_JOB_ID")}
    for var in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        if environ.get(var, "").strip():
            out["launch.nnodes"] = (environ[var].strip(), var)
            break
    if environ.get("SLURM_NODEID", "").strip():
        out["launch.node_rank"] = (environ["SLURM_NODEID"].strip(), "SLURM_NODEID")
    for var in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        hosts = expand_nodelist(environ.get(var, ""))
        if hosts:
            port = environ.get("MASTER_PORT", "").strip() or str(SLURM_DEFAULT_PORT)
            out["launch.rdzv_endpoint"] = (f"{hosts[0]}:{port}", var)
            break
    return out


# --------------------------------------------------------------------------------------------
# Worker environment


_env_value = reference.env_text


def worker_environment(
    settings: Settings,
    run_id: str,
    run_dir: Path,
    environ: Mapping[str, str],
    *,
    external: bool | None = None,
) -> tuple[dict[str, str], tuple[str, ...], tuple[str, ...]]:
    """``(what mlaunch sets, inherited variables it removes, notes)`` for the workers.

    mlaunch's trainer gets every setting in mlaunch's language; a ``--script``/``--module`` worker
    gets the reference's (:mod:`mlaunch.launcher.reference`). Inherited ``MEGATRON_OTEL_*`` /
    ``NEMO_LENS_*`` variables that mlaunch does not set are removed, so workers see one truth.
    ``external`` overrides the entry point's kind (doctor asks for the script side of any config).
    """
    external = not settings.uses_builtin_trainer if external is None else external
    if not external:
        env = _trainer_env(settings, run_id, environ)
    else:
        env = reference.worker_env(settings, run_id)
    env[ec.RUN_DIR] = str(run_dir)
    embedded = external and reference.embedded_receiver(settings)
    for var in sorted(environ):
        # Other standard variables (per-signal headers, SDK knobs) travel as given.
        if (
            var.startswith("OTEL_")
            and var not in env
            and environ[var].strip()
            and not (embedded and var in ec.OTLP_TARGET_VARS)
        ):
            env[var] = environ[var]
    if settings.launch.device == "cuda":
        env[ec.DEVICE] = "cuda"  # the worker refuses to start without it (trainer/parallel.py)
    if settings.launch.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the only way to keep a CUDA-capable worker on CPU
    notes: list[str] = []
    value, note = reference.cuda_connections(settings, environ)
    if value is not None:
        env[ec.CUDA_DEVICE_MAX_CONNECTIONS] = value
    if note:
        notes.append(note)
    removed = {
        k
        for k in environ
        if (k.startswith(ec.FALLBACK_PREFIX) or k.startswith(ec.PRIMARY_PREFIX)) and k not in env
    }
    if embedded:
        removed |= {k for k in environ if k in ec.OTLP_TARGET_VARS}
    return env, tuple(sorted(removed)), tuple(notes)


def _trainer_env(settings: Settings, run_id: str, environ: Mapping[str, str]) -> dict[str, str]:
    """mlaunch's own trainer: every key in mlaunch's language, the OTEL_* text as given."""
    t = settings.telemetry
    env: dict[str, str] = {}
    for key, fld in TELEMETRY_KEYS.items():
        value = run_id if fld == "run_id" else getattr(t, fld)
        env[ec.PRIMARY_PREFIX + key] = _env_value(value)
    env["OTEL_SERVICE_NAME"] = t.service_name
    for var, (section, fld) in OTEL_ENV.items():
        if var == "OTEL_SERVICE_NAME":
            continue
        path = f"{section}.{fld}"
        source = settings.source(path)
        if source.kind == "env":
            env[var] = environ[var]  # as given: the worker parses the same text
        elif source.kind in ("flag", "file"):
            obj: Any = t.otel if section == "telemetry.otel" else t
            env[var] = _env_value(getattr(obj, fld))
    return env


# --------------------------------------------------------------------------------------------
# Worker command line


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
    if interval == 0:
        values["training.save_interval"] = None
    elif t.save is None:
        values["training.save"] = str(run_dir / ec.CHECKPOINTS_DIR)
    if t.load is None and values["training.save"] is not None:
        # Resume from the save directory when it already holds something (SPEC: --load default).
        save = Path(values["training.save"])
        try:
            resumable = save.is_dir() and any(save.iterdir())
        except OSError:  # unusable path: build_plan reports it under --save
            resumable = False
        if resumable:
            values["training.load"] = str(save)
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
        args += part
    if megatron:
        for path, (flag, default) in MEGATRON_ONLY_ARGS.items():
            section, _, fld = path.partition(".")
            value = getattr(getattr(settings, section), fld)
            if value != default:
                args += [flag, str(value)]
    return args


def otel_flags(settings: Settings) -> list[str]:
    """Megatron-LM's own ``--otel-*`` flags (for ``--script``/``--module`` targets), in the
    reference's language and each one argv item (see :mod:`mlaunch.launcher.reference`)."""
    return reference.worker_args(settings)


def _shadowed_settings(passthrough: Sequence[str], extra: Sequence[str] = ()) -> list[Problem]:
    """A setting repeated after ``--`` would silently win in the workers (argparse keeps the last
    value) while the summary, resolved.json and the checkpoint plan show the other one."""
    owned = {flag for spelled in TRAINER_ARGS.values() for flag in spelled.split("/")}
    owned |= set(extra)
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


def _check_trainer_args(args: Sequence[str], world_size: int) -> list[Problem]:
    """Run the trainer's own parser and checks here, so a bad pass-through argument fails before
    any process starts (the parser is standard library only)."""
    try:
        from mlaunch.trainer.args import build_parser, validate
    except ImportError:  # the trainer is optional for --script runs; checked again in workers
        return []
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
    return [as_problem(p) for p in validate(ns, world_size)]


def torchrun_argv(settings: Settings, run_id: str, log_dir: Path, entry: list[str]) -> list[str]:
    """``python -m torch.distributed.run`` with the launch settings under torchrun's names."""
    launch = settings.launch
    argv = [sys.executable, "-m", TORCHRUN_MODULE]
    if launch.nnodes == 1 and launch.rdzv_endpoint is None:
        # torchrun binds the c10d store to a free port itself: two runs on one machine never
        # collide, and there is no pick-then-bind race as with a port chosen here.
        argv += ["--standalone", "--nnodes", "1", "--nproc-per-node", str(launch.nproc_per_node)]
    else:
        argv += [
            "--nnodes", str(launch.nnodes),
            "--nproc-per-node", str(launch.nproc_per_node),
            "--node-rank", str(launch.node_rank),
            "--rdzv-backend", launch.rdzv_backend,
            "--rdzv-endpoint", str(launch.rdzv_endpoint),
            "--rdzv-id", launch.rdzv_id or run_id,
        ]  # fmt: skip
    argv += ["--max-restarts", str(launch.max_restarts)]
    # Per-rank stdout/stderr files (and torchelastic error files) under the run directory.
    argv += ["--log-dir", str(log_dir), "--redirects", "3"]
    return argv + entry


# --------------------------------------------------------------------------------------------
# The plan


def build_plan(
    *,
    flags: Mapping[str, Any],
    config: str | None = None,
    passthrough: Sequence[str] = (),
    environ: Mapping[str, str],
    cwd: Path,
) -> LaunchPlan:
    """Validate every input and decide the whole launch. Raises :class:`SettingsError` listing
    every problem (the caller prints them and exits 2; nothing has been created)."""
    config_path = resolve_config(config, cwd)
    flags = dict(flags)
    slurm = slurm_launch_values(environ)
    given_in_file = {f"launch.{k}" for k in _config_launch_keys(config_path)}
    from_slurm: dict[str, str] = {}
    for path, (value, var) in slurm.items():
        if flags.get(path) is None and path not in given_in_file:
            flags[path] = value
            from_slurm[path] = var
    settings = load_settings(flags=flags, environ=environ, config=config_path)
    for path, var in from_slurm.items():
        # Provenance: these came from SLURM's variables, not from a flag.
        settings._sources[path] = Source("env", var)

    launch, t = settings.launch, settings.telemetry
    problems: list[Problem] = []
    run_id = _choose_run_id(settings, environ, problems)
    if launch.nnodes > 1 and launch.rdzv_endpoint is None:
        problems.append(
            Problem(
                flag_name("launch.rdzv_endpoint"),
                "required when --nnodes > 1 (host:port of node 0)",
                "conflict",
            )
        )
    run_dir = (
        Path(launch.run_dir).expanduser() if launch.run_dir else ec.default_run_dir(run_id, cwd)
    )
    if not run_dir.is_absolute():
        run_dir = cwd / run_dir
    if (why := unwritable_reason(run_dir)) is not None:
        problems.append(Problem(_label(settings, "launch.run_dir"), why))
    if settings.training.save is not None:
        save = Path(settings.training.save).expanduser()
        if (why := unwritable_reason(save if save.is_absolute() else cwd / save)) is not None:
            problems.append(Problem(_label(settings, "training.save"), why))
    log_dir = run_dir / ec.LOGS_DIR / f"node{launch.node_rank}"

    megatron_why = ""
    if not settings.uses_builtin_trainer:
        # One decision, stored on the settings: every later reader (the argument list, the
        # translation table, resolved.json) sees the same bool.
        launch.megatron_args, megatron_why = resolve_megatron_args(settings, cwd)
    if settings.uses_builtin_trainer:
        targs = trainer_args(settings, run_dir)
        problems += _shadowed_settings(passthrough)
        problems += _check_trainer_args([*targs, *passthrough], settings.world_size)
        problems += _checkpoint_layout_problems(settings, targs, cwd)
        entry = ["-m", TRAINER_MODULE, *targs, *passthrough]
    else:
        target = ["-m", launch.module] if launch.module else [str((cwd / launch.script).resolve())]
        extra = (
            trainer_args(settings, run_dir, megatron=True) + otel_flags(settings)
            if launch.megatron_args
            else []
        )
        if launch.megatron_args:
            owned = [*reference.REFERENCE_OTEL_ARGS, *(f for f, _ in MEGATRON_ONLY_ARGS.values())]
            problems += _shadowed_settings(passthrough, owned)
        problems += reference.refusals(settings)
        entry = [*target, *extra, *passthrough]

    p = settings.parallelism
    ranks: list[int] = []
    spans: list[int] = []
    if t.enabled and not t.otel.sdk_disabled:
        try:
            ranks = exporting_ranks(
                t.export_strategy,
                settings.world_size,
                nproc_per_node=launch.nproc_per_node,
                export_rank=t.export_rank,
                sample_rate=t.export_sample_rate,
            )
        except Exception as exc:  # a custom strategy is user code: its failure is bad input
            problems.append(
                Problem(
                    _label(settings, "telemetry.export_strategy"),
                    f"custom export strategy {t.export_strategy!r} fails when called:"
                    f" {type(exc).__name__}: {exc}",
                )
            )
        spans = estimate_spans_per_iteration(
            t.groups,
            microbatches=settings.num_microbatches,
            layers=settings.model.num_layers,
            pp=p.pipeline_model_parallel_size,
            dp=settings.data_parallel_size,
            offload=settings.training.offload_activations,
        )
    if problems:
        raise SettingsError(problems)

    worker_env, removed, notes = worker_environment(settings, run_id, run_dir, environ)
    child_env = {k: v for k, v in environ.items() if k not in removed}
    child_env.update(worker_env)

    return LaunchPlan(
        settings=settings,
        config=config_path,
        run_id=run_id,
        run_dir=run_dir,
        log_dir=log_dir,
        argv=torchrun_argv(settings, run_id, log_dir, entry),
        worker_env=worker_env,
        removed_env=removed,
        child_env=child_env,
        exporting_ranks=ranks,
        spans_per_iteration=spans,
        slurm=bool(slurm),
        embedded_receiver=not settings.uses_builtin_trainer
        and reference.embedded_receiver(settings),
        env_notes=notes,
        megatron_args_reason=megatron_why,
    )


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
        return bool(value), f"{_label(settings, 'launch.megatron_args')} = {str(value).lower()}"
    why = megatron_entry_point(settings, cwd)
    if why is not None:
        return True, why
    return False, "not a Megatron-LM entry point"


#: Checkpoint files the launcher reads (stdlib only, the launcher never imports torch); the
#: names are :mod:`mlaunch.trainer.checkpoint`'s (pinned equal by a test).
CHECKPOINT_TRACKER_FILE = "latest_checkpointed_iteration.txt"
CHECKPOINT_MANIFEST_FILE = "manifest.json"
#: Settings that fix the shape of what a checkpoint holds: resuming with another value of any of
#: them cannot load its tensors (compared when the checkpoint's run left its ``resolved.json``).
CHECKPOINT_LAYOUT_SETTINGS = (
    "parallelism.pipeline_model_parallel_size",
    "parallelism.tensor_model_parallel_size",
    "model.num_layers",
    "model.hidden_size",
    "model.num_attention_heads",
    "model.seq_length",
    "model.untie_embeddings",
)


def _newest_manifest(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """The manifest of the checkpoint a resume would start from (the marker's, else the newest
    committed one), or None when there is none to read."""
    try:
        names = [m.group(1) for p in root.iterdir() if (m := re.fullmatch(r"iter_(\d{7})", p.name))]
        marker = (
            (root / CHECKPOINT_TRACKER_FILE).read_text().strip()
            if (root / CHECKPOINT_TRACKER_FILE).is_file()
            else ""
        )
    except OSError:
        return None
    order = sorted(names, reverse=True)
    if marker.isdigit() and f"{int(marker):07d}" in order:
        order.remove(f"{int(marker):07d}")
        order.insert(0, f"{int(marker):07d}")
    for it in order:
        path = root / f"iter_{it}" / CHECKPOINT_MANIFEST_FILE
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # the trainer falls back past an invalid one; so does this check
        if isinstance(manifest, dict):
            return path, manifest
    return None


def _checkpoint_layout_problems(
    settings: Settings, targs: Sequence[str], cwd: Path
) -> list[Problem]:
    """Refuse before launch to resume from a checkpoint saved with another layout (pipeline
    stages from its manifest; tensor parallelism and model shape from the ``resolved.json`` of
    the run that saved it, when the checkpoint is that run's ``checkpoints/``): the workers would
    otherwise each die in ``torch.load`` after start-up."""
    if "--load" not in targs[:-1]:
        return []
    load = Path(targs[targs.index("--load") + 1]).expanduser()
    root = load if load.is_absolute() else cwd / load
    found = _newest_manifest(root)
    if found is None:
        return []
    manifest_path, manifest = found
    theirs: dict[str, Any] = {}
    with contextlib.suppress(TypeError, ValueError):
        theirs["parallelism.pipeline_model_parallel_size"] = int(manifest.get("pipeline_stages", 1))
    if root.name == ec.CHECKPOINTS_DIR:
        with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
            table = json.loads((root.parent / ec.RESOLVED_JSON_FILE).read_text(encoding="utf-8"))
            for path in CHECKPOINT_LAYOUT_SETTINGS:
                entry = table["settings"].get(path)
                if isinstance(entry, dict) and "value" in entry:
                    theirs.setdefault(path, entry["value"])
    differ = []
    for path in CHECKPOINT_LAYOUT_SETTINGS:
        section, _, fld = path.partition(".")
        ours = getattr(getattr(settings, section), fld)
        if path in theirs and theirs[path] != ours:
            differ.append(f"{flag_name(path)} {theirs[path]} (now {ours})")
    if not differ:
        return []
    if settings.training.load is not None:
        label, fix = _label(settings, "training.load"), "give --load a checkpoint of this layout"
    elif settings.training.save is not None:
        label = _label(settings, "training.save")
        fix = "give --save an empty directory"
    else:
        label, fix = _label(settings, "launch.run_dir"), "give a new --run-dir (or --save DIR)"
    return [
        (
            label,
            f"{root} holds a checkpoint saved with {', '.join(differ)} ({manifest_path.parent.name});"
            f" this run cannot resume from it: {fix}, or run with that layout",
        )
    ]


def _label(settings: Settings, path: str) -> str:
    """What the user typed for ``path``: the flag, variable or config-file key that set it (the
    flag's name when it is a default), so a bad ``run_dir`` in a config file names the file."""
    source = settings.source(path)
    return source.name if source.kind in ("flag", "env", "file") else flag_name(path)


def _choose_run_id(settings: Settings, environ: Mapping[str, str], problems: list[Problem]) -> str:
    """The run id, made safe for multi-node: every node must reach the same id, so without
    RUN_ID or SLURM a multi-node run takes the rendezvous id (which all nodes share), and never a
    fresh one (each node would make its own)."""
    t, launch = settings.telemetry, settings.launch
    multi = launch.nnodes > 1
    shared = (launch.rdzv_id,) if multi and is_run_id(launch.rdzv_id) else ()
    run_id = choose_run_id(t.run_id, environ, shared=shared, fresh=not multi)
    if run_id is not None:
        return run_id
    problems.append(
        Problem(
            flag_name("launch.rdzv_id"),
            "a multi-node run needs one run id on every node: give --rdzv-id (letters, digits,"
            " '.', '_', '-') or --otel-run-id",
            "conflict",
        )
    )
    return "invalid"
