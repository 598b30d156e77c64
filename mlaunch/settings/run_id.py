"""The run id, chosen in one place: the launcher's plan, the trainer and the telemetry runtime all
ask :func:`choose_run_id`, each naming only what it alone knows (a rendezvous id, whether it may
make a fresh id). Standard library only: no pydantic, no torch.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable, Mapping
from typing import Literal, overload

#: What a run id may be: it names the run directory, so a leading ``-`` would read as an option
#: and a leading ``.`` would hide it.
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: The value torchrun gives ``TORCHELASTIC_RUN_ID`` when no ``--rdzv-id`` was given: not an id.
_UNSET = "none"


def is_run_id(text: str | None) -> bool:
    """Whether ``text`` is a valid run id."""
    return text is not None and RUN_ID_PATTERN.fullmatch(text) is not None


def new_run_id() -> str:
    """A fresh 12-hex-digit run id, with at least one letter: a run id of digits only is what a
    SLURM job's run takes (its job id), and ``mlaunch status`` reads one as that job's, so a
    local run must never draw one (12 random hex digits are all decimal about once in 280)."""
    while True:
        run_id = secrets.token_hex(6)
        if not run_id.isdigit():
            return run_id


def torchrun_shared_ids(environ: Mapping[str, str]) -> tuple[str, ...]:
    """Ids every worker of one torchrun job can derive alone, best first: torchrun's rendezvous
    run id, else a hash of the rendezvous master's address (the same on every rank)."""
    ids = [environ.get("TORCHELASTIC_RUN_ID", "")]
    addr, port = environ.get("MASTER_ADDR", ""), environ.get("MASTER_PORT", "")
    if addr and port:
        ids.append(hashlib.sha256(f"{addr}:{port}".encode()).hexdigest()[:12])
    return tuple(ids)


@overload
def choose_run_id(
    setting: str | None,
    environ: Mapping[str, str],
    *,
    shared: Iterable[str | None] = ...,
    fresh: Literal[True] = ...,
) -> str: ...
@overload
def choose_run_id(
    setting: str | None,
    environ: Mapping[str, str],
    *,
    shared: Iterable[str | None] = ...,
    fresh: bool,
) -> str | None: ...
def choose_run_id(
    setting: str | None,
    environ: Mapping[str, str],
    *,
    shared: Iterable[str | None] = (),
    fresh: bool = True,
) -> str | None:
    """The run id, in this order: the RUN_ID setting, else ``SLURM_JOB_ID``, else the first of
    ``shared`` (ids the caller knows every process of the run shares), else a fresh id when
    ``fresh``, else None (the caller must make one all processes agree on, or refuse).

    A blank candidate, or a shared id that is torchrun's ``none`` placeholder, is skipped.
    """
    if setting:
        return setting
    slurm = environ.get("SLURM_JOB_ID", "").strip()
    if slurm:
        return slurm
    for candidate in shared:
        value = (candidate or "").strip()
        if value and value.lower() != _UNSET:
            return value
    return new_run_id() if fresh else None
