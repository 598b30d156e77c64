"""``python -m mlaunch``."""

from mlaunch.cli import main

main()
