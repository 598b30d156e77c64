"""Run identity with no communication, as Megatron-LM computes it (so a dashboard keyed on these
attributes finds mlaunch's runs, Megatron-LM's workers and the launcher's job trace alike).

``nemo.lens.job_uuid`` names the logical job and stays the same over every restart and requeue;
``nemo.lens.run_uuid`` names one incarnation. Every process (launcher, every rank) derives both
from the environment it inherited, so they agree without a collective.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

#: Resource attribute keys of the run identity.
JOB_UUID = "nemo.lens.job_uuid"
RUN_UUID = "nemo.lens.run_uuid"

#: Environment variable -> resource attribute, set when the variable is non-empty: the one table
#: of SLURM (and NVRx, torchelastic) resource attributes, which every producer (each rank's
#: telemetry, the launcher's job trace) exports through :func:`run_identity`. The first eleven are
#: Megatron-LM's names (``build_telemetry_resource_attrs``; ``LENS_SLURM_SLUID`` and
#: ``LENS_SLURM_ARRAY_SLUID`` are exported by its launch script from sacct); the last five are
#: mlaunch's own, under names Megatron-LM does not use.
SLURM_RESOURCE_ATTRS: dict[str, str] = {
    "SLURM_JOB_ID": "slurm.job.id",
    "LENS_SLURM_SLUID": "slurm.sluid",
    "SLURM_CLUSTER_NAME": "slurm.cluster",
    "SLURM_ARRAY_JOB_ID": "slurm.array.job_id",
    "SLURM_ARRAY_TASK_ID": "slurm.array.task_id",
    "LENS_SLURM_ARRAY_SLUID": "slurm.array.sluid",
    "SLURM_RESTART_COUNT": "slurm.restart_count",
    "NVRX_CYCLE": "nvrx.cycle",
    "NVRX_INFRA_RANK": "nvrx.infra_rank",
    "NVRX_MEMBERSHIP": "nvrx.membership",
    "TORCHELASTIC_RESTART_COUNT": "slurm.torchelastic.restart_count",
    "SLURM_JOB_NAME": "slurm.job.name",
    "SLURM_JOB_NODELIST": "slurm.nodelist",
    "SLURM_NNODES": "slurm.nnodes",
    "SLURM_NTASKS": "slurm.ntasks",
    "SLURM_JOB_PARTITION": "slurm.partition",
}


def run_identity(environ: Mapping[str, str]) -> dict[str, str]:
    """The identity resource attributes for a process started with ``environ``: every
    :data:`SLURM_RESOURCE_ATTRS` entry whose variable is set, and the two uuids.

    ``job_uuid = uuid5(URL, "nemo.lens.job/<cluster>/<job>")``; ``run_uuid = uuid5(URL,
    "nemo.lens.run/" + "/".join(parts))`` with parts = cluster, job, ``sr<SLURM_RESTART_COUNT>``
    (not for job arrays, whose elements requeue one by one) and ``te<TORCHELASTIC_RESTART_COUNT>``
    when that variable is set. Exactly Megatron-LM's rule (``build_telemetry_resource_attrs``).
    """
    attrs = {attr: environ[var] for var, attr in SLURM_RESOURCE_ATTRS.items() if environ.get(var)}
    cluster = environ.get("SLURM_CLUSTER_NAME", "nocluster")
    is_array = "SLURM_ARRAY_TASK_ID" in environ
    job = (
        environ.get("SLURM_ARRAY_JOB_ID") if is_array else environ.get("SLURM_JOB_ID")
    ) or "nojob"
    parts = [cluster, job]
    if not is_array:
        parts.append("sr" + environ.get("SLURM_RESTART_COUNT", "0"))
    te = environ.get("TORCHELASTIC_RESTART_COUNT")
    if te is not None:
        parts.append("te" + te)
    attrs[JOB_UUID] = str(uuid.uuid5(uuid.NAMESPACE_URL, f"nemo.lens.job/{cluster}/{job}"))
    attrs[RUN_UUID] = str(uuid.uuid5(uuid.NAMESPACE_URL, "nemo.lens.run/" + "/".join(parts)))
    return attrs
