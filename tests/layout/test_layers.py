"""The package reads top-down: every module imports only modules of its own layer or of the layers
below it (README, Layout; STYLE.md, "A layout that shows the architecture"). Every import
statement counts, module-level or inside a function: a lazy import up is still an import up. And
each floor is a real layer: every module of it, but a package's ``__init__`` that gathers its own
modules, imports some module of a floor below it (a module that needs nothing of its floor sits
where what it imports puts it)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "tierspec"

#: Top first. A module belongs to the layer of the longest name that prefixes it, so
#: ``tierspec.layerskip.search`` (the mask search, a job over the runtime) sits above
#: ``tierspec.layerskip.clasp`` (CLaSP's in-context selection, a drafter's runtime), which sits above
#: ``tierspec.layerskip.masks`` (a mask applied in a pass), and ``tierspec.layerskip.candidates`` (mask
#: proposals, no model code) and ``tierspec.bench.memory`` (a process's peak memory) are pure pieces.
#: Each floor is a real layer: every module of it imports some module of a floor below it (a
#: package's ``__init__`` gathering its own modules excepted) and none of any floor above
#: (``test_every_module_stands_on_a_floor_below``).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("faces", ("tierspec", "tierspec.cli", "tierspec.api", "tierspec.server")),
    ("jobs", ("tierspec.bench", "tierspec.training", "tierspec.cluster", "tierspec.layerskip.search")),
    ("evaluation data", ("tierspec.data",)),
    ("methods", ("tierspec.methods",)),
    ("the loop", ("tierspec.decode", "tierspec.batch", "tierspec.verifiers")),
    ("rules", ("tierspec.rules",)),
    ("drafters and policies", ("tierspec.drafters", "tierspec.policies")),
    ("records", ("tierspec.proposal", "tierspec.walks", "tierspec.constraints")),
    ("heads and in-context layer selection", ("tierspec.heads", "tierspec.layerskip")),
    ("pass-cost tables", ("tierspec.costs",)),
    ("the pass backend", ("tierspec.passes",)),
    ("encoder-decoder models", ("tierspec.seq2seq",)),
    ("cached models", ("tierspec.cached_model",)),
    ("loading models", ("tierspec.models", "tierspec.prompting", "tierspec.gguf_cache",
                        "tierspec.model_files")),
    ("linear kernels for a de-quantised copy", ("tierspec.kernels",)),
    ("models on the engine", ("tierspec.gguf_llama", "tierspec.gguf_model", "tierspec.quant")),
    ("routing masks", ("tierspec.layerskip.masks",)),
    ("forward passes", ("tierspec.llama", "tierspec.architectures")),
    ("the engine's binding", ("tierspec.engine", "tierspec._qengine")),
    ("pure pieces", ("tierspec.sampling", "tierspec._keyed_noise", "tierspec.tree", "tierspec.modifiers", "tierspec.errors", "tierspec.util",
                     "tierspec.identity", "tierspec.grammar", "tierspec.structured",
                     "tierspec.gguf_check", "tierspec.limits", "tierspec.tokenizer",
                     "tierspec.layerskip.candidates", "tierspec.bench.memory")),
)


def layer_of(module: str) -> int:
    """The index (0 = top) of the layer ``module`` belongs to."""
    best, index = "", None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, index = prefix, i
    if index is None:
        raise KeyError(f"{module} is in no layer: add it to LAYERS (tests/layout/test_layers.py) and README's Layout")
    return index


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def extensions() -> frozenset[str]:
    """The compiled extensions ``setup.py`` declares (``Extension("tierspec._qengine", ...)``): modules
    whether or not this checkout has built them."""
    tree = ast.parse((PACKAGE.parent / "setup.py").read_text())
    return frozenset(node.args[0].value for node in ast.walk(tree)
                     if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Extension"
                     and node.args and isinstance(node.args[0], ast.Constant))


def is_module(name: str) -> bool:
    """Whether ``name`` is a module or package of tierspec (a compiled extension included, built or not)."""
    path = PACKAGE.parent / Path(*name.split("."))
    return path.is_dir() or any(path.parent.glob(path.name + ".*py")) or name in extensions()


def imports(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module) of every tierspec module ``source`` imports; ``from .x import y``
    counts as ``x.y`` when y is a module, else ``x`` (both are tried against the layers)."""
    found = []
    base = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "tierspec"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base[: len(base) - node.level + 1]
                name = ".".join(parts + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.split(".")[0] != "tierspec":
                continue
            for alias in node.names:
                candidate = f"{name}.{alias.name}"
                found.append((node.lineno, candidate if is_module(candidate) else name))
    return found


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Each import of ``source`` (the text of ``module``) that reaches up to a higher layer."""
    own = layer_of(module)
    return [f"{module}:{line} imports {target} ({LAYERS[layer_of(target)][0]}, above {LAYERS[own][0]})"
            for line, target in imports(source, module, is_package) if layer_of(target) < own]


def stands_on_a_floor_below(source: str, module: str, is_package: bool = False) -> bool:
    """Whether ``module`` imports some module of a floor below its own — or, a package's
    ``__init__``, gathers only its own package's modules (the bottom floor stands on nothing)."""
    own = layer_of(module)
    targets = [target for _, target in imports(source, module, is_package)]
    if own == len(LAYERS) - 1 or any(layer_of(target) > own for target in targets):
        return True
    return is_package and bool(targets) and all(target.startswith(module + ".") for target in targets)


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_has_a_layer():
    assert len(modules()) > 60
    for path in modules():
        layer_of(module_name(path))


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_module_imports_from_a_layer_above_its_own(path):
    assert violations(path.read_text(), module_name(path), path.name == "__init__.py") == []


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_every_module_stands_on_a_floor_below(path):
    module = module_name(path)
    assert stands_on_a_floor_below(path.read_text(), module, path.name == "__init__.py"), \
        f"{module} imports nothing of a floor below {LAYERS[layer_of(module)][0]}: move it down to where its imports put it"


def test_the_check_finds_a_module_that_needs_nothing_of_its_floor():
    # a module of the loop importing only the loop, or nothing of tierspec, stands on no floor below
    assert not stands_on_a_floor_below("from .decode import Sequence\n", "tierspec.batch")
    assert not stands_on_a_floor_below("import math\n", "tierspec.verifiers")
    assert stands_on_a_floor_below("from .walks import walk_chain\n", "tierspec.decode")
    assert stands_on_a_floor_below("import math\n", "tierspec.util")  # the bottom floor stands on nothing
    # a package's __init__ gathering its own modules is its floor's; gathering another package's is not
    assert stands_on_a_floor_below("from .base import Drafter\n", "tierspec.drafters", is_package=True)
    assert not stands_on_a_floor_below("from ..policies import CostAware\n", "tierspec.drafters", is_package=True)
    assert not stands_on_a_floor_below("", "tierspec.drafters", is_package=True)


def test_the_compiled_engine_is_a_module_built_or_not():
    # ``from . import _qengine`` names the extension setup.py declares, not the package: no false import up
    assert "tierspec._qengine" in extensions()
    assert violations("from . import _qengine\n", "tierspec.engine") == []
    assert imports("from . import _qengine\n", "tierspec.engine", False) == [(1, "tierspec._qengine")]


def test_the_check_catches_a_planted_import_up():
    # a rule reaching up to the loop, a lazy import inside a function, and a relative import from a package
    assert violations("from ..decode import Verifiers\n", "tierspec.rules.exact") == [
        "tierspec.rules.exact:1 imports tierspec.decode (the loop, above rules)"]
    assert violations("def f():\n    from ..api import generate\n", "tierspec.training.calibration") == [
        "tierspec.training.calibration:2 imports tierspec.api (faces, above jobs)"]
    assert violations("from . import decode\n", "tierspec.cached_model") == [
        "tierspec.cached_model:1 imports tierspec.decode (the loop, above cached models)"]
    assert violations("from ..cached_model import CachedModel\n", "tierspec.layerskip.masks") == [
        "tierspec.layerskip.masks:1 imports tierspec.cached_model (cached models, above routing masks)"]
    assert violations("from ..costs import unit_costs\n", "tierspec.layerskip.search") == []  # a job over the runtime
    assert violations("from .search import search_mask\n", "tierspec.layerskip.clasp") == [
        "tierspec.layerskip.clasp:1 imports tierspec.layerskip.search (jobs, above heads and in-context layer selection)"]
    assert violations("from .rules import ExactRule\n", "tierspec.methods") == []  # down is fine
    assert violations("import tierspec.methods\n", "tierspec.policies") == [
        "tierspec.policies:1 imports tierspec.methods (methods, above drafters and policies)"]


def test_the_runtime_pieces_have_floors_of_their_own_in_the_order_they_import():
    """A job over the runtime sits above it (the mask search above the costs and masks it uses); the
    pass-cost tables, encoder-decoder models, cached models and routing masks are floors of their
    own, each above what it imports (a coarser floor would let an import between them pass)."""
    order = [layer_of(m) for m in ("tierspec.layerskip.search", "tierspec.costs", "tierspec.seq2seq",
                                    "tierspec.cached_model", "tierspec.layerskip.masks")]
    assert order == sorted(order) and len(set(order)) == len(order)
    assert layer_of("tierspec.layerskip.search") < layer_of("tierspec.layerskip.clasp") < layer_of("tierspec.layerskip.masks")
    assert layer_of("tierspec.decode") < layer_of("tierspec.passes") < layer_of("tierspec.cached_model")


# ---- the tests mirror the layers ----------------------------------------------------------------

TESTS = Path(__file__).resolve().parents[1]
#: Where the tests of each layer live (tests/<folder>/test_*.py; helpers and conftest stay at the top).
TEST_FOLDERS = {"faces": ("faces",), "jobs": ("jobs", "evaluation data"), "methods": ("methods",),
                "loop": ("the loop", "records"),
                "rules": ("rules",), "drafters": ("drafters and policies",),
                "heads": ("heads and in-context layer selection",),
                "layerskip": ("jobs", "heads and in-context layer selection", "routing masks"),
                "models": ("pass-cost tables", "the pass backend", "encoder-decoder models", "cached models",
                           "loading models", "linear kernels for a de-quantised copy", "models on the engine",
                           "forward passes", "the engine's binding"),
                "pure": ("pure pieces",), "layout": ()}  # layout: the package and the documents as a whole


def test_tests_are_grouped_by_layer_and_every_group_runs_something():
    """Every test module sits in a layer's folder, and each folder holds a test the default run
    (``-m 'not slow'``) collects, so running any folder (or the suite) never collects nothing."""
    layer_names = {name for name, _ in LAYERS}
    assert {layer for layers in TEST_FOLDERS.values() for layer in layers} == layer_names  # every floor is tested
    modules = sorted(TESTS.rglob("test_*.py"))
    assert modules and all(m.parent.parent == TESTS and m.parent.name in TEST_FOLDERS for m in modules), \
        [str(m.relative_to(TESTS)) for m in modules if m.parent.parent != TESTS or m.parent.name not in TEST_FOLDERS]
    assert len({m.name for m in modules}) == len(modules)  # pytest's import mode needs distinct basenames
    for folder in TEST_FOLDERS:
        runnable = 0
        for module in (TESTS / folder).glob("test_*.py"):
            tree = ast.parse(module.read_text())
            slow_module = "pytestmark" in module.read_text() and "slow" in module.read_text().split("pytestmark", 1)[1][:80]
            for node in tree.body:
                if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and not slow_module:
                    marks = [ast.unparse(d) for d in node.decorator_list]
                    runnable += not any("mark.slow" in mark for mark in marks)
        assert runnable, f"tests/{folder} has no test the default run collects"
