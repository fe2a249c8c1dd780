"""Builds tierspec's pass engine (tierspec/csrc/*.c) as the extension ``tierspec._qengine``.

Everything else about the package is declared in pyproject.toml. The C files need only the Python
headers and a C11 compiler (gcc or clang). Each x86 kernel file compiles its functions for its own
instruction set with function attributes (AVX2, AVX-512, AVX512-VNNI, AVX512-BF16, AMX), and the
engine picks among them at run time from the CPU's features, so one build serves every x86-64 CPU
(others run the portable loops). ``-ffp-contract=off``: the compiler must not fuse a*b+c where the
code does not ask for it, or the portable loops would stop matching the vector ones bit for bit.
"""

from pathlib import Path

from setuptools import Extension, setup

SOURCES = sorted(str(path) for path in Path("tierspec/csrc").glob("*.c"))

setup(
    ext_modules=[
        Extension(
            "tierspec._qengine",
            sources=SOURCES,
            depends=sorted(str(path) for path in Path("tierspec/csrc").glob("*.h")),
            extra_compile_args=["-O3", "-std=c11", "-ffp-contract=off", "-pthread", "-Wall", "-Wextra",
                                "-Wno-unused-parameter", "-Wno-missing-field-initializers"],
            extra_link_args=["-pthread"],
        ),
        # The keyed noise of sampled decoding (tierspec/sampling.py): a module of its own, below the
        # models in the package's layers; the same flags (its AVX2 loop must give the plain loop's bits).
        Extension(
            "tierspec._keyed_noise",
            sources=["tierspec/csrc/noise/keyed_noise.c"],
            # its rows' first maxima and the noise's arithmetic and scans, shared with the engine
            depends=["tierspec/csrc/row_top.h", "tierspec/csrc/keyed_scan.h"],
            extra_compile_args=["-O3", "-std=c11", "-ffp-contract=off", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        ),
    ]
)
