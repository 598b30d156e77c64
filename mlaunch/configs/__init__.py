"""Ready-made ``mlaunch train`` configs (``--config NAME``), shipped as package data."""
