"""What a long prompt's prefill costs on the pass engine, beside llama.cpp and OpenVINO GenAI on the
same GGUF file in the same run.

    python benchmarks/prefill.py [--tokens 1024] [--configs auto,float32,int8] [--rounds 3]
                                 [--no-llamacpp] [--openvino] [--out results/engine_many_rows/prefill.md]

A prefill is what ``decode.Verifiers.prefill`` runs: one cached pass over the prompt's tokens from
an empty cache, the logits of its last token only. For each engine configuration (``--dtype`` of
``tierspec.load_model`` on the default model's file) and for llama.cpp (llama-cpp-python, the same
file and thread count, its default batch of 512 tokens, the logits of the last token), rounds
are interleaved so that a busy spell hits every configuration alike; the table gives the median
seconds and tokens per second, the engine's time over llama.cpp's, and the prefill's time over the
time of the 128 one-token passes of an answer (``ar``) on the same configuration: how much of a
request the prompt takes.

``--openvino``: OpenVINO GenAI's ``LLMPipeline`` too (the bench's ``ov-greedy`` peer: the file, the
thread count, no prefix caching), timed from the prompt's ids in to its first token out (its prefill
and one greedy token: OpenVINO does not hand out a prefill alone), each round a prompt of other ids;
its one-token pass is the time of 129 tokens less that of one, over 128.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from tierspec.cached_model import CachedModel
from tierspec.costs import few_row_threads
from tierspec.engine import engine, threads_for
from tierspec.models import default_model_file, load_model

ANSWER = 128  # tokens of the answer the prefill is compared with


def prompt_ids(count: int, vocab: int) -> torch.Tensor:
    """A prompt of ``count`` token ids spread over the vocabulary (a pass's cost does not depend on
    which tokens it holds)."""
    return (torch.arange(count) * 7919 + 11) % vocab


def time_engine_prefill(runner: CachedModel, ids: torch.Tensor) -> float:
    runner.rollback(0)
    started = time.perf_counter()
    runner.forward(ids, logits_for=1)
    elapsed = time.perf_counter() - started
    runner.rollback(0)
    return elapsed


def time_engine_step(runner: CachedModel, ids: torch.Tensor, repeats: int = 9) -> float:
    """Median seconds of a one-token pass after the prompt (an answer's step)."""
    runner.rollback(0)
    runner.forward(ids, logits_for=1)
    samples = []
    for i in range(repeats + 1):
        started = time.perf_counter()
        runner.forward(ids[:1])
        samples.append(time.perf_counter() - started)
        runner.rollback(len(ids))
    runner.rollback(0)
    return statistics.median(samples[1:])


class LlamaCppPrefill:
    def __init__(self, tokens: int):
        from llama_cpp import Llama

        self.llama = Llama(str(default_model_file()), n_ctx=tokens + ANSWER, n_threads=torch.get_num_threads(),
                           n_threads_batch=torch.get_num_threads(), verbose=False)

    def time_prefill(self, ids: list[int]) -> float:
        self.llama.reset()
        self.llama._ctx.kv_cache_clear()
        started = time.perf_counter()
        self.llama.eval(ids)
        return time.perf_counter() - started

    def time_step(self, ids: list[int], repeats: int = 9) -> float:
        self.llama.reset()
        self.llama._ctx.kv_cache_clear()
        self.llama.eval(ids)
        samples = []
        for i in range(repeats + 1):
            started = time.perf_counter()
            self.llama.eval(ids[:1])
            samples.append(time.perf_counter() - started)
            self.llama._ctx.kv_cache_seq_rm(-1, len(ids), -1)
            self.llama.n_tokens = len(ids)
        return statistics.median(samples[1:])


class OpenVinoPrefill:
    """The ``ov-greedy`` peer's pipeline (``tierspec.bench.openvino``: the file, the threads, prefix
    caching off), greedy and past any end-of-sequence id."""

    def __init__(self):
        from tierspec.bench.openvino import OpenVinoPeer

        self.peer = OpenVinoPeer("ov-greedy", {}, "smollm2-135m", 0, (), 0.0, 0, 1.0, torch.get_num_threads())
        self.version = self.peer.record_fields["engine"].split(" on the GGUF")[0]

    def _seconds(self, ids: list[int], tokens: int) -> float:
        import numpy as np
        import openvino

        genai = self.peer.genai
        array = np.asarray([ids], dtype=np.int64)
        inputs = genai.TokenizedInputs(openvino.Tensor(array), openvino.Tensor(np.ones_like(array)))
        config = genai.GenerationConfig()
        config.max_new_tokens, config.do_sample, config.ignore_eos = tokens, False, True
        started = time.perf_counter()
        self.peer.pipeline.generate(inputs, config)
        return time.perf_counter() - started

    def time_first_token(self, ids: list[int]) -> float:
        return self._seconds(ids, 1)

    def time_step(self, ids: list[int]) -> float:
        """Seconds per token of a 128-token greedy answer after ``ids`` (its first token's time, on
        other ids of the same length, taken off)."""
        return (self._seconds(ids, ANSWER + 1) - self._seconds([i + 1 for i in ids], 1)) / ANSWER


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--configs", default="auto,float32,int8", help="engine dtypes (comma-separated)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp out")
    parser.add_argument("--openvino", action="store_true", help="add OpenVINO GenAI (the ov-greedy peer)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = parser.parse_args()
    runners = {}
    for dtype in args.configs.split(","):
        loaded = load_model("smollm2-135m", dtype=dtype, kernels="gguf")
        few_row_threads(loaded)  # the one-token pass after it on the threads a generation settles
        runners[dtype] = CachedModel(loaded.model)
    vocab = next(iter(runners.values())).vocab_size
    ids = prompt_ids(args.tokens, vocab)
    llamacpp = None if args.no_llamacpp else LlamaCppPrefill(args.tokens)
    openvino = OpenVinoPrefill() if args.openvino else None
    prefill = {name: [] for name in [*runners, "llama.cpp", "openvino"]}
    step = {name: [] for name in prefill}
    with torch.inference_mode():
        for name, runner in runners.items():  # warm-up: scratch buffers and the thread pool
            with threads_for(runner.model):
                time_engine_prefill(runner, ids[:64])
        for round_index in range(args.rounds):
            for name, runner in runners.items():
                with threads_for(runner.model):
                    prefill[name].append(time_engine_prefill(runner, ids))
                    step[name].append(time_engine_step(runner, ids))
            if llamacpp is not None:
                prefill["llama.cpp"].append(llamacpp.time_prefill([int(t) for t in ids]))
                step["llama.cpp"].append(llamacpp.time_step([int(t) for t in ids]))
            if openvino is not None:  # each round other ids: no cache of OpenVINO's could hold them
                fresh = [(int(t) + 1 + 2 * round_index) % vocab for t in ids]
                if round_index == 0:
                    openvino.time_first_token(fresh[:64])  # warm-up: the pipeline's first call
                prefill["openvino"].append(openvino.time_first_token(fresh))
                step["openvino"].append(openvino.time_step([(t + 1) % vocab for t in fresh]))
            print(f"round {round_index + 1}/{args.rounds}", file=sys.stderr, flush=True)
    peer = statistics.median(prefill["llama.cpp"]) if llamacpp is not None else None
    lines = [f"Prefill of a {args.tokens}-token prompt on the default model's file (last token's logits), "
             f"{torch.get_num_threads()} threads, engine kernels {engine().isa()}, median of {args.rounds} "
             "interleaved rounds:", "",
             "| configuration | seconds | tok/s | / llama.cpp | one-token pass after it (ms) | "
             f"prefill / {ANSWER} steps |", "|---|---|---|---|---|---|"]
    for name in prefill:
        if not prefill[name]:
            continue
        seconds, one = statistics.median(prefill[name]), statistics.median(step[name])
        label = f"tierspec --dtype {name}"
        if name == "llama.cpp":
            import llama_cpp

            label = f"llama.cpp {llama_cpp.__version__}, same file"
        elif name == "openvino":
            label = f"{openvino.version}, same file (to its first token)"
        ratio = f"{seconds / peer:.2f}" if peer else ""
        lines.append(f"| {label} | {seconds:.3f} | {args.tokens / seconds:.0f} | {ratio} | {one * 1e3:.1f} | "
                     f"{seconds / (ANSWER * one):.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
