"""``mlaunch train`` behind the CLI: the launch plan (pure, :mod:`mlaunch.launcher.plan`) and the
side effects of running it (:mod:`mlaunch.launcher.run`).

Nothing here imports torch: workers are started as ``python -m torch.distributed.run``.
"""
