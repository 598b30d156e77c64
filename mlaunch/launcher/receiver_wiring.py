"""When ``mlaunch train`` hosts the receiver, and what it changes in the workers' environment.

Launcher policy (it reads the settings and the launch plan), so it lives in the launcher: the
receiver itself knows nothing of launches and never imports the launcher.

- **embedded** (the default for ``--script``/``--module`` with telemetry on and no OTLP endpoint):
  workers export OTLP to the launcher, which writes ``telemetry/traces-rank{R}.jsonl`` etc.
- **relay** (an endpoint configured and ``--otlp-relay`` on; on by default for scripts and
  modules, off for mlaunch's own trainer, which spools by itself): workers export to the
  launcher, which forwards to the configured endpoint and spools what it cannot deliver.

mlaunch's own trainer keeps its file exporter (it writes the same files itself, without a hop).

The receiver admits only this launch's workers: they get its token in the standard headers
variable (``OTEL_EXPORTER_OTLP_HEADERS``, which the SDK exporters, mlaunch's telemetry and
nemo-lens all read) and nowhere else: not on a command line, not in ``resolved.env`` (written
before the receiver starts, from the plan), not in any log.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal
from urllib.parse import quote

from mlaunch import envcontract as ec

if TYPE_CHECKING:
    from mlaunch.launcher.plan import LaunchPlan
    from mlaunch.receiver.core import Receiver
    from mlaunch.settings import Settings

Mode = Literal["embedded", "relay"]

#: The OTLP exporter variables that say where and how to connect (base and per signal). In
#: receiver modes they are replaced: workers talk plaintext to 127.0.0.1, and in relay mode the
#: headers (secrets) and TLS files stay with the launcher, which uses them upstream; the workers'
#: only header is the receiver's token.
_CONNECTION_VARS = ("ENDPOINT", "PROTOCOL", "HEADERS", "CERTIFICATE", "CLIENT_KEY",
                    "CLIENT_CERTIFICATE", "INSECURE")  # fmt: skip
EXPORTER_KEY = ec.PRIMARY_PREFIX + "EXPORTER"


def relay_enabled(settings: Settings) -> bool:
    """``launch.otlp_relay`` as set, else on for a script/module and off for mlaunch's trainer."""
    chosen = getattr(settings.launch, "otlp_relay", None)
    return (not settings.uses_builtin_trainer) if chosen is None else bool(chosen)


def receiver_mode(settings: Settings) -> Mode | None:
    """Whether (and how) this launch hosts the OTLP receiver; None = workers export directly."""
    t = settings.telemetry
    if not t.enabled or t.otel.sdk_disabled:
        return None
    if t.exporter == "otlp" and t.otel.endpoint_configured:
        return "relay" if relay_enabled(settings) else None
    if settings.uses_builtin_trainer:
        return None  # its file exporter writes the same files without a hop
    # A script/module: the launch plan's translation decides (nemo-lens has no file exporter:
    # the receiver is how a script's spans get into the run directory).
    from mlaunch.launcher.lens_names import embedded_receiver

    return "embedded" if embedded_receiver(settings) else None


def _protocol(env: Mapping[str, str]) -> str:
    for key in (ec.OTLP_TRACES_PROTOCOL, ec.OTLP_PROTOCOL):
        value = env.get(key, "").strip().lower()
        if value:
            return value
    return "grpc"  # nemo-lens's default (and the SDK's gRPC exporter's)


def worker_env(receiver: Receiver, env: Mapping[str, str]) -> dict[str, str] | None:
    """The workers' environment pointed at ``receiver``: the protocol they were configured with
    (gRPC unless HTTP was asked for) on the matching listener, or the other one if that one is
    down; None when no listener is up (then the plan's environment is used unchanged)."""
    protocol = _protocol(env)
    want_http = protocol.startswith("http")
    endpoint = receiver.http_endpoint if want_http else receiver.grpc_endpoint
    if endpoint is None:  # fall back to the other listener, in its protocol
        want_http = not want_http
        endpoint = receiver.http_endpoint if want_http else receiver.grpc_endpoint
        protocol = "http/protobuf" if want_http else "grpc"
    if endpoint is None:
        return None
    out = {
        k: v
        for k, v in env.items()
        if not any(k == ec.otlp_var(n, s) for s in ec.OTLP_SIGNAL_WORDS for n in _CONNECTION_VARS)
    }
    out[ec.OTLP_ENDPOINT] = endpoint
    out[ec.OTLP_PROTOCOL] = protocol
    out[ec.OTLP_INSECURE] = "true"
    out.update(token_env(receiver))
    return out


def token_env(receiver: Receiver) -> dict[str, str]:
    """The variable that hands a worker the receiver's token: the base headers variable only
    (:func:`worker_env` removes every per-signal one, so nothing overrides it), URL-encoded as
    the OTLP exporters parse it."""
    text = ",".join(f"{k}={quote(v, safe='')}" for k, v in receiver.client_headers.items())
    return {ec.OTLP_HEADERS_VARS[0]: text}


def start(plan: LaunchPlan) -> tuple[Receiver | None, dict[str, str]]:
    """Start the receiver this plan calls for: (receiver or None, the torchrun environment).
    Never raises: a receiver that cannot start is logged once and the plan's environment used."""
    mode = receiver_mode(plan.settings)
    if mode is None:
        return None, plan.child_env
    from mlaunch.receiver.core import Receiver
    from mlaunch.receiver.signals import SIGNALS
    from mlaunch.receiver.store_append import MIN_APPEND_BYTES
    from mlaunch.receiver.upstream import Upstream

    receiver = None
    try:
        relay = (
            {name: Upstream.from_env(plan.child_env, name) for name in SIGNALS}
            if mode == "relay"
            else None
        )
        node_rank = plan.settings.launch.node_rank
        # One node writes the store (its lock is a local one: shared file systems do not all
        # honour it); the other nodes' files are in it from the run-end build or the first read.
        receiver = Receiver(
            plan.run_dir, relay=relay, node_rank=node_rank,
            store_min_bytes=MIN_APPEND_BYTES if mode == "embedded" and node_rank == 0 else None,
        ).start()  # fmt: skip
        env = worker_env(receiver, plan.child_env)
        if env is None:
            receiver.problem("down", "no listener could start; workers export as configured")
            receiver.close(0.5)
            return None, plan.child_env
        return receiver, env
    except Exception as exc:  # the receiver is a convenience: never fail the run for it
        import sys

        print(f"mlaunch: OTLP receiver not started ({exc}); workers export as configured",
              file=sys.stderr)  # fmt: skip
        if receiver is not None:
            receiver.close(0.5)
        return None, plan.child_env
