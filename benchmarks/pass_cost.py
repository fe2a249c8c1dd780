"""What one cached forward pass of the default model costs, by number of new tokens, beside
llama.cpp's pass on the same GGUF file.

    python benchmarks/pass_cost.py [--configs auto:auto,float32:gguf,bfloat16:packed] [--llamacpp]
                                   [--context 256] [--rounds 7] [--out results/pass_cost.md]

Each configuration is ``dtype:kernels`` (see ``tierspec.load_model``; ``auto:auto`` is the
default load: the file's own blocks on the pass engine). For every configuration the model is
loaded once (its few-row products on the threads a generation settles for it here,
``costs.few_row_threads``), a 256-token context is cached, and passes of k = 1, 2, 4, 8, 16 new tokens are timed
(logits for every new token, as a verification pass needs them), the cache rolled back after each.
Configurations are interleaved round by round so that a busy spell of a shared machine hits all
of them alike; the table gives medians over rounds.

A "tree" row times token-tree passes (``tierspec.tree``) of 1 pending token and 7 / 15 nodes
(4 / 8 root-to-leaf paths) under the k = 8 / 16 columns.

"Outside the matrices" splits a pass into its matrix products and the rest (norms, rotary,
attention, SiLU, residuals, the KV cache and Python dispatch over 30 layers): for the pass engine,
the pass time less the time its matrix products took (measured inside the engine,
``_qengine.profile``); for torch's kernels, the same passes with every linear layer's product
replaced by an uninitialised output of the right shape.

``--llamacpp``: llama.cpp (llama-cpp-python) on the same file and thread count: the same context,
then k tokens evaluated with logits for all of them (``logits_all``), its KV cache rolled back after
each, interleaved with the other configurations.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from tierspec.cached_model import CachedModel
from tierspec.costs import few_row_threads
from tierspec.engine import threads_for
from tierspec.models import load_model

WIDTHS = (1, 2, 4, 8, 16)
# token trees of 7 and 15 nodes (with the pending token: passes of 8 and 16 rows), 4 and 8 leaves
TREES = {8: [[1, 2, 3, 4], [1, 5], [6], [7]],
         16: [[1, 2, 3, 4, 5, 6], [1, 7, 8], [1, 2, 9], [10, 11], [12], [13], [14], [1, 15]]}


@contextmanager
def matrices_stubbed(model: torch.nn.Module):
    """Within the block every linear layer returns ``empty`` of its output shape (no product)."""
    from tierspec.kernels import linear_output_features

    stubbed = []
    for module in model.modules():
        features = linear_output_features(module)
        if features is None:
            continue
        dtype = module.output_dtype if hasattr(module, "output_dtype") else None

        def stub(x, features=features, dtype=dtype):
            return x.new_empty(*x.shape[:-1], features, dtype=dtype or x.dtype)

        module.forward = stub
        stubbed.append(module)
    try:
        yield
    finally:
        for module in stubbed:
            del module.forward


def time_passes(runner: CachedModel, context: int, widths, repeats: int = 3) -> dict[int, float]:
    """Median seconds of a cached pass over k new tokens at ``context`` cached positions."""
    vocab = runner.vocab_size
    out = {}
    for k in widths:
        tokens = (torch.arange(k) * 7 + 11) % vocab
        out[k] = median_seconds(lambda: runner.forward(tokens), runner, context, repeats)
    return out


def median_seconds(pass_, runner: CachedModel, context: int, repeats: int) -> float:
    """Median seconds of ``pass_()`` over ``repeats`` calls after one untimed warm-up, the cache
    rolled back to ``context`` after each."""
    samples = []
    for i in range(repeats + 1):
        started = time.perf_counter()
        pass_()
        elapsed = time.perf_counter() - started
        runner.rollback(context)
        if i:
            samples.append(elapsed)
    return statistics.median(samples)


def time_tree_passes(runner: CachedModel, context: int, repeats: int = 3) -> dict[int, float]:
    """Median seconds of a tree pass (``TREES``) after the token at ``context``."""
    from tierspec.tree import TokenTree, tree_pass

    out = {}
    for k, paths in TREES.items():
        layout = tree_pass(torch.tensor([11]), TokenTree.from_paths(paths))
        out[k] = median_seconds(lambda: runner.forward(layout.tokens, offsets=layout.offsets, attends=layout.attends),
                                runner, context, repeats)
    return out


class LlamaCppPasses:
    """llama.cpp's cached passes on the default model's GGUF file (``--llamacpp``)."""

    def __init__(self, context: int):
        from llama_cpp import Llama

        from tierspec.models import default_model_file

        self.llama = Llama(str(default_model_file()), n_ctx=1024, n_batch=512, n_threads=torch.get_num_threads(),
                           n_threads_batch=torch.get_num_threads(), logits_all=True, verbose=False)
        self.context = context
        self.llama.eval([int(t) for t in torch.arange(context) % self.llama.n_vocab()])

    def rollback(self) -> None:
        self.llama._ctx.kv_cache_seq_rm(-1, self.context, -1)
        self.llama.n_tokens = self.context

    def time_passes(self, widths, repeats: int = 3) -> dict[int, float]:
        out = {}
        for k in widths:
            tokens = [int(t) for t in (torch.arange(k) * 7 + 11) % self.llama.n_vocab()]
            samples = []
            for i in range(repeats + 1):
                started = time.perf_counter()
                self.llama.eval(tokens)
                elapsed = time.perf_counter() - started
                self.rollback()
                if i:
                    samples.append(elapsed)
            out[k] = statistics.median(samples)
        return out


def engine_matrix_seconds(runner: CachedModel, context: int, widths, repeats: int = 3) -> dict[int, float]:
    """Per width, the median seconds a pass spent outside the engine's matrix products."""
    from tierspec.engine import engine

    out = {}
    vocab = runner.vocab_size
    for k in widths:
        tokens = (torch.arange(k) * 7 + 11) % vocab
        samples = []
        for i in range(repeats + 1):
            engine().profile(True)
            started = time.perf_counter()
            runner.forward(tokens)
            elapsed = time.perf_counter() - started
            _, matrices, *_ = engine().profile(False)
            runner.rollback(context)
            if i:
                samples.append(elapsed - matrices)
        out[k] = statistics.median(samples)
    return out


def uses_engine(model: torch.nn.Module) -> bool:
    return any(type(m).__name__ == "QuantLinear" for m in model.modules())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="auto:auto,float32:gguf,bfloat16:packed")
    parser.add_argument("--llamacpp", action="store_true", help="add llama.cpp's passes on the same file")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = parser.parse_args()
    configs = [tuple(item.split(":")) for item in args.configs.split(",")]
    runners = {}
    for dtype, kernels in configs:
        loaded = load_model("smollm2-135m", dtype=dtype, kernels=kernels)
        few_row_threads(loaded)  # the threads a generation's few-row products run on, as the decode loop settles them
        runner = CachedModel(loaded.model)
        with torch.inference_mode():
            runner.forward(torch.arange(args.context) % runner.vocab_size, logits_for=1)
        runners[(dtype, kernels)] = runner
    whole = {config: {k: [] for k in WIDTHS} for config in runners}
    outside = {config: {k: [] for k in WIDTHS} for config in runners}
    trees = {config: {k: [] for k in TREES} for config in runners}
    llamacpp = LlamaCppPasses(args.context) if args.llamacpp else None
    llamacpp_times = {k: [] for k in WIDTHS}
    with torch.inference_mode():
        for round_index in range(args.rounds):
            for config, runner in runners.items():
                with threads_for(runner.model):  # as a generation runs its passes (the engine: torch ops on one thread)
                    for k, seconds in time_passes(runner, args.context, WIDTHS).items():
                        whole[config][k].append(seconds)
                    for k, seconds in time_tree_passes(runner, args.context).items():
                        trees[config][k].append(seconds)
                    if uses_engine(runner.model):
                        for k, seconds in engine_matrix_seconds(runner, args.context, WIDTHS).items():
                            outside[config][k].append(seconds)
                    else:
                        with matrices_stubbed(runner.model):
                            for k, seconds in time_passes(runner, args.context, WIDTHS).items():
                                outside[config][k].append(seconds)
            if llamacpp is not None:
                for k, seconds in llamacpp.time_passes(WIDTHS).items():
                    llamacpp_times[k].append(seconds)
            print(f"round {round_index + 1}/{args.rounds}", file=sys.stderr, flush=True)

    def ms(values):
        return statistics.median(values) * 1e3

    lines = [f"Cached pass of the default model at a {args.context}-token context, logits for every new token, "
             f"{torch.get_num_threads()} threads, median of {args.rounds} interleaved rounds (ms):", "",
             "| dtype:kernels | " + " | ".join(f"k={k}" for k in WIDTHS) + " | 8/1 | 16/1 |",
             "|---|" + "---|" * (len(WIDTHS) + 2)]
    for config in runners:
        row = [ms(whole[config][k]) for k in WIDTHS]
        lines.append(f"| {':'.join(config)} | " + " | ".join(f"{v:.1f}" for v in row)
                     + f" | {row[3] / row[0]:.2f} | {row[4] / row[0]:.2f} |")
        tree = [f"{ms(trees[config][k]):.1f}" if k in TREES else "" for k in WIDTHS]
        lines.append(f"| {':'.join(config)}, tree | " + " | ".join(tree) + " | | |")
        rest = [ms(outside[config][k]) for k in WIDTHS]
        lines.append(f"| {':'.join(config)}, outside the matrices | " + " | ".join(f"{v:.1f}" for v in rest) + " | | |")
    if llamacpp is not None:
        import llama_cpp

        row = [ms(llamacpp_times[k]) for k in WIDTHS]
        lines.append(f"| llama.cpp {llama_cpp.__version__}, same file | " + " | ".join(f"{v:.1f}" for v in row)
                     + f" | {row[3] / row[0]:.2f} | {row[4] / row[0]:.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
