"""OTLP itself, apart from who produces or reads it: the OTLP/JSON mapping (:mod:`.otlp_json`),
the span encoders shared by the runtime and the receiver (:mod:`.encode`, :mod:`.from_proto`),
the one sender (:mod:`.send`) and the W3C ``traceparent`` (:mod:`.traceparent`).

A low layer: it imports nothing of mlaunch but :mod:`mlaunch.envcontract` and :mod:`mlaunch.model`,
so reading a trace never loads the telemetry runtime. Nothing is imported here: each user pays
only for the submodule it needs (protobuf and gRPC load only with the modules that use them).
"""
