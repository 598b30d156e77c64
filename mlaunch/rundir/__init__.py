"""The run directory, owned in one place: its layout (:mod:`.layout`, every path named once), the
one atomic write and lock (:mod:`.atomic`), the typed records the launcher and the workers leave
there (:mod:`.records`), and :class:`~.state.RunState`, the one reading of them that every view
uses (``mlaunch status``, ``status --watch``, ``trace capture``, the report's marks, train's
closing box).

Standard library only, and the bottom layer beside :mod:`mlaunch.envcontract` and
:mod:`mlaunch.model`: telemetry, the trainer, trace, the receiver and the launcher all import it,
and a nemo-lens worker's hook loads it by path.
"""
