"""The optional C extension (the rest of the build is in pyproject.toml).

``mlaunch.telemetry._cspan`` is the flight recorder's recorded span in C (the pure-Python span
costs about 670 ns, over the recorder's 500 ns goal; ``benchmarks/recorded_span_ab.py``), built
``optional=True``: where there is no compiler or no Python headers the install goes on without
it, and ``mlaunch.telemetry._recorder`` uses its pure-Python classes (the same results, slower).
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
    ]
)
