"""The names of a Kubeflow Trainer v2 TrainJob that every ``mlaunch.kube`` module shares, and
the rules for them (standard library only: ``status trainjob/NAME`` loads no settings layer).
The values are Trainer v2.3.0's (``pkg/constants``, the CRD, the shipped ``torch-distributed``
runtime)."""

from __future__ import annotations

import hashlib
import re

API_VERSION = "trainer.kubeflow.org/v1alpha1"
KIND = "TrainJob"
PLURAL = "trainjobs"
GROUP, VERSION = API_VERSION.split("/")
#: The ClusterTrainingRuntime Trainer v2 ships for PyTorch (torchrun's ``PET_*`` per pod).
DEFAULT_RUNTIME = "torch-distributed"
#: The runtime's replicated job and its container that run the trainer (``constants.Node``).
NODE = "node"
#: Where the torch runtime puts node 0's rendezvous (``constants.ContainerTrainerPort``).
RDZV_PORT = 29500
#: Kueue's queue label on a TrainJob.
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
#: Our labels and annotations (the run id may be 128 characters: an annotation, not a label).
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
RUN_ID_ANNOTATION = "mlaunch/run-id"
#: Set by ``mlaunch stop trainjob/NAME`` with the suspension: ``status`` then says stopped.
STOPPED_ANNOTATION = "mlaunch/stopped"
#: ``runtimePatches[].manager`` of our patch.
PATCH_MANAGER = "mlaunch"
#: The volume's name inside the pod spec.
VOLUME_NAME = "mlaunch-runs"
#: The torch runtime's environment, never ours to set (the webhook refuses them).
RUNTIME_ENV_PREFIX = "PET_"
#: A TrainJob's name (the CRD's CEL rule) and a namespace (a DNS label).
RFC1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
MAX_NAME = 63
#: ``spec.trainer.image``'s MaxLength in the CRD.
MAX_IMAGE = 500


def trainjob_name(run_id: str) -> str:
    """The TrainJob's name for ``run_id``: an RFC 1035 label, the same every time."""
    slug = re.sub(r"-{2,}", "-", re.sub(r"[^a-z0-9-]", "-", run_id.lower())).strip("-")
    name = f"mlaunch-{slug}"
    if slug == run_id and len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:8]
    keep = MAX_NAME - len("mlaunch-") - len(digest) - 1
    return f"mlaunch-{slug[:keep].rstrip('-')}-{digest}"


def dns_label(text: str) -> bool:
    """Whether ``text`` is a DNS label (a namespace's name)."""
    return len(text) <= MAX_NAME and _DNS_LABEL.fullmatch(text) is not None
