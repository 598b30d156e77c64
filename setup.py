"""The optional C extension (the rest of the build is in pyproject.toml).

``mlaunch.telemetry._cspan`` is the flight recorder's recorded span in C, ``mlaunch.trace._cscan``
the span store's OTLP-JSON scanner; both ``optional=True``: where there is no compiler or no Python
headers the install goes on without them, and ``mlaunch.telemetry._recorder`` uses its pure-Python
classes, ``mlaunch.trace.store_decode`` its pyarrow path (the same results, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "mlaunch.telemetry._cspan",
            sources=["mlaunch/telemetry/_cspan.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "mlaunch.trace._cscan",
            sources=["mlaunch/trace/_cscan.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
)
