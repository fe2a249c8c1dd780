"""Builds tierspec's pass engine (tierspec/csrc/qengine.c) as the extension ``tierspec._qengine``.

Everything else about the package is declared in pyproject.toml. The C file needs only the Python
headers and a C11 compiler (gcc or clang); its x86 kernels are compiled for AVX2 and AVX512-BF16
with function attributes and chosen at run time, so one build serves every x86-64 CPU (others run
its portable loops). ``-ffp-contract=off``: the compiler must not fuse a*b+c where the code does not
ask for it, or the portable loops would stop matching the vector ones bit for bit.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tierspec._qengine",
            sources=["tierspec/csrc/qengine.c"],
            extra_compile_args=["-O3", "-std=c11", "-ffp-contract=off", "-pthread", "-Wall"],
            extra_link_args=["-pthread"],
        )
    ]
)
