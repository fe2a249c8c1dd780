#!/usr/bin/env bash
# The engine's AVX-512, AVX512-VNNI, AVX512-BF16 and (emulated-tile) AMX kernels run on any x86-64 CPU
# through SIMDe's emulation of the intrinsics (pip install simde-py): a copy of this checkout in a
# temporary folder, its kernel files built without their target attributes against
# tests/simde/immintrin.h, the CPU probe told it has AVX512-BF16, then pytest on it with the given
# arguments. Slow (every vector instruction a C loop); a check of the kernels' logic where no such
# CPU is at hand, not of their speed or of the real instructions' encodings.
#
#   bash tests/simde/run.sh tests/models/test_quant.py tests/models/test_engine_kernels.py -x
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
simde="$(python -c 'import simde_py; print(simde_py.get_include())')"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
git -C "$root" ls-files -z --cached --others --exclude-standard -- tierspec tests setup.py pyproject.toml \
    | (cd "$root" && xargs -0 cp --parents -t "$work")
cd "$work"
# row_top.h and keyed_scan.h keep their attributes: the keyed-noise extension, built with the real intrinsics below,
# includes them too
sed -i -E 's/__attribute__\(\(target\("[^"]*"\)\)\)//g' tierspec/csrc/*.c $(ls tierspec/csrc/*.h | grep -v -e row_top.h -e keyed_scan.h)
python - <<'PY'
from pathlib import Path
cpu = Path("tierspec/csrc/cpu.c")
text = cpu.read_text()
line = "    cpu.level = cpu.best < cpu.cap ? cpu.best : cpu.cap;"
assert line in text
cpu.write_text(text.replace(line, "    cpu.best = ISA_AVX512BF16; /* SIMDe: every path emulated */\n" + line))
PY
cat > build_simde.py <<PY
from pathlib import Path
from setuptools import Extension, setup
setup(ext_modules=[Extension("tierspec._qengine", sources=sorted(str(p) for p in Path("tierspec/csrc").glob("*.c")),
      include_dirs=["tests/simde", "$simde"], extra_compile_args=["-O1", "-std=gnu11", "-ffp-contract=off", "-pthread", "-w"],
      extra_link_args=["-pthread"]),
      # the keyed noise of sampled decoding, built as setup.py builds it (the package imports it; no SIMDe)
      Extension("tierspec._keyed_noise", sources=["tierspec/csrc/noise/keyed_noise.c"],
                extra_compile_args=["-O3", "-std=c11", "-ffp-contract=off", "-w"])])
PY
python build_simde.py build_ext --inplace -q
PYTHONPATH="$work" python -c "from tierspec import engine; print(engine.kernel_report())"
PYTHONPATH="$work" python -m pytest -p no:cacheprovider "$@"
