"""mlaunch's instrumented GPT trainer: ``python -m mlaunch.trainer [ARGS]`` under torchrun."""
