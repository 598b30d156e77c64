"""The ``slurm_cluster`` fixture: one real 2-node SLURM cluster for the whole session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A running 2-node cluster (``n1``, ``n2`` on this machine); stopped after the session.
    Installs ``slurm-wlm`` and ``munge`` first when they are missing (needs root and apt)."""
    from support.slurm_cluster import SlurmUnavailable, start_cluster

    try:
        cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    except SlurmUnavailable as exc:
        pytest.skip(f"no SLURM test cluster here: {exc}")
    yield cluster
    cluster.stop()
