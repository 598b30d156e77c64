"""The allocation SLURM gives ``mlaunch train`` inside a job, read from its variables.

Pure (no SLURM command runs) and below the launch plan, which reads it: the SLURM commands and
the batch script live in :mod:`mlaunch.slurm`, above the launcher.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

#: Rendezvous port used under SLURM when MASTER_PORT is not set (torchrun's own default).
SLURM_DEFAULT_PORT = 29500


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list such as ``node[01-04,07],gpu7`` (no ``scontrol`` needed).

    Ranges keep their zero padding; several bracket groups in one name expand as a product.
    """
    items: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    items.append(nodelist[start:])
    hosts: list[str] = []
    for item in (s.strip() for s in items):
        if item:
            hosts += _expand_one(item)
    return hosts


def _expand_one(name: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if not match:
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    values: list[str] = []
    for part in match.group(1).split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if sep and lo.isdigit() and hi.isdigit():
            width = len(lo)
            values += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
        elif part:
            values.append(part)
    return [head + v + rest for v in values for rest in _expand_one(tail)]


def slurm_launch_values(environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """Launch settings SLURM determines: ``{path: (value, variable)}`` (empty outside SLURM)."""
    job = environ.get("SLURM_JOB_ID", "").strip()
    if not job:
        return {}
    out: dict[str, tuple[Any, str]] = {"launch.rdzv_id": (job, "SLURM_JOB_ID")}
    for var in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        if environ.get(var, "").strip():
            out["launch.nnodes"] = (environ[var].strip(), var)
            break
    if environ.get("SLURM_NODEID", "").strip():
        out["launch.node_rank"] = (environ["SLURM_NODEID"].strip(), "SLURM_NODEID")
    for var in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        hosts = expand_nodelist(environ.get(var, ""))
        if hosts:
            port = environ.get("MASTER_PORT", "").strip() or str(SLURM_DEFAULT_PORT)
            out["launch.rdzv_endpoint"] = (f"{hosts[0]}:{port}", var)
            break
    return out
