"""The live view of ``mlaunch status RUN|JOB --watch``: a Rich table refreshed every
:data:`~mlaunch.slurm.watch.REFRESH_S` seconds from :func:`mlaunch.slurm.watch.snapshot`,
until the run ends (the final state is printed, exit 0) or Ctrl-C (exit 0, no traceback)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from mlaunch.model.strategies import format_ranks
from mlaunch.trace.durations import format_ms


def _age(s: float | None) -> str:
    return "-" if s is None else f"{s:.0f} s ago" if s >= 1 else "now"


def render(snap: Any, width: int | None = None) -> Any:
    """The view of one snapshot (a Rich renderable) for a console ``width`` columns wide (None:
    no limit)."""
    from rich import box
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from mlaunch.slurm.status import capture_text, status_text

    st = snap.status
    head = status_text(st).splitlines()[0]
    lines: list[Any] = [Text(head, style="bold")]
    if st.run_dir:
        lines.append(Text(f"run dir: {st.run_dir}"))
    prog = ""
    if snap.iteration is not None:
        prog = f"iteration {snap.iteration}/{snap.train_iters}"
    if snap.goodput is not None:
        prog += f"  goodput {100 * snap.goodput:.1f}% (last {snap.goodput_window_s:.0f} s)"
    if prog:
        lines.append(Text(prog.strip()))

    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("rank", "iteration", "iter time", "tokens/s", "span", "finished"):
        t.add_column(col, justify="left" if col == "span" else "right", no_wrap=True)
    for r in snap.ranks:
        span = r.span or "-"
        t.add_row(
            str(r.rank), "-" if r.iteration is None else str(r.iteration),
            "-" if r.step_ms is None else format_ms(r.step_ms),
            "-" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}",
            f"in {span}" if r.current else span,
            "(now)" if r.current else _age(r.span_age_s),
        )  # fmt: skip
    if snap.ranks:
        lines.append(t)
    else:
        lines.append(Text(
            "no per-rank spans yet (ranks show here when they export to the run directory: "
            "--otel-export-strategy all_ranks and the file exporter)", style="dim"
        ))  # fmt: skip

    strag = snap.straggler
    if strag:
        line = (
            f"straggler: rank {strag['rank']} made others wait {strag['caused_wait_s']:.2f} s "
            f"(of {strag['of_s']:.2f} s waited) late in {strag['phase']}"
        )
        # The line never grows with the run: iterations that do not fit after it go on a line
        # of their own, summed up to the width when they do not fit there either.
        its = f", iterations {format_ranks(strag['iterations'])}"
        if width is not None and len(line + its) > width:
            head = "\n  iterations "
            its = head + format_ranks(strag["iterations"], width - len(head) + 1)
        lines.append(Text(line + its, style="yellow"))
    elif len(snap.ranks) > 1:
        lines.append(Text("straggler: none (no recent waits charged)"))
    since = snap.since_progress_s
    if since is not None or snap.hang_timeout is not None:
        msg = f"last progress {_age(since)}"
        if snap.hang_timeout is not None:
            unit = " s" if snap.hang_timeout.replace(".", "", 1).isdigit() else ""  # a bare number
            msg += f"; hang timeout {snap.hang_timeout}{unit}"
        lines.append(Text(f"hang: {msg}"))
    if snap.hang:
        lines.append(Text(f"hang detected: {snap.hang.get('verdict')}", style="bold red"))
    lines += [Text(f"capture: {capture_text(c)}") for c in snap.captures]
    if snap.recorder_writing:
        lines.append(Text(
            f"recorder: ranks {format_ranks(snap.recorder_writing)} writing their dumps",
            style="yellow",
        ))  # fmt: skip
    elif snap.recorder_dumps:
        lines.append(Text(f"recorder: dumps from ranks {format_ranks(snap.recorder_dumps)}"))
    for f in st.failures:
        lines.append(Text(f"failed: rank {f.rank}: {f.exception_type}: {escape(f.message)}",
                          style="red"))  # fmt: skip
    return Group(*lines)


def watch(target: str, cwd: Path) -> int:
    """Show the live view until the run ends; the exit code (0: the view ended as it should)."""
    from rich.console import Console
    from rich.live import Live

    from mlaunch.slurm.watch import REFRESH_S, WatchState, snapshot

    console = Console()
    state = WatchState()
    try:
        snap = snapshot(target, cwd, state)
        if not snap.live:  # nothing to watch: the final state, once
            console.print(render(snap, console.width))
            return 0
        with Live(
            render(snap, console.width), console=console, auto_refresh=False, transient=False
        ) as live:
            while snap.live:
                time.sleep(REFRESH_S)
                snap = snapshot(target, cwd, state)
                live.update(render(snap, console.width), refresh=True)
    except KeyboardInterrupt:
        console.print("stopped watching (the job goes on)")
        return 0
    if not console.is_terminal:
        console.line()  # Live leaves its last view without a newline off a terminal
    console.print(f"the run ended: {snap.status.state}")
    return 0
