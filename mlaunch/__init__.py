"""mlaunch: launch distributed PyTorch training with cheap, correct OpenTelemetry tracing."""

__version__ = "0.1.0"
