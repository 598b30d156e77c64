"""``mlaunch sbatch``: a validated launch plan, turned into a readable SLURM batch script.

Pure, like :mod:`mlaunch.launcher.plan`: :func:`plan_job` validates (every problem at once, as
:class:`~mlaunch.settings.SettingsError`) and :func:`render_script` writes the text, from
``job.sbatch.template`` beside this module; submitting is :mod:`mlaunch.slurm.client`'s job.
The decisions, explained to users in ``docs/slurm.md``:

Validation
    :func:`plan_job` runs :func:`~mlaunch.launcher.plan.build_plan` exactly as ``mlaunch train``
    does, in the environment node 0 of the job will see (the submit environment with the job's
    SLURM variables simulated), so a bad setting fails at submission, not after the queue.

Run id and run directory
    Under SLURM ``mlaunch train`` takes the job id as its run id, and a requeued job keeps its id:
    the default run directory is ``<submit dir>/runs/<job id>/``, written in the script as
    ``runs/$SLURM_JOB_ID``, so every incarnation writes into the same directory. (A ``--run-dir``
    or a run id given at submission fixes the directory instead.)

Settings
    The script runs ``mlaunch train --config <the config, absolute>`` with every model, training,
    parallelism and launch setting that was given (by a flag or the config file) frozen as a flag,
    and exports the worker environment of ``resolved.env`` for the telemetry settings: what runs is
    what was validated, whatever happens to the shell or the config file meanwhile. What SLURM
    decides per node (nodes, node rank, rendezvous host) is left to ``mlaunch train`` in the job.

Secrets
    Never in the script (it sits in the run directory, often on a shared file system). The job
    inherits them from the environment ``mlaunch sbatch`` ran in (``sbatch --export=ALL``,
    SLURM's default, which SLURM keeps with the job, readable only by its owner and the admins);
    the script checks at run time that each one the submitter had is there, naming it.

Signals and requeue
    ``--signal=B:USR1@<grace>``: SLURM warns the batch shell before the time limit; the script
    passes USR1 to the training step (``srun`` delivers it to every process of the step; each
    node's ``mlaunch train`` turns it into the graceful SIGTERM for its workers: they finish the
    iteration, save and exit) and, with ``--requeue``, requeues the job, which resumes from that
    checkpoint, unless ``mlaunch stop`` sent it (its request in the run directory, newer than the
    incarnation: :mod:`mlaunch.slurm.stop`). Preemption sends SIGTERM to every process of the
    job, which stops the same way.
"""

from __future__ import annotations

import functools
import re
import shlex
import string
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlaunch import envcontract as ec
from mlaunch.launcher.plan import LaunchPlan, build_plan, settings_table
from mlaunch.launcher.worker_args import restart_save_interval
from mlaunch.rundir import layout as lay
from mlaunch.settings import (
    OTEL_ENV,
    SECRET_ENV,
    TELEMETRY_KEYS,
    Settings,
    SettingsError,
    flag_name,
)

#: Seconds of warning before the time limit (``--signal-grace``): one iteration plus a save.
DEFAULT_SIGNAL_GRACE_S = 120
#: SLURM's limit on the ``--signal`` time (a 16-bit number of seconds).
MAX_SIGNAL_GRACE_S = 0xFFFF
#: The signal SLURM sends the batch shell before the time limit, passed on to the step.
WARNING_SIGNAL = "USR1"
#: The job id as the script spells it (the run directory of a requeued job keeps it).
JOB_ID_VAR = "SLURM_JOB_ID"
#: Prints a TCP port free on this node: the kernel's pick, released at once for the rendezvous.
_FREE_PORT_PY = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
#: Stands for the job id while validating, before the job exists.
PLACEHOLDER_JOB_ID = "0"

#: Launch settings SLURM decides per node in the job: a flag for them would be wrong on every node
#: but one. Value: what to give instead.
SLURM_DECIDED: dict[str, str] = {
    "launch.nnodes": "give --nodes (mlaunch train reads SLURM_NNODES in the job)",
    "launch.node_rank": "SLURM numbers the nodes (mlaunch train reads SLURM_NODEID in the job)",
}
#: Settings holding a path: written absolute, so the script means the same thing anywhere.
PATH_SETTINGS: tuple[str, ...] = (
    "launch.script", "training.save", "training.load", "training.data_path",
)  # fmt: skip
#: Worker variables each job decides for itself (the run directory, the run id = its job id,
#: the device mask ``mlaunch train`` derives): not frozen into the script.
PER_JOB_ENV: frozenset[str] = frozenset({ec.RUN_DIR, ec.RUN_ID, "CUDA_VISIBLE_DEVICES"})
#: sbatch options ``mlaunch sbatch`` writes itself -> the flag to use instead of --sbatch-arg.
OWNED_SBATCH_OPTIONS: dict[str, str] = {
    "--nodes": "--nodes", "-N": "--nodes",
    "--ntasks": "--nodes (one mlaunch train per node)", "-n": "--nodes (one mlaunch train per node)",
    "--ntasks-per-node": "--nodes (one mlaunch train per node)",
    "--gpus-per-node": "--gpus-per-node", "--time": "--time", "-t": "--time",
    "--partition": "--partition", "-p": "--partition", "--account": "--account",
    "-A": "--account", "--qos": "--qos", "-q": "--qos",
    "--signal": "--signal-grace", "--requeue": "--requeue", "--no-requeue": "--no-requeue",
    "--exclusive": "--exclusive", "--output": "the run directory's slurm-<job>.out",
    "-o": "the run directory's slurm-<job>.out", "--error": "the run directory's slurm-<job>.out",
    "-e": "the run directory's slurm-<job>.out", "--open-mode": "append (every incarnation)",
    "--chdir": "the directory mlaunch sbatch runs in", "-D": "the directory mlaunch sbatch runs in",
    "--parsable": "(mlaunch sbatch reads the job id itself)", "--wrap": "(the script is the job)",
}  # fmt: skip
#: ``--time`` as SLURM accepts it: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")
_UNLIMITED = frozenset({"unlimited", "infinite"})


@dataclass(frozen=True)
class SbatchOptions:
    """The SLURM side of ``mlaunch sbatch`` (the training side is ``mlaunch train``'s flags)."""

    nodes: int = 1
    """Nodes (``#SBATCH --nodes``); one ``mlaunch train`` per node."""
    gpus_per_node: int | None = None
    """``#SBATCH --gpus-per-node``; also the workers per node unless --nproc-per-node is given."""
    time: str | None = None
    """The time limit, in SLURM's format (``#SBATCH --time``)."""
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    sbatch_args: tuple[str, ...] = ()
    """More ``#SBATCH`` options, one per entry (``--mail-type=END``)."""
    signal_grace_s: int = DEFAULT_SIGNAL_GRACE_S
    """Seconds between SLURM's warning signal and the time limit."""
    requeue: bool = True
    """``#SBATCH --requeue``, and the script requeues itself after the time-limit warning."""
    exclusive: bool = True
    """``#SBATCH --exclusive``: torchrun's workers get the whole node."""


@dataclass(frozen=True)
class BatchJob:
    """Everything the batch script says, decided and validated."""

    plan: LaunchPlan
    """The launch as node 0 of the job will plan it (with a placeholder job id)."""
    options: SbatchOptions
    cwd: Path
    python: str
    """The interpreter that runs ``mlaunch train`` on the nodes (this one)."""
    run_dir_prefix: Path | None
    """``<prefix>/<job id>`` is the run directory; None when it is fixed (:attr:`fixed_run_dir`)."""
    fixed_run_dir: Path | None
    train_args: list[str]
    """``mlaunch train``'s arguments in the job (``--run-dir`` comes last, from the script)."""
    passthrough: list[str]
    environment: dict[str, str]
    """The exported worker environment (``resolved.env`` without secrets and per-job values)."""
    unset: tuple[str, ...]
    """Inherited variables to drop (stale aliases), as ``mlaunch train --print-env`` does."""
    secrets: tuple[str, ...]
    """Secret variables the submitter has, which the job must inherit (names only)."""
    notes: list[str] = field(default_factory=list)
    """Choices ``mlaunch sbatch`` made that the user did not spell out (shown and commented)."""
    created: float = field(default_factory=time.time)

    @property
    def job_name(self) -> str:
        """``mlaunch-<config name>``."""
        return f"mlaunch-{self.plan.config.stem}"

    def run_dir(self, job_id: str) -> Path:
        """The run directory of job ``job_id``."""
        if self.fixed_run_dir is not None:
            return self.fixed_run_dir
        assert self.run_dir_prefix is not None
        return self.run_dir_prefix / job_id

    @property
    def output_pattern(self) -> str:
        """``#SBATCH --output``: the run directory's ``slurm-%j.out``."""
        where = self.fixed_run_dir or (self.run_dir_prefix / "%j")  # type: ignore[operator]
        return str(where / lay.SLURM_OUTPUT_TEMPLATE)

    @property
    def workers_per_node(self) -> int:
        """torchrun's workers on each node."""
        return self.plan.settings.launch.nproc_per_node


# --------------------------------------------------------------------------------------------
# Validation


def time_limit_s(value: str) -> int | None:
    """Seconds of a SLURM ``--time`` value; None for UNLIMITED. Raises ValueError."""
    text = value.strip()
    if text.lower() in _UNLIMITED:
        return None
    m = _TIME.fullmatch(text)
    if not m:
        raise ValueError(
            f"{value!r} is not a SLURM time (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS)"
        )
    days, a, b, c = m.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        return int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    if c is not None:  # HH:MM:SS
        return int(a) * 3600 + int(b) * 60 + int(c)
    if b is not None:  # MM:SS
        return int(a) * 60 + int(b)
    return int(a) * 60  # minutes


def _sbatch_word_problem(flag: str, value: str) -> tuple[str, str] | None:
    """A value that cannot stand in an ``#SBATCH`` line (SLURM reads one line, double quotes
    for spaces)."""
    if not value.strip():
        return flag, "must not be empty"
    if any(ch in value for ch in '"\n\r\0'):
        return flag, f"{value!r} holds a double quote or a line break, which an #SBATCH line cannot"
    return None


def option_problems(options: SbatchOptions, environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """Problems of the SLURM options alone (the settings are checked by build_plan)."""
    problems: list[tuple[str, str]] = []
    if options.nodes < 1:
        problems.append(("--nodes", f"{options.nodes} must be at least 1"))
    if options.gpus_per_node is not None and options.gpus_per_node < 0:
        problems.append(("--gpus-per-node", f"{options.gpus_per_node} must be 0 or more"))
    if not 1 <= options.signal_grace_s <= MAX_SIGNAL_GRACE_S:
        problems.append(
            ("--signal-grace", f"{options.signal_grace_s} s must be in 1..{MAX_SIGNAL_GRACE_S}")
        )
    if options.time is not None:
        try:
            limit = time_limit_s(options.time)
        except ValueError as exc:
            problems.append(("--time", str(exc)))
        else:
            if limit is not None and limit <= options.signal_grace_s:
                problems.append(
                    (
                        "--signal-grace",
                        f"{options.signal_grace_s} s is not shorter than --time {options.time}"
                        f" ({limit} s): the warning would come before the job starts",
                    )
                )
    for flag, value in (
        ("--time", options.time), ("--partition", options.partition),
        ("--account", options.account), ("--qos", options.qos),
    ):  # fmt: skip
        if value is not None and (p := _sbatch_word_problem(flag, value)):
            problems.append(p)
    for arg in options.sbatch_args:
        name = arg.split("=", 1)[0]
        if not arg.startswith("-"):
            problems.append(
                ("--sbatch-arg", f"{arg!r} is not an sbatch option (e.g. --mail-type=END)")
            )
        elif name in OWNED_SBATCH_OPTIONS:
            problems.append(
                (
                    "--sbatch-arg",
                    f"{name} is written by mlaunch sbatch; use {OWNED_SBATCH_OPTIONS[name]}",
                )
            )
        elif (p := _sbatch_word_problem("--sbatch-arg", arg)) is not None:
            problems.append(p)
        elif "=" not in arg and any(ch.isspace() for ch in arg):
            problems.append(
                ("--sbatch-arg", f"{arg!r}: give a value with spaces as --option=value")
            )
        elif name == "--export":
            kept = arg.split("=", 1)[1].split(",") if "=" in arg else []
            lost = sorted(
                s for s in SECRET_ENV if environ.get(s) and "ALL" not in kept and s not in kept
            )
            if lost:
                problems.append(
                    (
                        "--sbatch-arg",
                        f"{arg} would keep {', '.join(lost)} from the job (the script never holds"
                        " secrets: the job inherits them); add ALL or the names",
                    )
                )
    return problems


def take_scheduler_decided(
    flags: dict[str, Any], decided: Mapping[str, str], command: str, headers_fix: str
) -> list[tuple[str, str]]:
    """What ``mlaunch sbatch`` and ``mlaunch trainjob`` refuse among the setting flags: the values
    the scheduler decides per node (``decided``: setting -> what decides it instead) and the
    collector's credentials, never written into the job's file (``headers_fix``: why, and what
    to do). Each is a problem naming its flag and is taken out of ``flags``, so the rest still
    validates and every problem is said at once."""
    problems = []
    for path, instead in decided.items():
        if flags.get(path) is not None:
            problems.append((flag_name(path), f"not for {command}: {instead}"))
            flags[path] = None
    if flags.get("telemetry.otel.headers") is not None:
        problems.append((flag_name("telemetry.otel.headers"), headers_fix))
        flags["telemetry.otel.headers"] = None
    return problems


def one_worker_per_gpu(flags: dict[str, Any], gpus_per_node: int | None) -> list[str]:
    """``--gpus-per-node G`` without ``--nproc-per-node``: G workers per node (set in
    ``flags``), and the note that says so."""
    if not gpus_per_node or flags.get("launch.nproc_per_node") is not None:
        return []
    flags["launch.nproc_per_node"] = str(gpus_per_node)
    return [f"--nproc-per-node {gpus_per_node}: one worker per GPU (--gpus-per-node)"]


def restart_saves(flags: dict[str, Any], settings: Settings, who: str) -> str | None:
    """A job its scheduler restarts into the same run directory (a requeue, a restarted pod)
    resumes from the newest checkpoint. The graceful stop saves one, but a hard kill (a node
    lost, the grace exceeded) would lose the whole run so far when the run saves nothing else:
    then an interval is chosen (set in ``flags``) and the note that says so is returned (``who``:
    what resumes); None when the run saves already."""
    if settings.training.save_interval != 0:
        return None
    interval = restart_save_interval(settings.training.train_iters)
    flags["training.save_interval"] = str(interval)
    return f"--save-interval {interval}: {who} resumes from the newest checkpoint"


def _job_environ(environ: Mapping[str, str], nodes: int) -> dict[str, str]:
    """The environment node 0's ``mlaunch train`` will see: the submit environment (sbatch
    --export=ALL) with this job's SLURM variables instead of any the submitter runs under."""
    env = {k: v for k, v in environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    env.update(
        {
            JOB_ID_VAR: PLACEHOLDER_JOB_ID,
            "SLURM_NNODES": str(nodes),
            "SLURM_NODEID": "0",
            "SLURM_JOB_NODELIST": "localhost",
        }
    )
    return env


# --------------------------------------------------------------------------------------------
# The job


def plan_job(
    *,
    flags: Mapping[str, Any],
    config: str | None,
    passthrough: Sequence[str],
    environ: Mapping[str, str],
    cwd: Path,
    options: SbatchOptions,
    python: str | None = None,
) -> BatchJob:
    """Validate the whole submission (settings as ``mlaunch train`` does, and the SLURM options)
    and decide the script. Raises :class:`SettingsError` with every problem; creates nothing."""
    flags = dict(flags)
    problems = take_scheduler_decided(
        flags,
        SLURM_DECIDED,
        "mlaunch sbatch",
        "a secret is never written into job.sbatch: export OTEL_EXPORTER_OTLP_HEADERS in this"
        " shell instead (the job inherits it)",
    )
    problems += option_problems(options, environ)
    notes = one_worker_per_gpu(flags, options.gpus_per_node)
    job_env = _job_environ(environ, max(1, options.nodes))
    try:
        plan = build_plan(
            flags=flags, config=config, passthrough=passthrough, environ=job_env, cwd=cwd
        )
    except SettingsError as exc:
        raise SettingsError(problems + exc.problems) from None
    s = plan.settings
    if s.launch.nnodes != options.nodes:
        # Only a config file's [launch] nnodes can disagree (the flag is refused above).
        problems.append(
            (
                str(s.source("launch.nnodes")),
                f"{s.launch.nnodes} nodes, but --nodes {options.nodes}",
            )
        )
    if s.source("launch.node_rank").kind == "file":
        problems.append(
            (
                str(s.source("launch.node_rank")),
                f"not for mlaunch sbatch: {SLURM_DECIDED['launch.node_rank']}",
            )
        )
    if problems:
        raise SettingsError(problems)
    if options.requeue and (note := restart_saves(flags, s, "a requeued job")):
        notes.append(note)
        plan = build_plan(
            flags=flags, config=config, passthrough=passthrough, environ=job_env, cwd=cwd
        )
        s = plan.settings

    fixed = s.launch.run_dir is not None or s.telemetry.run_id is not None
    prefix = None if fixed else plan.run_dir.parent
    environment = {
        k: v
        for k, v in plan.worker_env.items()
        if k not in SECRET_ENV and (k not in PER_JOB_ENV or (k == ec.RUN_ID and fixed))
    }
    return BatchJob(
        plan=plan,
        options=options,
        cwd=cwd,
        python=python or sys.executable,
        run_dir_prefix=prefix,
        fixed_run_dir=plan.run_dir if fixed else None,
        train_args=["--config", str(plan.config), *frozen_flags(plan, cwd)],
        passthrough=list(passthrough),
        environment=environment,
        unset=plan.removed_env,
        secrets=tuple(sorted(k for k in SECRET_ENV if environ.get(k, "").strip())),
        notes=notes,
    )


def _env_covered() -> frozenset[str]:
    """Telemetry settings the exported worker environment carries."""
    paths = {f"telemetry.{f}" for f in TELEMETRY_KEYS.values()}
    return frozenset(paths | {f"{section}.{f}" for section, f in OTEL_ENV.values()})


def frozen_flags(
    plan: LaunchPlan,
    cwd: Path | None,
    *,
    decided: Collection[str] = tuple(SLURM_DECIDED),
    kinds: Collection[str] = ("flag", "file"),
) -> list[str]:
    """Every setting a flag or the config file gave (a source in ``kinds``), as ``mlaunch
    train`` flags, in settings order; telemetry travels in the environment, the engine's
    per-node values (``decided``) are left to the job. Paths are made absolute from ``cwd``
    (None: kept as given, for a container whose file system is not this one)."""
    s = plan.settings
    covered = _env_covered()
    out: list[str] = []
    for path, entry in settings_table(s).items():
        if s.source(path).kind not in kinds:
            continue
        if path in covered or path in decided or path == "launch.run_dir":
            continue
        value = entry["value"]
        flag = flag_name(path)
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif value is None:
            continue
        elif isinstance(value, dict):
            out += [flag, ",".join(f"{k}={v}" for k, v in value.items())]
        else:
            text = str(value)
            if path in PATH_SETTINGS:
                # A script's data_path is Megatron-LM's list of prefixes (and weights): each
                # item made absolute. mlaunch's trainer reads one path (spaces and all).
                megatron_list = path == "training.data_path" and not s.uses_builtin_trainer
                items = text.split() if megatron_list else [text]
                if cwd is not None:
                    text = " ".join(_absolute(t, cwd, weights=megatron_list) for t in items)
            out += [flag, text]
    return out


def _absolute(text: str, cwd: Path, *, weights: bool = False) -> str:
    """A path setting made absolute; with ``weights``, a number (a weight of Megatron-LM's
    ``--data-path 0.3 /a 0.7 /b``) stays as it is."""
    if weights:
        try:
            float(text)
            return text
        except ValueError:
            pass
    p = Path(text).expanduser()
    return str(p if p.is_absolute() else cwd / p)


# --------------------------------------------------------------------------------------------
# The script


def _directive(option: str, value: str | None = None) -> str:
    """One ``#SBATCH`` line; a value with spaces is double-quoted (sbatch reads those)."""
    if value is None:
        return f"#SBATCH {option}"
    if any(ch.isspace() for ch in value):
        value = f'"{value}"'
    return f"#SBATCH {option}={value}"


def _continued(words: list[str], indent: str) -> list[str]:
    """A long command as lines ending in `` \\``: an option and its value on one line."""
    lines: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word.startswith("-") and i + 1 < len(words) and not words[i + 1].startswith("--"):
            lines.append(f"{word} {words[i + 1]}")
            i += 2
        else:
            lines.append(word)
            i += 1
    return [indent + line + " \\" for line in lines]


#: The script's text, one :class:`string.Template` per section of ``job.sbatch.template``.
_TEMPLATE_FILE = Path(__file__).with_name("job.sbatch.template")


@functools.cache
def _templates() -> dict[str, string.Template]:
    """The template file's sections by name (read once; the file says how it is laid out)."""
    sections: dict[str, list[str]] = {}
    lines: list[str] | None = None
    for line in _TEMPLATE_FILE.read_text(encoding="utf-8").splitlines():
        if line.startswith("#% "):
            lines = sections.setdefault(line[3:].strip(), [])
        elif lines is not None:
            lines.append(line)
    return {name: string.Template("\n".join(body)) for name, body in sections.items()}


def _lines(lines: Sequence[str]) -> str:
    """An optional block: each line ended, or nothing (the template puts it at a line's start)."""
    return "".join(line + "\n" for line in lines)


def render_script(job: BatchJob) -> str:
    """The text of ``job.sbatch``: readable, every value quoted, no secret."""
    o, plan = job.options, job.plan
    t = _templates()
    q = shlex.quote
    what = (
        "mlaunch's trainer"
        if plan.settings.uses_builtin_trainer
        else (plan.settings.launch.script or f"-m {plan.settings.launch.module}")
    )
    directives = [
        _directive("--job-name", job.job_name),
        _directive("--nodes", str(o.nodes)),
        _directive("--ntasks-per-node", "1"),
    ]
    if o.exclusive:
        directives.append(_directive("--exclusive"))
    if o.gpus_per_node:
        directives.append(_directive("--gpus-per-node", str(o.gpus_per_node)))
    for option, value in (
        ("--time", o.time), ("--partition", o.partition), ("--account", o.account),
        ("--qos", o.qos),
    ):  # fmt: skip
        if value is not None:
            directives.append(_directive(option, value.strip()))
    directives += [
        _directive("--chdir", str(job.cwd)),
        _directive("--output", job.output_pattern),
        _directive("--open-mode", "append"),
        _directive("--signal", f"B:{WARNING_SIGNAL}@{o.signal_grace_s}"),
        _directive("--requeue" if o.requeue else "--no-requeue"),
    ]
    directives += [_directive(*arg.split("=", 1)) for arg in o.sbatch_args]
    secrets = ""
    if job.secrets:
        checks = "\n".join(t["secret"].substitute(name=name) for name in job.secrets)
        secrets = t["secrets"].substitute(checks=checks) + "\n\n"
    environment = [f"export {k}={q(v)}" for k, v in job.environment.items()]
    environment += [f"unset {name}" for name in job.unset]
    if plan.settings.launch.rdzv_endpoint is None or plan.settings.source(
        "launch.rdzv_endpoint"
    ).kind not in ("flag", "file"):
        # A port derived from the job id collided when ids repeat (a second cluster, a reset
        # controller) or anything else held it: ask this node, where the batch script runs and
        # the rendezvous will listen, for a free one at job start; srun passes it to every node.
        rendezvous = t["rendezvous"].substitute(python=q(job.python), free_port=q(_FREE_PORT_PY))
        environment += rendezvous.splitlines()
    if job.fixed_run_dir is not None:
        run_dir = t["run_dir_fixed"].substitute(run_dir=q(str(job.fixed_run_dir)))
    else:
        run_dir = t["run_dir_per_job"].substitute(
            prefix=q(str(job.run_dir_prefix) + "/"), job_id_var=JOB_ID_VAR
        )
    body = [q(w) for w in job.train_args] + ["--run-dir", '"$RUN_DIR"']
    body_lines = _continued(body, "    ")
    if job.passthrough:
        body_lines.append("    -- " + " ".join(q(w) for w in job.passthrough) + " \\")
    body_lines[-1] = body_lines[-1].removesuffix(" \\") + " &"
    return (
        t["script"].substitute(
            cwd=job.cwd,
            created=time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(job.created)),
            nodes=o.nodes,
            workers=job.workers_per_node,
            what=what,
            config=plan.config.name,
            directives="\n".join(directives),
            secrets=secrets,
            environment=_lines(environment),
            run_dir=run_dir,
            signal=WARNING_SIGNAL,
            grace=o.signal_grace_s,
            requeue_clause=" and requeue the job." if o.requeue else ".",
            notes=_lines([f"# {note} (chosen by mlaunch sbatch)" for note in job.notes]),
            python=q(job.python),
            train_args="\n".join(body_lines),
            requeue=(
                t["requeue"].substitute(stop_request=lay.STOP_REQUEST_FILE) + "\n"
                if o.requeue
                else ""
            ),
        )
        + "\n"
    )
