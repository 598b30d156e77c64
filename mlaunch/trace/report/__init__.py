"""``mlaunch trace report``: one self-contained HTML file that explains a run.

The file holds everything it needs (plotly.js embedded once, the data as inline JSON, a small
script and stylesheet), so it opens from disk with no network. Sections:

* a header: run id, world layout (nodes x processes, TP/PP/DP), model size, span groups, exporting
  ranks, wall time and goodput;
* a zoomable timeline of a window of iterations: one lane per exporting rank (labelled with its
  pipeline stage), spans nested by depth and coloured by group, the attributes on hover, and
  ``megatron.pp.recv_forward.linked`` spans joined to their sender by arrows;
* the span breakdown of ``mlaunch trace summary`` (a sortable table) and the per-rank step skew;
* training curves from ``progress.jsonl`` (from the step spans' attributes when it is missing);
* the goodput split of ``mlaunch trace goodput`` as stacked bars.

Large runs: the summary, skew and goodput stream over every span (the same aggregators as the
``trace`` commands); only the timeline window's spans are held in memory and written out. The
window is ``--iterations A:B`` (inclusive) or, by default, the first and last
:data:`EDGE_ITERATIONS` iterations (with the set-up before the first and the tail after the last),
the omitted middle drawn as a marked gap. A window is a time range shared by all lanes, from the
earliest start to the latest end of its iterations' steps on any rank; every span overlapping it
is drawn once, clipped to it (so a straggler's neighbouring step shows at the edge). That keeps
a 1,000-iteration ``per_step`` report to plotly.js (about 4.8 MB) plus a few hundred KB. Trace
files are read twice: once for the aggregates and the step times that place the window, once for
the window's spans.

plotly is used only for its JavaScript bundle: figures are written as plain JSON for
``Plotly.newPlot``, which keeps the Python side free of plotly's (slow) figure validation.

The package, in the order the data flows: :mod:`.window` (the iteration window and the two
passes over the span store, column-wise), :mod:`.rundir` (the files beside the traces), :mod:`.timeline` and
:mod:`.charts` (the figures), :mod:`.page` (the HTML; :mod:`.style` holds the names, colours and
number formats they share) and :mod:`.build` (all of it for one run directory).
"""

from __future__ import annotations

from typing import Any

#: The package's public names and the module that defines each. Imported on first use (PEP 562),
#: not here: every submodule's import runs this file first, and one that imported ``.build`` up
#: front would load the whole report (and its store readers) for any one of them.
_EXPORTS = {
    "ReportResult": "build", "render_report": "build", "write_report": "build",
    "default_output": "rundir", "run_directory": "rundir",
    "EDGE_ITERATIONS": "window", "choose_iterations": "window", "parse_iterations": "window",
}  # fmt: skip

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    import importlib

    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
