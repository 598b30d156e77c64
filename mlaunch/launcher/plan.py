"""The launch plan: validated settings -> everything ``mlaunch train`` will do, decided up front.

:func:`build_plan` is pure apart from reading the config file (and the trainer's argument parser):
it creates nothing, starts nothing and never imports torch. The run id is chosen here, once; the
torchrun command line, the worker environment, the exporting ranks and the summary all derive from
the one :class:`LaunchPlan`, so ``--dry-run`` shows exactly what a real launch would run.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlaunch import envcontract as ec
from mlaunch.configs import is_shipped
from mlaunch.launcher import lens_names
from mlaunch.launcher.checkpoint_layout import checkpoint_layout_problems, rerun_problems
from mlaunch.launcher.cluster_env import (
    NPROC_WORDS,
    RDZV_CONF_VAR,
    SLURM,
    ClusterSource,
    cluster_launch,
    nproc_count,
    source_of,
)
from mlaunch.launcher.configs import config_launch_keys, os_reason, resolve_config
from mlaunch.launcher.worker_args import (
    MEGATRON_DATA_ARGS,
    MEGATRON_ONLY_ARGS,
    check_trainer_args,
    megatron_data_problems,
    megatron_entry_point,
    otel_flags,
    resolve_megatron_args,
    shadowed_settings,
    trainer_args,
)
from mlaunch.launcher.worker_env import worker_environment
from mlaunch.model.spans import estimate_spans_per_iteration
from mlaunch.model.spec import quoted
from mlaunch.model.strategies import is_custom_strategy
from mlaunch.rundir import layout as lay
from mlaunch.settings import (
    ENDPOINT_PATHS,
    SECRET_ENV,
    Problem,
    Settings,
    SettingsError,
    choose_run_id,
    flag_name,
    is_run_id,
    load_settings,
    redact,
)

#: The trainer's module (``python -m mlaunch.trainer``).
TRAINER_MODULE = "mlaunch.trainer"
#: torchrun, run as a module of the launcher's own interpreter.
TORCHRUN_MODULE = "torch.distributed.run"
REDACTED = "<redacted>"


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
    exporting_ranks: list[int] | None
    """None: a custom strategy, which only the workers call (mlaunch runs no user code)."""
    spans_per_iteration: list[int]
    """Estimated spans per iteration and exporting rank, per pipeline stage."""
    cluster: ClusterSource | None = None
    """The scheduler whose variables this node runs under (SLURM, the Kubeflow torch runtime)."""
    cluster_vars: dict[str, str] = field(default_factory=dict)
    """``{setting path: the variable that gave it}`` for what the scheduler decided (a word
    such as ``PET_NPROC_PER_NODE=auto`` with what it counted), for the summary."""
    embedded_receiver: bool = False
    """A script run whose workers send OTLP to the launcher's embedded receiver on loopback (the
    ``file`` exporter in the reference's language). The plan leaves ``OTEL_EXPORTER_OTLP_ENDPOINT``
    and ``_PROTOCOL`` unset (and drops inherited ones): the launcher sets them when it has started
    the receiver."""
    env_notes: tuple[str, ...] = ()
    megatron_args_reason: str = ""
    """For a script/module: why Megatron-LM's arguments are (not) passed, for the summary."""
    launched_as: dict[str, Any] | None = None
    """How this launch was given (:func:`launched_as`), from which ``mlaunch status``, ``mlaunch
    runs`` and train's closing lines make the command that resumes the run; None: not known."""
    """Environment the plan added on its own (e.g. CUDA_DEVICE_MAX_CONNECTIONS), for the summary."""

    # ---- derived views -------------------------------------------------------------------

    @property
    def slurm(self) -> bool:
        """Whether this node runs in a SLURM job (its job id is the run id; a requeue resumes)."""
        return self.cluster is SLURM

    @property
    def world_size(self) -> int:
        """Total worker processes."""
        return self.settings.world_size

    @property
    def traces_dir(self) -> Path:
        """Where the file exporter writes (one file per exporting rank)."""
        return self.run_dir / lay.TELEMETRY_DIR

    @property
    def rdzv_id(self) -> str:
        """The rendezvous id torchrun is given: ``--rdzv-id``, else the run id."""
        return self.settings.launch.rdzv_id or self.run_id

    @property
    def progress_file(self) -> Path:
        """The trainer's progress records."""
        return self.run_dir / lay.PROGRESS_FILE

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
            "worker_output": self.worker_output(),
            "command": self.argv,
            **({"launched_as": self.launched_as} if self.launched_as else {}),
            "environment": self.shown_env(show_secrets),
            "settings": settings_table(self.settings, show_secrets=show_secrets),
            **(
                {}
                if self.settings.uses_builtin_trainer
                else {"reference": lens_names.reference_view(self.settings)}
            ),
        }

    def worker_output(self) -> dict[str, Any]:
        """What the launcher's console shows of the workers' output: ``tee`` (whether it does)
        and ``ranks`` (the global ranks it shows, of this node's; None: all of them)."""
        launch = self.settings.launch
        shown = launch.shown_ranks
        return {"tee": launch.tee_on, "ranks": sorted(shown) if shown is not None else None}

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


@dataclass(frozen=True)
class DirectoryPlace:
    """Where a directory at ``path`` would be created: its nearest existing ancestor (``path``
    itself when it exists; None when nothing up to the root exists) and, when that is not a
    directory, the file in the way (``blocker``)."""

    path: Path
    anchor: Path | None
    blocker: Path | None

    @classmethod
    def of(cls, path: Path) -> DirectoryPlace:
        """Look ``path`` up on disk; raises OSError when the path itself cannot be looked up
        (e.g. a 5,000-character name: ENAMETOOLONG from stat)."""
        probe = path
        while not probe.exists():
            if probe.parent == probe:
                return cls(path, None, None)
            probe = probe.parent
        return cls(path, probe, None if probe.is_dir() else probe)


def unwritable_reason(path: Path) -> str | None:
    """Why a directory could not be created (or written) at ``path``, or None when it can.

    Checks the nearest existing ancestor, so a run directory under a regular file or in a
    read-only place fails here, before anything is created, not in ``mkdir`` or in a worker.
    """
    try:
        place = DirectoryPlace.of(path)
        if place.blocker == path:
            return f"{quoted(str(path))} exists and is not a directory"
        if place.anchor is None:
            return f"{quoted(str(path))}: no existing parent directory"
        if place.blocker is not None:
            return (
                f"{quoted(str(path))} cannot be created: {str(place.blocker)!r} is a file, not a"
                " directory"
            )
        if not os.access(place.anchor, os.W_OK | os.X_OK):
            return f"{quoted(str(path))} cannot be created: {str(place.anchor)!r} is not writable"
    except OSError as exc:  # e.g. a 5,000-character name: ENAMETOOLONG from stat itself
        return f"{quoted(str(path))} cannot be used: {os_reason(exc)}"
    return None


def torchrun_argv(
    settings: Settings, run_id: str, log_dir: Path, entry: list[str], rdzv_conf: str | None = None
) -> list[str]:
    """``python -m torch.distributed.run`` with the launch settings under torchrun's names
    (and ``--rdzv-conf`` when the plan decided one: :func:`_rdzv_conf`)."""
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
        if rdzv_conf:
            argv += ["--rdzv-conf", rdzv_conf]
    argv += ["--max-restarts", str(launch.max_restarts)]
    # Per-rank stdout/stderr files (and torchelastic error files) under the run directory.
    argv += ["--log-dir", str(log_dir), "--redirects", "3"]
    return argv + entry


# --------------------------------------------------------------------------------------------
# The plan


#: ``mlaunch train`` flags whose value is a secret: never recorded, a marker instead.
SECRET_FLAGS = ("--otlp-headers",)


def launched_as(argv: Sequence[str], cwd: Path) -> dict[str, Any]:
    """How the launch was given (``resolved.json``'s ``launched_as``): the working directory
    and the words after ``mlaunch train`` without ``--run-dir`` (a resume names the run
    directory where it is then: it may have been copied or moved) and with a secret flag's value
    as a marker. :func:`mlaunch.launcher.run_status.resume_command` makes the command of it."""
    words = list(argv)
    tail: list[str] = []
    if "--" in words:  # what follows goes to the script as it is
        i = words.index("--")
        words, tail = words[:i], words[i:]
    out: list[str] = []
    i = 0
    while i < len(words):
        name, eq, _ = words[i].partition("=")
        step = 1 if eq or i + 1 == len(words) else 2
        if name == "--run-dir":
            i += step
            continue
        if name in SECRET_FLAGS:
            out.append(f"{name}={REDACTED}")
            i += step
            continue
        out.append(words[i])
        i += 1
    return {"cwd": str(cwd), "argv": out + tail}


def build_plan(
    *,
    flags: Mapping[str, Any],
    config: str | None = None,
    passthrough: Sequence[str] = (),
    environ: Mapping[str, str],
    cwd: Path,
    argv: Sequence[str] | None = None,
) -> LaunchPlan:
    """Validate every input and decide the whole launch. Raises :class:`SettingsError` listing
    every problem (the caller prints them and exits 2; nothing has been created). ``argv``: the
    words after ``mlaunch train`` as given, for the resume command (None: none is recorded)."""
    config_path = resolve_config(config, cwd)
    settings, cluster, cluster_vars = _load(flags, config_path, environ)
    problems: list[Problem] = []
    run_id = _choose_run_id(settings, environ, problems)
    if settings.launch.nnodes > 1 and settings.launch.rdzv_endpoint is None:
        problems.append(
            Problem(
                flag_name("launch.rdzv_endpoint"),
                "required when --nnodes > 1 (host:port of node 0)",
                "conflict",
            )
        )
    run_dir = _run_dir(settings, run_id, cwd, problems)
    log_dir = run_dir / lay.LOGS_DIR / lay.NODE_LOG_DIR.name(settings.launch.node_rank)
    entry, megatron_why = _entry(settings, run_id, run_dir, passthrough, cwd, problems)
    ranks, spans = _telemetry_estimates(settings)
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
        argv=torchrun_argv(settings, run_id, log_dir, entry, _rdzv_conf(settings, environ)),
        worker_env=worker_env,
        removed_env=removed,
        child_env=child_env,
        exporting_ranks=ranks,
        spans_per_iteration=spans,
        cluster=cluster,
        cluster_vars=cluster_vars,
        embedded_receiver=not settings.uses_builtin_trainer
        and lens_names.embedded_receiver(settings),
        env_notes=notes,
        megatron_args_reason=megatron_why,
        launched_as=launched_as(argv, cwd) if argv is not None else None,
    )


def _load(
    flags: Mapping[str, Any], config_path: Path, environ: Mapping[str, str]
) -> tuple[Settings, ClusterSource | None, dict[str, str]]:
    """(the settings, the scheduler this node runs under, ``{path: variable}`` of what it
    decided). Under a scheduler (:mod:`.cluster_env`: SLURM, the Kubeflow torch runtime) its
    variables fill in the launch settings neither a flag nor the user's config file gave (a
    shipped config's are defaults), each recorded with its variable as the source."""
    cluster = cluster_launch(environ)
    if cluster.conflict is not None:
        raise SettingsError([Problem(*cluster.conflict, "conflict")])
    # A shipped config's values are defaults: the scheduler's win over them.
    keys = set() if is_shipped(config_path) else config_launch_keys(config_path)
    in_file = {f"launch.{k}" for k in keys}

    def given(path: str) -> bool:
        return flags.get(path) is not None or path in in_file

    problems = [Problem(*p) for path, p in cluster.problems.items() if not given(path)]
    values = {path: v for path, v in cluster.values.items() if not given(path)}
    shown = {path: var for path, (_, var) in values.items()}
    word = values.get("launch.nproc_per_node")
    if word is not None and not str(word[0]).isdigit():
        if str(word[0]).lower() not in NPROC_WORDS:
            problems.append(
                Problem(word[1], f"{word[0]!r} is not a number of processes, nor auto, gpu, cpu")
            )
        else:
            # torchrun's words count GPUs or CPUs, as the device allows: resolved with the device
            # the other sources give (a flag, a config file), then validated with the rest.
            del values["launch.nproc_per_node"]
    if problems:
        raise SettingsError(problems)
    if word is not None and "launch.nproc_per_node" not in values:
        first = load_settings(
            flags=flags, environ=environ, config=config_path, cluster=values,
            check_cross_fields=False,
        )  # fmt: skip
        count, how = nproc_count(
            str(word[0]).lower(), word[1], first.launch.device, _device_text(first), environ
        )
        if count is None:
            raise SettingsError([Problem(word[1], how)])
        values["launch.nproc_per_node"] = (count, word[1])
        shown["launch.nproc_per_node"] = how
    settings = load_settings(flags=flags, environ=environ, config=config_path, cluster=values)
    _check_endpoint_flag_used(settings, flags)
    return settings, cluster.source, shown


def _rdzv_conf(settings: Settings, environ: Mapping[str, str]) -> str | None:
    """torchrun's ``--rdzv-conf`` saying which node hosts the c10d store, when the endpoint came
    from the cluster (SLURM's first node, the Kubeflow torch runtime's ``PET_MASTER_ADDR``):
    the node rank says it, node 0 hosts. torchrun's own guess (the endpoint's name is one of
    this machine's) fails on node 0 when the name is a pod's DNS name (not its host name, and
    not published before the pod runs), and holds on every node that shares a machine (both
    then race to bind the port). ``PET_RDZV_CONF`` (what torchrun reads for ``--rdzv-conf``,
    which the flag replaces) is kept, and an ``is_host`` the user gave there wins. An endpoint
    the user gave keeps torchrun's guess."""
    launch = settings.launch
    source = source_of(settings.source("launch.rdzv_endpoint").name)
    if source is None or launch.rdzv_backend != "c10d":
        return None
    given = environ.get(RDZV_CONF_VAR, "").strip().strip(",")
    if "is_host" in {item.partition("=")[0].strip() for item in given.split(",")}:
        return given
    is_host = f"is_host={'true' if launch.node_rank == 0 else 'false'}"
    return f"{given},{is_host}" if given else is_host


def _device_text(settings: Settings) -> str:
    """The device and where it was set, for a message (``device cpu (from tiny.toml ...)``)."""
    source = settings.source("launch.device")
    where = "" if source.kind == "default" else f" (from {source})"
    return f"device {settings.launch.device}{where}"


def _check_endpoint_flag_used(settings: Settings, flags: Mapping[str, Any]) -> None:
    """Refuse an endpoint flag the exporter would leave unused. Over a shipped config's exporter
    the flag has already won (``load_settings``); an exporter the user chose elsewhere (a
    variable, their own config file) is not overridden: the run stops with the fix instead of
    sending nowhere. Both typed as flags is a choice the summary's exporter row spells out."""
    typed = [flag_name(p) for p in ENDPOINT_PATHS if flags.get(p) is not None]
    t = settings.telemetry
    source = settings.source("telemetry.exporter")
    if not typed or not t.enabled or t.exporter == "otlp" or source.kind == "flag":
        return
    raise SettingsError(
        [
            Problem(
                typed[0],
                f"not used: the exporter is {t.exporter!r} from {source}; pass"
                f" {flag_name('telemetry.exporter')} otlp to send there, or drop {typed[0]}",
                "conflict",
            )
        ]
    )


def _run_dir(settings: Settings, run_id: str, cwd: Path, problems: list[Problem]) -> Path:
    """The run directory (absolute); it and the checkpoint directory must be creatable."""
    launch = settings.launch
    run_dir = (
        Path(launch.run_dir).expanduser() if launch.run_dir else lay.default_run_dir(run_id, cwd)
    )
    if not run_dir.is_absolute():
        run_dir = cwd / run_dir
    if (why := unwritable_reason(run_dir)) is not None:
        problems.append(Problem(settings.label("launch.run_dir"), why))
    if settings.training.save is not None:
        save = Path(settings.training.save).expanduser()
        if (why := unwritable_reason(save if save.is_absolute() else cwd / save)) is not None:
            problems.append(Problem(settings.label("training.save"), why))
    return run_dir


def _entry(
    settings: Settings,
    run_id: str,
    run_dir: Path,
    passthrough: Sequence[str],
    cwd: Path,
    problems: list[Problem],
) -> tuple[list[str], str]:
    """(what each worker runs after torchrun's options, why Megatron-LM's arguments are or are
    not passed): mlaunch's trainer with every setting as an argument, or the script/module."""
    launch = settings.launch
    if settings.uses_builtin_trainer:
        targs = trainer_args(settings, run_dir)
        # The trainer's --otel-* flags would override the telemetry mlaunch resolved (and wrote
        # into MEGATRON_OTEL_*): the record would no longer be what ran.
        problems += shadowed_settings(passthrough, lens_names.REFERENCE_OTEL_ARGS)
        problems += check_trainer_args([*targs, *passthrough], settings.world_size)
        problems += checkpoint_layout_problems(settings, targs, cwd)
        problems += rerun_problems(settings, targs, run_dir, run_id)
        return ["-m", TRAINER_MODULE, *targs, *passthrough], ""
    # One decision, stored on the settings: every later reader (the argument list, the
    # translation table, resolved.json) sees the same bool.
    launch.megatron_args, megatron_why = resolve_megatron_args(settings, cwd)
    target = ["-m", launch.module] if launch.module else [str((cwd / launch.script).resolve())]
    extra = []
    if not launch.megatron_args and megatron_entry_point(settings, cwd) is not None:
        # Environment only, but still Megatron-LM's parser: its --otel-* flags after '--' would
        # win over the MEGATRON_OTEL_* variables the summary and resolved.json describe.
        problems += shadowed_settings(passthrough, lens_names.REFERENCE_OTEL_ARGS, only=True)
    if launch.megatron_args:
        extra = trainer_args(settings, run_dir, megatron=True) + otel_flags(settings)
        owned = [*lens_names.REFERENCE_OTEL_ARGS, *(f for f, _ in MEGATRON_ONLY_ARGS.values())]
        # Megatron-LM's data sources are its own (dataset prefixes, weighted lists): verbatim
        # after '--', unless data_path gives one before it too.
        problems += shadowed_settings(passthrough, owned, passed=MEGATRON_DATA_ARGS)
        problems += megatron_data_problems(settings, passthrough)
    problems += lens_names.refusals(settings)
    return [*target, *extra, *passthrough], megatron_why


def _telemetry_estimates(settings: Settings) -> tuple[list[int] | None, list[int]]:
    """(the exporting ranks, estimated spans per iteration per pipeline stage); both empty when
    telemetry is off. A custom strategy is user code: the settings checked that it imports and
    is callable, but only the workers call it (a dry run must not run it: ``os:system`` would),
    so its ranks are None, not known here."""
    t, p = settings.telemetry, settings.parallelism
    if not t.enabled or t.otel.sdk_disabled:
        return [], []
    ranks = None if is_custom_strategy(t.export_strategy) else settings.exporting_ranks()
    spans = estimate_spans_per_iteration(
        t.groups,
        microbatches=settings.num_microbatches,
        layers=settings.model.num_layers,
        pp=p.pipeline_model_parallel_size,
        dp=settings.data_parallel_size,
        offload=settings.training.offload_activations,
    )
    return ranks, spans


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
            f" '.', '_', '-') or --otel-run-id (or {ec.RUN_ID})",
            "conflict",
        )
    )
    return "invalid"
