"""The import rules that keep the CLI fast (checked in fresh interpreters)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "opentelemetry.sdk", "grpc", "numpy")

PROBE = """
import io, json, sys, contextlib
sys.argv = ["mlaunch", *{args!r}]
from mlaunch.cli import main
out = io.StringIO()
code = 0
with contextlib.redirect_stdout(out):
    try:
        main()
    except SystemExit as exc:
        code = exc.code or 0
print(json.dumps({{"code": code, "modules": sorted(sys.modules)}}))
"""


def _loaded(args: list[str]) -> tuple[int, set[str]]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_"))
    }
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(args=args)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return data["code"], set(data["modules"])


@pytest.mark.parametrize(
    "args", [["groups", "resolve", "all"], ["groups", "resolve"], ["groups", "list"]]
)
def test_groups_commands_import_no_heavy_module(args: list[str]) -> None:
    code, modules = _loaded(args)
    assert code == 0
    heavy = {m for m in modules if m.split(".")[0] in {h.split(".")[0] for h in HEAVY}}
    heavy = {m for m in heavy if any(m == h or m.startswith(h + ".") for h in HEAVY)}
    assert not heavy, sorted(heavy)[:10]


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("mlaunch.model", ("pydantic", "typer", "rich", "opentelemetry", "torch")),
        ("mlaunch.settings", ("torch", "opentelemetry", "grpc")),
        ("mlaunch.telemetry", ("torch",)),
        # Every launch imports these; the receiver's protobuf/grpc load only when one is hosted.
        ("mlaunch.launcher.run", ("torch", "opentelemetry", "grpc", "google")),
        ("mlaunch.receiver.wiring", ("torch", "opentelemetry", "grpc", "google")),
    ],
)
def test_layer_imports(module: str, forbidden: tuple[str, ...]) -> None:
    code = f"import sys, json, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    bad = [m for m in loaded if m.split(".")[0] in forbidden or m in forbidden]
    assert not bad, bad[:10]
