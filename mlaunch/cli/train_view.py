"""Rich views of ``mlaunch train``: the pre-launch summary, the live progress and the end-of-run
report.

The launcher only plans (:mod:`mlaunch.launcher.plan`) and runs (:mod:`mlaunch.launcher.run`);
it reports progress through the display that ``mlaunch train`` hands it, one of the two here.
The span tree comes from :mod:`mlaunch.cli.render`, the same one ``mlaunch groups resolve``
draws, so both always agree.
"""

from __future__ import annotations

import os
import shlex
import signal
import statistics
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from mlaunch.cli.render import span_tree
from mlaunch.launcher import lens_names
from mlaunch.launcher.checkpoint_layout import resume_iteration
from mlaunch.launcher.plan import LaunchPlan
from mlaunch.launcher.run import RunResult, torchrun_log
from mlaunch.launcher.run_status import resumable_text, saved_since
from mlaunch.model.groups import SpanGroup
from mlaunch.model.segments import block_iterations, train_block
from mlaunch.model.spans import SpanName
from mlaunch.model.spec import format_groups
from mlaunch.rundir import layout as lay
from mlaunch.rundir.records import ProgressEval, ProgressRecord, StopRequest
from mlaunch.settings import (
    RATIO_SAMPLERS,
    flag_name,
    otlp_timeout_warning,
    telemetry_off_reason,
)

# --------------------------------------------------------------------------------------------
# Before launch


def _ranks_text(ranks: list[int] | None, world: int, strategy: str = "") -> str:
    if ranks is None:
        return f"decided in each worker by {strategy!r} (mlaunch does not call user code)"
    if not ranks:
        return "none"
    if ranks == list(range(world)):
        return f"all {world} ({', '.join(map(str, ranks))})" if world <= 16 else f"all {world}"
    return ", ".join(map(str, ranks)) + f"  ({len(ranks)} of {world})"


def _sampler_text(plan: LaunchPlan) -> str:
    t = plan.settings.telemetry
    if not plan.settings.uses_builtin_trainer:
        return lens_names.rank_sampler_text(plan.settings)  # as nemo-lens applies them
    name = t.otel.traces_sampler or "parentbased_always_on"
    arg = t.otel.traces_sampler_arg
    if arg is None:
        trace = name
    elif name in RATIO_SAMPLERS:
        trace = f"{name} (ratio {arg})"
    else:  # the SDK ignores the argument of a sampler that takes none
        trace = f"{name} (OTEL_TRACES_SAMPLER_ARG={arg} ignored: not a ratio sampler)"
    if t.sampler_enabled:
        return f"trace: {trace}; rank-aware: on, keeps ranks under rate {t.export_sample_rate} (composed)"
    return f"trace: {trace}; rank-aware: off"


#: Fewer ``megatron.train`` blocks than this, and a trace-id ratio is not a share of the spans
#: but a coin toss over a handful of blocks (each kept or dropped whole).
MIN_SAMPLED_BLOCKS = 10


def block_iters(plan: LaunchPlan) -> tuple[int, bool]:
    """Iterations per ``megatron.train`` block (a trace) of the workers mlaunch's trainer runs,
    by the runtime's one rule, and whether the save interval set them: the trainer's arguments
    carry ``--save-interval`` only when it saves periodically (``--max-restarts``'s included)."""
    argv = plan.argv
    interval = argv[argv.index("--save-interval") + 1] if "--save-interval" in argv[:-1] else ""
    saving = int(interval) if interval.isdigit() else 0
    return block_iterations(saving, plan.settings.telemetry.trace_segment_iters), saving > 0


def traces_text(plan: LaunchPlan) -> str:
    """How many traces each worker start writes, and why (:data:`TRACE_SEGMENTS`)."""
    per, by_saves = block_iters(plan)
    blocks = train_block(plan.settings.training.train_iters, per) + 1
    why = "--save-interval: the run saves" if by_saves else "--otel-trace-segment-iters"
    return (
        f"{1 + blocks} per worker start: start-up, then {blocks} {SpanName.TRAIN} block(s) of"
        f" up to {per} iterations ({why})"
    )


def sampling_unit(plan: LaunchPlan) -> tuple[str, str | None] | None:
    """With a trace-id ratio sampler on mlaunch's trainer: (what the sampling unit is, a warning
    when the run has too few of them for the ratio to mean anything), else None. Every span of a
    ``megatron.train`` block shares its trace id, so the ratio keeps or drops whole blocks."""
    s = plan.settings
    o = s.telemetry.otel
    if not s.uses_builtin_trainer or o.traces_sampler not in RATIO_SAMPLERS:
        return None
    ratio = 1.0 if o.traces_sampler_arg is None else o.traces_sampler_arg
    per, _ = block_iters(plan)
    blocks = -(-s.training.train_iters // per)
    unit = (
        f"a whole {SpanName.TRAIN} block ({min(per, s.training.train_iters)} iterations; all its"
        f" spans kept or dropped together); this run has {blocks}"
    )
    warn = None
    if blocks < MIN_SAMPLED_BLOCKS:
        warn = (
            f"ratio {ratio} over {blocks} block(s) keeps all or none of each, not {ratio:.0%} of"
            f" the spans; use at least {MIN_SAMPLED_BLOCKS} blocks"
            f" ({flag_name('telemetry.trace_segment_iters')}"
            f" <= {max(1, s.training.train_iters // MIN_SAMPLED_BLOCKS)}) or no ratio sampler"
        )
    return unit, warn


def _exporter_text(plan: LaunchPlan) -> str:
    t = plan.settings.telemetry
    if plan.embedded_receiver:
        return f"otlp -> embedded OTLP receiver on loopback -> {plan.traces_dir}"
    if t.exporter != "otlp" and t.otel.endpoint_configured:
        # An explicit exporter (often a config file's) wins over an endpoint given elsewhere;
        # say so, or a user who passed --otlp-endpoint would wait for spans that never come.
        src = plan.settings.source("telemetry.exporter")
        ignored = (
            f" [OTLP endpoint {_public(t.otel.endpoint)} not used: exporter is {t.exporter!r} from {src};"
            " pass --otel-exporter otlp]"
        )
    else:
        ignored = ""
    if t.exporter == "file":
        return f"file -> {plan.traces_dir}/traces-rank{{R}}.jsonl" + ignored
    if t.exporter == "otlp":
        from mlaunch.launcher.receiver_wiring import receiver_mode

        if receiver_mode(plan.settings) == "relay":
            return (
                f"otlp ({t.otel.protocol}) -> relay in the launcher (loopback) ->"
                f" {_public(t.otel.endpoint)};"
                f" undelivered spans spooled to {plan.traces_dir} (--no-otlp-relay: direct)"
            )
        return f"otlp ({t.otel.protocol}) -> {_public(t.otel.endpoint)}"
    if t.exporter == "console":
        return "console -> each exporting rank's stdout log" + ignored
    return "none (decisions made, nothing exported)" + ignored


def _checkpoint_text(plan: LaunchPlan) -> str:
    """Where checkpoints go and how often, read back from the trainer arguments (so the summary
    says exactly what the workers get, including the defaults ``--max-restarts`` adds)."""
    argv = plan.argv

    def value(flag: str) -> str | None:
        return argv[argv.index(flag) + 1] if flag in argv[:-1] else None

    save = value("--save")
    if save is None:
        return ""
    interval = value("--save-interval")
    text = f"{save}, every {interval} iterations" if interval else f"{save}, at the end"
    if value("--load"):
        text += f"; resuming from {value('--load')}"
    restarts = plan.settings.launch.max_restarts
    if restarts:
        text += f"; up to {restarts} restart(s), each resuming from the newest valid checkpoint"
    return text


def summary(plan: LaunchPlan) -> Group:
    """Configuration, world layout, exporting ranks, samplers, exporter, span tree, estimate."""
    s = plan.settings
    launch, t, p = s.launch, s.telemetry, s.parallelism
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")  # paths fold rather than lose their middle
    table.add_row("run id", plan.run_id)
    table.add_row("run dir", str(plan.run_dir))
    table.add_row("config", str(plan.config))
    target = launch.script or (f"-m {launch.module}" if launch.module else "mlaunch trainer")
    table.add_row("entry point", target)
    # The model, training and parallelism settings reach a script only as Megatron-LM's
    # arguments: without them the script never sees the config's values, so none is shown.
    passed = s.uses_builtin_trainer or bool(launch.megatron_args)
    if not s.uses_builtin_trainer:
        table.add_row("megatron args", megatron_args_text(plan))
    if passed:
        table.add_row(
            "model",
            f"{s.model.num_layers} layers, hidden {s.model.hidden_size},"
            f" {s.model.num_attention_heads} heads, seq {s.model.seq_length}",
        )
        tr = s.training
        table.add_row(
            "training",
            f"{tr.train_iters} iterations, global batch {tr.global_batch_size} (micro"
            f" {tr.micro_batch_size} x {s.num_microbatches} microbatches x DP"
            f" {s.data_parallel_size}), lr {tr.lr}, {tr.precision}",
        )
    ckpt = _checkpoint_text(plan)
    if ckpt:
        table.add_row("checkpoints", ckpt)
    split = (
        f" tensor {p.tensor_model_parallel_size} x pipeline {p.pipeline_model_parallel_size}"
        f" x data {s.data_parallel_size};"
        if passed
        else ""
    )

    def given(path: str) -> str:
        # What the scheduler decided names its variable (SLURM_NODEID, PET_NODE_RANK).
        var = plan.cluster_vars.get(path)
        return f" (from {var})" if var else ""

    table.add_row(
        "world",
        f"{launch.nnodes} node(s){given('launch.nnodes')} x {launch.nproc_per_node}"
        f" processes{given('launch.nproc_per_node')} = {s.world_size} ranks;"
        f"{split} device {launch.device}",
    )
    if launch.nnodes > 1 or launch.rdzv_endpoint:
        table.add_row(
            "rendezvous",
            f"node rank {launch.node_rank}{given('launch.node_rank')}, {launch.rdzv_backend} at"
            f" {launch.rdzv_endpoint}{given('launch.rdzv_endpoint')},"
            f" id {plan.rdzv_id}{given('launch.rdzv_id')}",
        )
    else:
        table.add_row("rendezvous", "standalone (torchrun picks a free local port)")
    table.add_row("worker output", Text(worker_output_text(plan)))  # "[rank R]" is not markup
    parts: list[Any] = [table]
    if not t.enabled:
        why = telemetry_off_reason(
            str(s.source("telemetry.enabled")), sdk_disabled=t.otel.sdk_disabled
        )
        table.add_row("telemetry", Text(f"off ({why})"))  # a file key's "[section]" is text
        for note in plan.env_notes:
            table.add_row("environment", note)
        return Group(Panel(Group(*parts), title="mlaunch train"))
    groups = format_groups(t.groups).replace(",", ", ") or "(none)"
    table.add_row("telemetry", f"on, span groups {t.span_groups!r} = {groups}")
    table.add_row(
        "export strategy",
        t.export_strategy
        + (f" (rank {t.export_rank})" if t.export_strategy == "single_rank" else ""),
    )
    table.add_row(
        "exporting ranks", _ranks_text(plan.exporting_ranks, s.world_size, t.export_strategy)
    )
    table.add_row("samplers", _sampler_text(plan))
    if (unit := sampling_unit(plan)) is not None:
        table.add_row("sampling unit", unit[0])
        if unit[1]:
            table.add_row(Text("warning", style="bold yellow"), Text(unit[1], style="yellow"))
    table.add_row("exporter", Text(_exporter_text(plan)))  # paths and "[section]" are not markup
    if t.otel.timeout_s is not None:
        label = s.label("telemetry.otel.timeout_s")
        if (long := otlp_timeout_warning(label, t.otel.timeout_s)) is not None:
            table.add_row(Text("warning", style="bold yellow"), Text("; ".join(long), "yellow"))
    table.add_row("service", f"{t.service_name}  (run id {plan.run_id})")
    for note in plan.env_notes:
        table.add_row("environment", note)
    if not s.uses_builtin_trainer:
        return Group(Panel(Group(*_worker_rows(plan, table)), title="mlaunch train"))
    if plan.spans_per_iteration:
        per = plan.spans_per_iteration
        est = (
            f"~{per[0]} per iteration per exporting rank"
            if len(per) == 1
            else f"~{max(per)} per iteration per exporting rank at most ("
            + ", ".join(f"stage {i}: {n}" for i, n in enumerate(per))
            + ")"
        )
        table.add_row("spans", est)
    table.add_row("traces", traces_text(plan))
    parts.append(span_tree(t.groups, title="active span tree"))
    return Group(Panel(Group(*parts), title="mlaunch train"))


def _worker_rows(plan: LaunchPlan, table: Table) -> list[Any]:
    """A script worker's side: what mlaunch rewrote into the reference's language, and the span
    names that worker will emit (the catalogue's non-extra spans of the enabled groups)."""
    s = plan.settings
    for line in lens_names.translations(s):
        table.add_row("translated", Text(line))
    groups = s.telemetry.groups
    names = Table(title="span names the worker will emit", show_lines=False, box=None)
    names.add_column("group", style="cyan", no_wrap=True)
    names.add_column("spans")
    for group in SpanGroup:
        if group in groups:
            spans = lens_names.reference_span_names({group})
            names.add_row(group.value, ", ".join(spans) if spans else "(none in the catalogue)")
    return [table, names]


def worker_output_text(plan: LaunchPlan) -> str:
    """Which ranks' output this console shows (``--tee``, ``--local-ranks-filter``), and where
    all of it goes."""
    launch = plan.settings.launch
    logs = f"per-rank logs in {plan.log_dir}"
    if not launch.tee_on:
        why = "the live view shows progress" if launch.tee is None else "--no-tee"
        return f"{logs} ({why}; --tee shows it here)"
    shown = launch.shown_ranks
    if shown is None:
        which = f"all {launch.world_size} ranks" if launch.nnodes == 1 else "this node's ranks"
        how = "--tee"
    else:
        which = ("rank " if len(shown) == 1 else "ranks ") + ",".join(map(str, sorted(shown)))
        which += " (those of this node)" if launch.nnodes > 1 else ""
        how = "--local-ranks-filter"
    return f"{which} here as [rank R] lines ({how}), and in the {logs}"


def megatron_args_text(plan: LaunchPlan) -> str:
    """Whether a script/module gets Megatron-LM's arguments, why, and how to change it."""
    if plan.settings.launch.megatron_args:
        return f"passed ({plan.megatron_args_reason}; --no-megatron-args: environment only)"
    return f"not passed ({plan.megatron_args_reason}; --megatron-args to pass them)"


def dry_run_text(plan: LaunchPlan, show_secrets: bool = False) -> str:
    """What ``--dry-run`` prints: the command and the environment, pasteable."""
    lines = ["# command", shlex.join(plan.argv), "", "# environment (set by mlaunch)"]
    lines += plan.env_lines(show_secrets)
    if plan.removed_env:
        lines += ["", "# removed from the inherited environment (one truth for workers)"]
        lines += [f"unset {name}" for name in plan.removed_env]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# While running


def _fmt(value: object, spec: str) -> str:
    """A record's number in ``spec``, or "-" where the record has none."""
    return format(value, spec) if isinstance(value, int | float) else "-"


def _saves(plan: LaunchPlan) -> bool:
    """Whether mlaunch's trainer saves checkpoints in this run (``--save`` in its arguments)."""
    return plan.settings.uses_builtin_trainer and "--save" in plan.argv[:-1]


def stop_text(plan: LaunchPlan) -> str:
    """What the workers do on the forwarded SIGTERM, as far as mlaunch knows: its trainer
    finishes the iteration, saves when checkpoints are configured and flushes telemetry when it
    is on; a script does what it does."""
    if not plan.settings.uses_builtin_trainer:
        return "stop"
    steps = ["finish the iteration"]
    if _saves(plan):
        steps.append("save")
    if plan.settings.telemetry.enabled:
        steps.append("flush telemetry")
    return steps[0] if len(steps) == 1 else ", ".join(steps[:-1]) + " and " + steps[-1]


def starting_text(plan: LaunchPlan) -> str:
    """Said once torchrun runs, so the seconds before the first record (the workers import
    torch, meet at the rendezvous and build the model) are not silent."""
    launch = plan.settings.launch
    where = f" on {launch.nnodes} nodes" if launch.nnodes > 1 else ""
    first = ""
    if plan.settings.uses_builtin_trainer:
        argv = plan.argv
        load = argv[argv.index("--load") + 1] if "--load" in argv[:-1] else None
        resumed = resume_iteration(Path(load)) if load else None
        first = (
            f", loading the checkpoint of iteration {resumed}; iteration {resumed + 1} follows"
            if resumed is not None
            else "; iteration 1 follows"
        )
    return (
        f"starting {plan.settings.world_size} worker(s){where} (torchrun): importing torch,"
        f" rendezvous, building the model{first} ..."
    )


def restart_text(plan: LaunchPlan, restart: Any, max_restarts: int) -> str:
    """A torchrun restart, as it happens: which one, what ended the attempt before, and where
    the restarted workers resume."""
    resume = (
        "; resuming from the newest valid checkpoint" if _saves(plan) else "; starting over"
    ) if plan.settings.uses_builtin_trainer else ""  # fmt: skip
    return (
        f"restart {restart.attempt} of {max_restarts}: {restart.cause}; torchrun started the"
        f" workers again{resume}"
    )


def hang_lines(report: Any, plan: LaunchPlan | None) -> list[str]:
    """A hang as the terminal shows it: what was silent, each group of ranks, the report."""
    lines = [
        f"hang: no progress for {report.silent_s:.0f} s (timeout {report.timeout_s:g} s;"
        f" watched: {report.source}); verdict after {report.collect_s:.1f} s:"
    ]
    lines += [f"  {part}" for part in report.verdict.split("; ")]
    if plan is not None:
        lines.append(f"  report: {lay.hang_dir(plan.run_dir) / lay.HANG_REPORT_FILE}")
    if report.action == "stop":
        lines.append("  stopping the workers (SIGTERM, then SIGKILL)")
    return lines


class PlainDisplay:
    """One line per progress record (stdout is not a terminal: CI logs, files, pipes)."""

    def __init__(
        self, console: Console, log_interval: int = 1, plan: LaunchPlan | None = None,
        output: Console | None = None,
    ) -> None:  # fmt: skip
        self.console = console
        self.log_interval = max(1, log_interval)
        self.plan = plan
        #: Where the workers' lines go (``--tee``): this node's terminal, also on a node whose
        #: progress view goes to its ``launcher.log``.
        self.output = output or console

    def worker_output(self, text: str) -> None:
        """Whole ``[rank R] ...`` lines of the workers, written as they are: one write under the
        console's lock (the lock Rich writes under), so neither another batch nor one of this
        display's own lines can come between the parts of a line."""
        out = self.output
        with out._lock:  # Rich's write lock (no public name): its own prints take it too
            out.file.write(text)
            out.file.flush()

    def record(self, record: ProgressRecord) -> None:
        """Print a record at each log interval (and the first and last iterations)."""
        if isinstance(record, ProgressEval):
            self.console.print(
                f"eval at iteration {record.iteration}: loss {_fmt(record.eval_loss, '.4f')}",
                highlight=False,
                soft_wrap=True,
            )
            return
        iteration = record.iteration
        if isinstance(iteration, int) and not (
            iteration % self.log_interval == 0 or iteration == 1 or iteration == record.train_iters
        ):
            return
        self.console.print(
            f"iteration {record.iteration}/{record.train_iters}"
            f" | loss {_fmt(record.loss, '.4f')} | lr {_fmt(record.lr, '.2e')}"
            f" | grad norm {_fmt(record.grad_norm, '.3f')}"
            f" | {_fmt(record.tokens_per_sec, ',.0f')} tokens/s"
            f" | {_fmt(record.step_ms, '.1f')} ms/step" + (" | skipped" if record.skipped else ""),
            highlight=False,
            soft_wrap=True,
        )

    def interrupted(self, signum: int, forced: bool = False, by: StopRequest | None = None) -> None:
        """Say that a signal was forwarded (``by``: the ``mlaunch stop`` that sent it), or that a
        second Ctrl-C or ``mlaunch stop --now`` forced the stop."""
        name = signal.Signals(signum).name
        if by is not None:
            name = f"{name} from mlaunch stop{' --now' if by.now else ''}" + (
                f" by {by.user}" if by.user else ""
            )
        if forced and signum != signal.SIGINT:  # only `mlaunch stop --now` forces another
            text = f"{name}: killing the workers (SIGKILL); nothing is saved"
        elif forced:
            text = f"{name} again: killing the workers (SIGKILL)"
        else:
            todo = stop_text(self.plan) if self.plan is not None else "stop"
            text = f"{name}: asking the workers to {todo}; waiting for workers to stop" + (
                " (Ctrl-C again to force)" if signum == signal.SIGINT else ""
            )
        self.console.print(text, highlight=False, soft_wrap=True)

    def restarted(self, restart: Any, max_restarts: int) -> None:
        """Say that torchrun restarted the workers (the bar, if any, goes on below)."""
        if self.plan is None:
            text = f"restart {restart.attempt} of {max_restarts}: {restart.cause}"
        else:
            text = restart_text(self.plan, restart, max_restarts)
        self.console.print(Text(text, style="yellow"), soft_wrap=True)

    def hang(self, report: Any) -> None:
        """The watchdog's verdict, one line per group of ranks, and what happens next."""
        self.console.print(Text("\n".join(hang_lines(report, self.plan)), style="bold red"),
                           soft_wrap=True)  # fmt: skip

    def telemetry_off(self, rank: int, reason: str) -> None:
        """A rank whose telemetry is off although it was asked for (its progress beat says why):
        its spans are missing from the run, so the console says so as soon as it is known."""
        self.console.print(
            Text(f"telemetry off on rank {rank}: {reason}; its spans are not recorded",
                 style="yellow"),
            soft_wrap=True,
        )  # fmt: skip

    def close(self) -> None:
        """Nothing to tear down."""


class BarDisplay(PlainDisplay):
    """A Rich progress bar: iteration/total, loss, tokens/s, elapsed and ETA."""

    def __init__(self, console: Console, total: int, plan: LaunchPlan | None = None) -> None:
        super().__init__(console, 1, plan)
        self.progress = Progress(
            TextColumn("[bold]train[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self.task = self.progress.add_task("train", total=total, loss="-", tps="-")
        self.progress.start()

    def record(self, record: ProgressRecord) -> None:
        """Advance the bar (evaluation results are printed above it)."""
        if isinstance(record, ProgressEval):
            super().record(record)
            return
        self.progress.update(
            self.task,
            completed=int(record.iteration or 0),
            total=int(record.train_iters or self.progress.tasks[0].total or 0),
            loss=_fmt(record.loss, ".4f"),
            tps=_fmt(record.tokens_per_sec, ",.0f"),
        )

    def worker_output(self, text: str) -> None:
        """The workers' lines above the bar, which stays the last thing on the screen: printed
        through Rich, which takes the bar away, writes them and draws it again below, in one
        write. No markup, highlighting or wrapping: the lines are shown as the workers wrote
        them (a long one is wrapped by the terminal, not cut)."""
        self.console.out(text, end="", highlight=False)

    def close(self) -> None:
        """Stop redrawing."""
        self.progress.stop()


# --------------------------------------------------------------------------------------------
# After the run


def _public(endpoint: str) -> str:
    """``endpoint`` without credentials (``user:password@``): the report is printed and logged."""
    scheme, sep, rest = endpoint.partition("://")
    host, slash, path = rest.partition("/")
    return scheme + sep + host.rpartition("@")[2] + slash + path if sep else endpoint


def _otlp_lines(plan: LaunchPlan, result: RunResult) -> list[str]:
    """Where an OTLP run's spans went, as counted (never "sent" when they were spooled), and the
    ``mlaunch trace replay`` command when some wait in the spool."""
    t = plan.settings.telemetry
    endpoint = _public(t.otel.endpoint or "")
    lines: list[str] = []
    if plan.embedded_receiver and result.receiver is not None:
        written = result.receiver.signals["traces"].written_items
        return [f"traces:  {written:,} spans written to {plan.traces_dir} (run id {plan.run_id})"]
    if result.receiver is not None and result.receiver.mode == "relay":
        c = result.receiver.signals["traces"]
        delivered, spooled, dropped = c.forwarded_items, c.spooled_items, c.lost_items
        emitted = c.received_items
    else:
        counts = result.span_counts
        if counts is None:
            return [f"traces:  sent to {endpoint} (run id {plan.run_id}; no delivery counts)"]
        emitted, delivered = counts["emitted"], counts["delivered"]
        spooled, dropped = counts["spooled"], counts["dropped"]
    lines.append(
        f"traces:  {emitted:,} spans: {delivered:,} delivered to {endpoint}, {spooled:,} spooled"
        f" to {plan.traces_dir}/spool-traces-*.jsonl"
        + (f", {dropped:,} dropped" if dropped else "")
        + f" (run id {plan.run_id})"
    )
    if spooled:
        # replay takes the collector's base URL (it adds /v1/traces itself over HTTP).
        base = _public(t.otel.base_endpoint or endpoint.removesuffix("/v1/traces"))
        replay = ["mlaunch", "trace", "replay", str(plan.run_dir), "--endpoint", base]
        if t.otel.protocol == "http/protobuf":
            replay += ["--protocol", "http/protobuf"]
        lines.append(f"send them: {shlex.join(replay)}  (once the collector is reachable)")
    return lines


def _strangers(result: RunResult) -> list[str]:
    """A line when the receiver refused senders without the job's token (someone else on the
    node tried to write into the job's telemetry: nothing of it was kept)."""
    if result.receiver is None:
        return []
    n = sum(c.unauthenticated_requests for c in result.receiver.signals.values())
    if not n:
        return []
    return [f"receiver: refused {n:,} request(s) without this job's token (nothing kept)"]


def print_result(
    console: Console, plan: LaunchPlan, result: RunResult, report: Path | None = None
) -> None:
    """Failures (which rank, which node, the exception, the log's last lines), the run's numbers
    and where its traces are. Paths and commands are plain lines, whole, to copy and paste."""
    for f in result.failures:
        who = f"rank {f.rank}" if f.rank is not None else f"local rank {f.local_rank}"
        where = []
        if f.node is not None:
            where.append(f"node {f.node}")
        if f.local_rank is not None and f.rank is not None:
            where.append(f"local rank {f.local_rank}")
        head = who + (f" ({', '.join(where)})" if where else "") + " failed"
        # Plain, unwrapped lines (soft_wrap): paths stay whole for copying, and Text rather than
        # markup because log lines carry "[rank1]:" prefixes that Rich would eat as tags.
        what = f"{f.exc_type}: {f.message}" if f.message else f.exc_type
        console.print(Text(f"{head}: {what}", style="bold red"), soft_wrap=True)
        if f.log_path is not None and f.log_tail:
            console.print(Text(f"last lines of {f.log_path}:"), soft_wrap=True)
            for line in f.log_tail:
                console.print(Text("  " + line), soft_wrap=True)
        elif f.log_path is None:
            console.print(Text("  (its log is on the node that ran it)"), soft_wrap=True)
    if result.hang is not None:
        h = result.hang
        console.print(
            Text(f"hung (attempt {h.attempt}, no restart left): {h.verdict}", style="bold red"),
            soft_wrap=True,
        )
        console.print(
            Text(f"hang report: {lay.hang_dir(plan.run_dir) / lay.HANG_REPORT_FILE}"),
            soft_wrap=True,
        )
    elif result.rendezvous_failure is not None:
        # One line, not torchrun's traceback: its cause is chained under "See inner exception".
        launch = plan.settings.launch
        at = f" at {launch.rdzv_endpoint}" if launch.rdzv_endpoint else ""
        console.print(
            Text(f"rendezvous{at} failed: {result.rendezvous_failure}", style="bold red"),
            soft_wrap=True,
        )
        console.print(Text(f"torchrun's log: {torchrun_log(plan)}"), soft_wrap=True)
    elif result.exit_code != 0 and not result.failures and result.interrupted is None:
        console.print(
            Text(
                f"torchrun exited with {result.exit_code}; last lines of {torchrun_log(plan)}:",
                style="bold red",
            ),
            soft_wrap=True,
        )
        for line in result.torchrun_tail or ["(no output)"]:
            console.print(Text("  " + line), soft_wrap=True)
    train = result.train_records
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    status = "ok" if result.exit_code == 0 else f"exit code {result.exit_code}"
    if result.interrupted is not None:
        status += f" (after {signal.Signals(result.interrupted).name})"
    table.add_row("status", status)
    if train:
        last = train[-1]
        table.add_row("iterations", f"{last.iteration}/{last.train_iters}")
        table.add_row("final loss", _fmt(last.loss, ".4f"))
        tps = [r.tokens_per_sec for r in train if isinstance(r.tokens_per_sec, int | float)]
        if tps:
            table.add_row("tokens/s", f"{statistics.mean(tps):,.0f} (mean of {len(tps)} records)")
    table.add_row("wall time", f"{result.wall_s:.1f} s")
    console.print(
        Panel(table, title="run", border_style="green" if result.exit_code == 0 else "red")
    )
    plain = [f"run dir: {plan.run_dir}", f"logs:    {plan.log_dir}"]
    if (
        result.interrupted is not None
        and not result.failures
        and result.hang is None
        and saved_since(plan.run_dir, result.started)
    ):
        # What `mlaunch status` says of the run: said here too, where the user is looking.
        job_id = os.environ.get("SLURM_JOB_ID") if plan.slurm else None  # requeued, not rerun
        plain.append(resumable_text(plan.run_dir, job_id))
    t = plan.settings.telemetry
    if t.enabled and t.exporter == "file":
        files = result.trace_files
        only_job = bool(files) and not any(f.match(lay.TRACES_FILE_GLOB) for f in files)
        what = ": the launcher's job trace only; the workers exported no spans" if only_job else ""
        plain.append(f"traces:  {plan.traces_dir} ({len(files)} file(s){what})")
        plain.append(f"read them: mlaunch trace summary {shlex.quote(str(plan.run_dir))}")
        if report is not None:
            plain.append(f"report:  {report}  (open it in a browser)")
        else:
            plain.append(f"report:  mlaunch trace report {shlex.quote(str(plan.run_dir))}")
    elif t.enabled and t.exporter == "otlp":
        plain += _otlp_lines(plan, result)
    plain += [
        f"telemetry off on rank {rank}: {reason}"
        for rank, reason in sorted(result.telemetry_off.items())
    ]
    plain += run_model_lines(plan.run_dir, result.started)
    plain += _strangers(result)
    for line in plain:
        console.print(line, soft_wrap=True, highlight=False, markup=False)


def run_model_lines(run_dir: Path, started: float | None) -> list[str]:
    """This launch's captures and recorder dumps as ``mlaunch status`` shows them (the same
    run model, read once the run ended: a capture still open at the end is missed)."""
    from mlaunch.rundir.state import RunState
    from mlaunch.slurm.status import capture_text, dumps_text

    model = RunState.read(run_dir, ended=True, since=started).as_json()
    lines = [f"capture: {capture_text(c)}" for c in model["captures"]]
    if model["dumps"]:
        lines.append(f"recorder: {dumps_text(model['dumps'])}")
    return lines
