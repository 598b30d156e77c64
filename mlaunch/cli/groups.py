"""``mlaunch groups list|resolve``: what each span group covers and what a spec turns on."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import typer
from rich.console import Console

from mlaunch.cli.errors import PlainErrorsCommand, PlainErrorsGroup, fail
from mlaunch.cli.render import (
    estimate_line,
    groups_table,
    presets_table,
    span_placement,
    span_tree,
)
from mlaunch.model.groups import SpanGroup
from mlaunch.model.spans import CATALOGUE, estimate_spans_per_iteration
from mlaunch.model.spec import SpanSpecError, format_groups, resolve

app = typer.Typer(
    help="Span groups: list them, resolve a spec.", no_args_is_help=True, cls=PlainErrorsGroup
)

# The embedded default run's shape (configs/tiny.toml): 2 layers, 2 microbatches, 1 stage, 2
# data-parallel replicas (so its grad_sync spans count: a real default run exports them).
_DEFAULT_LAYERS = 2
_DEFAULT_MICROBATCHES = 2
_DEFAULT_DP = 2


@app.command("list", cls=PlainErrorsCommand)
def list_groups(
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Every span group with its description and frequency, and the presets."""
    from mlaunch.model.groups import GROUPS, PRESETS
    from mlaunch.model.segments import TRACE_SEGMENTS

    if as_json:
        payload = {
            "groups": [
                {"name": g.value, "description": i.description, "frequency": i.frequency}
                for g, i in GROUPS.items()
            ],
            "presets": {
                name: format_groups(members).split(",") for name, members in PRESETS.items()
            },
        }
        typer.echo(json.dumps(payload, indent=2))
        return
    console = Console()
    console.print(groups_table())
    console.print(presets_table())
    console.print(f"trace segments: {TRACE_SEGMENTS}", markup=False, highlight=False)
    console.print("[dim]Combine with commas; prefix '-' to exclude, e.g. 'all,-layer'.[/]")


def _from_environment() -> tuple[str, dict[str, dict[str, str]]]:
    """The spec the environment configures and, for every telemetry value set, its source."""
    from mlaunch.settings import SettingsError, load_settings, redact_shown

    try:
        settings = load_settings(environ=os.environ, check_cross_fields=False)
    except SettingsError as exc:
        raise fail(exc.problems) from None
    sources = {
        path: {"value": redact_shown(src.name, str(_value_at(settings, path))), "source": str(src)}
        for path, src in settings.sources().items()
        if path.startswith("telemetry.")
    }
    sources.setdefault(
        "telemetry.span_groups", {"value": settings.telemetry.span_groups, "source": "default"}
    )
    return settings.telemetry.span_groups, sources


def _value_at(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    if isinstance(obj, dict):
        return ",".join(f"{k}=..." for k in obj)
    return obj


@app.command("resolve", cls=PlainErrorsCommand)
def resolve_groups(
    spec: str | None = typer.Argument(
        None, help="Spec such as 'per_step' or 'all,-layer'. Omit to resolve the environment."
    ),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    microbatches: int = typer.Option(
        _DEFAULT_MICROBATCHES, "--microbatches", min=1, help="Microbatches per iteration (N)."
    ),
    layers: int = typer.Option(_DEFAULT_LAYERS, "--layers", min=1, help="Transformer layers (L)."),
    pp: int = typer.Option(1, "--pp", min=1, help="Pipeline-parallel stages (P)."),
    dp: int = typer.Option(_DEFAULT_DP, "--dp", min=1, help="Data-parallel replicas (D)."),
) -> None:
    """The resolved groups, the span tree with each span on or off, and spans per iteration.

    Without SPEC, the spec comes from MEGATRON_OTEL_SPAN_GROUPS / NEMO_LENS_SPAN_GROUPS (the
    whole telemetry environment is validated) and each value's source is shown.
    """
    sources: dict[str, dict[str, str]] = {}
    if spec is None:
        spec, sources = _from_environment()
    try:
        enabled = resolve(spec)
    except SpanSpecError as exc:
        raise fail([("SPEC", str(exc))]) from None
    if layers % pp:
        raise fail([("--layers", f"{layers} layers cannot be split evenly across {pp} stages")])

    per_stage = estimate_spans_per_iteration(
        enabled, microbatches=microbatches, layers=layers, pp=pp, dp=dp
    )
    if as_json:
        placement = span_placement(enabled)
        payload = {
            "spec": spec,
            "groups": [g.value for g in SpanGroup if g in enabled],
            "disabled": [g.value for g in SpanGroup if g not in enabled],
            "spans": [
                {
                    "name": d.name,
                    "alias": d.alias,
                    "extra": d.extra,
                    "megatron_only": d.megatron_only,
                    "goodput": d.goodput,
                    "attributes": list(d.attributes),
                    "extra_attributes": list(d.extra_attributes),
                    "group": d.group.value,
                    "enabled": d.group in enabled,
                    "parent": d.parent,
                    "attaches_to": placement[d.name],
                }
                for d in CATALOGUE
            ],
            "estimate": {
                "microbatches": microbatches,
                "layers": layers,
                "pp": pp,
                "dp": dp,
                "spans_per_iteration_per_stage": per_stage,
                "max_spans_per_iteration_per_rank": max(per_stage),
            },
            "sources": sources,
        }
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")
        return

    console = Console()
    origin = sources.get("telemetry.span_groups", {}).get("source")
    console.print(
        f"[bold]spec[/] {spec!r}"
        + (f"  [dim](from {origin})[/]" if origin else "")
        + f"\n[bold]groups[/] {format_groups(enabled).replace(',', ', ') or '(none)'}"
    )
    if sources:
        for path, info in sorted(sources.items()):
            console.print(
                f"  [dim]{path} = {info['value']!r}  <- {info['source']}[/]", highlight=False
            )
    console.print(groups_table(enabled, compact=True))
    console.print(span_tree(enabled))
    console.print(
        "[dim]G = carries is_goodput_span; + = an mlaunch extra (Megatron-LM emits nothing like "
        "it); readers accept the documented names too.[/]"
    )
    console.print(estimate_line(enabled, microbatches=microbatches, layers=layers, pp=pp, dp=dp))
