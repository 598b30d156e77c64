"""Live capture for workers that trace through nemo-lens (Megatron-LM): code mlaunch injects into
the worker process, since such a worker never calls mlaunch.

How it gets there (``opentelemetry-instrument``'s way): for a ``--script``/``--module`` run with
telemetry on, the launcher puts :data:`SITE_DIR` first on the workers' ``PYTHONPATH``
(``mlaunch.launcher.worker_env``). That folder holds only a ``sitecustomize.py``, which Python's
``site`` imports at every interpreter start (also after the ``os.execv`` of a shim into another
interpreter, since the environment travels). It loads :mod:`mlaunch.lens_hook.capture` by path,
starts that module's watcher thread in a process that is a rank of an mlaunch run, and then runs
the ``sitecustomize`` that it shadows, if there is one further along ``sys.path``.

The watcher reads the run directory's ``capture-request.json`` at most once a second and applies
a live capture through nemo-lens's public setter ``nemo.lens.state.set_enabled_span_groups``,
which every nemo-lens call site reads (docs/capture.md, "nemo-lens workers").

This package imports nothing beyond the standard library (the launcher imports it for
:data:`SITE_DIR`; the worker loads ``capture.py`` without it).
"""

from __future__ import annotations

from pathlib import Path

#: The folder put first on a nemo-lens worker's ``PYTHONPATH``: only ``sitecustomize.py`` is in it,
#: so it shadows no other module.
SITE_DIR = Path(__file__).resolve().parent / "inject"
#: How far ahead of its writing a request's ``start_ns`` should be, seconds: each rank looks at the
#: request file once a second, so with this lead every rank has read it before the start and all
#: switch at the same instant (a rank that reads it late switches at once and still ends on time).
START_LEAD_S = 2.0
