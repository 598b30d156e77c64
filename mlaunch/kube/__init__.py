"""Kubernetes, the second engine past one machine: ``mlaunch trainjob`` writes a Kubeflow Trainer
v2 ``TrainJob`` (:mod:`mlaunch.kube.manifest`, pure), creates it through the API
(:mod:`mlaunch.kube.client`, the optional ``kubernetes`` package) and reads it back for
``status``, ``logs`` and ``stop`` (:mod:`mlaunch.kube.jobs`). Each pod runs plain ``mlaunch
train``, which takes its node count, rank and rendezvous from the runtime's ``PET_*`` variables.

This layer sits beside :mod:`mlaunch.slurm` and above it: it reuses the batch script's frozen
settings and the status words; ``slurm`` never imports ``kube``.
"""
