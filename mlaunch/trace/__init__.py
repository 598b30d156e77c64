"""Reading exported traces without a backend: ``mlaunch trace summary|goodput|stragglers|
export|report|sql`` (:mod:`mlaunch.cli.trace`) and ``replay`` of undelivered spans.

One engine: every input (a run directory, a directory of trace files, one OTLP-JSON file) is
read through its span store, Parquet queried with DuckDB (:mod:`.store`; opened by
:func:`.store.open_reader`, built beside the input or in the cache directory on the first read).
In the order the data flows:

* :mod:`.reader` finds a run's trace files and decodes OTLP-JSON lines (the rank of each
  resource, torn and malformed lines); :mod:`.store_decode` decodes them column-wise;
  :mod:`.store_build` writes the store, :mod:`.store_layout` names its files and schema, and
  :mod:`.store` opens, locks and refreshes it, runs ``trace sql`` and exports OTLP-JSON;
* the analyses on the store, one module each (result types, rules and the store queries):
  :mod:`.summary`, :mod:`.goodput`, :mod:`.stragglers` (whose aggregator also serves the live
  tail of ``status --watch``; :mod:`.store_steps` sorts its steps a rank at a time),
  :mod:`.chrome` (``export --format chrome``) and :mod:`.report` (the HTML report);
  :mod:`.stats`, :mod:`.durations` and :mod:`.links` are their shared helpers, :mod:`.metrics`
  reads the workers' metric files;
* :mod:`.replay` sends a run's spool files to a collector.

Nothing here imports torch or the OpenTelemetry SDK.
"""
