"""SLURM: the batch script ``mlaunch sbatch`` writes, the SLURM commands, and a job's status.

- :mod:`.batch`: a validated launch plan turned into ``job.sbatch`` (from ``job.sbatch.template``).
- :mod:`.client`: ``sbatch``, ``scontrol``, ``scancel``, ``sacct`` (the only callers of them).
- :mod:`.status`: ``mlaunch status`` (SLURM's answer and the run directory's), :mod:`.watch` its
  live view.

Above the launcher: the batch script is made from the launch plan, so this package imports
:mod:`mlaunch.launcher` and never the other way. What ``mlaunch train`` reads of SLURM inside a
job (its allocation variables) is the launcher's own (:mod:`mlaunch.launcher.cluster_env`).
Nothing is imported here: ``mlaunch status`` must not pay for the settings layer that
:mod:`.batch` loads.
"""
