"""Build configuration beyond pyproject.toml: the optional C marker decoder.

``optional=True``: where no C compiler is available the build goes on without it and
``tracker.protocol`` uses its pure-Python decoder (same results, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tracker._speedups",
            sources=["tracker/_speedups.c"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
