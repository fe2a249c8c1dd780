"""Where the time of one cached one-token pass of the default model goes, as a generation runs it:
the engine's layer stack, the LM head's product, and the Python and torch work around them.

    python benchmarks/pass_breakdown.py [--passes 300] [--context 300] [--dtype auto] [--out results/pass_breakdown.json]

The model is loaded as the CLI loads it (``--dtype auto``), a ``--context``-token prompt is cached,
and ``--passes`` one-token passes are timed under the generation's thread arrangement
(``engine.threads_for``), the cache rolled back after each. Probes (exclusive time: a wrapped call's
time less the wrapped calls inside it) time the stack call (``engine.run_stack``), every engine
product (``QuantWeight.multiply``: the LM head here), ``torch.rms_norm`` (the final norm), and the
Python of ``CachedModel.forward``, ``LlamaLM.forward``, ``Decoder.forward``, ``Decoder.layout`` and
``Decoder._engine_forward``; what no probe holds is "unaccounted". A probe adds a few microseconds
a call, so the Python rows are upper bounds.

``--norm-twice``: also times the final norm a second time right after the first, on the same input:
the first torch operator after the stack (which streamed the weights through every cache) pays for
code and data the stack evicted; the second shows what the operator costs with warm caches.

``--featured``: also times two-token passes with and without the hidden states a draft head reads
(``with_hidden``, the final states and the outputs of the shipped head's feature layers), in turn
``--passes`` times each: what a featured pass (the default method's every pass) adds, as medians.

``--maxima 1,3,9``: also times the LM head's product alone over that many rows, plain
(``QuantWeight.multiply``) and finding each row's first maximum as it goes
(``multiply_with_maxima``: what a batched pass runs, so that a greedy walk reads no logits), and
for sampled rows at temperature 1 the product drawing every row's keyed token as it goes
(``multiply_with_draws``: what a sampled chain's pass runs) against the maxima's product followed
by every row's draw after it (``sampling.keyed_tokens``: what the walk did before), in turn
``--passes`` times each, on the generation's threads: what the maxima and the draws add, as medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_time import Probe  # noqa: E402  (exclusive seconds inside wrapped callables, by kind)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=300)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--norm-twice", action="store_true")
    parser.add_argument("--featured", action="store_true")
    parser.add_argument("--maxima", default="", help="rows of the LM head's product timed with and without maxima")
    parser.add_argument("--out", type=Path, default=Path("results/pass_breakdown.json"))
    args = parser.parse_args()

    import tierspec
    from tierspec import cached_model, engine, llama, quant
    from tierspec.costs import few_row_threads
    from tierspec.engine import threads_for
    from tierspec.sampling import Noise, keyed_tokens
    from tierspec.util import atomic_write_text

    target = tierspec.load_model("smollm2-135m", dtype=args.dtype)
    few_row_threads(target)  # the threads a generation's few-row products run on, as the decode loop settles them
    probe = Probe()
    probe.wrap(engine, "run_stack", "stack (engine call)")
    probe.wrap(quant.QuantWeight, "multiply", "LM head product (engine call)")
    probe.wrap(torch, "rms_norm", "final norm (torch)")
    probe.wrap(cached_model.CachedModel, "forward", "CachedModel.forward (Python)")
    probe.wrap(llama.LlamaLM, "forward", "LlamaLM.forward (Python)")
    probe.wrap(llama.Decoder, "forward", "Decoder.forward (Python)")
    probe.wrap(llama.Decoder, "layout", "Decoder.layout (Python)")
    probe.wrap(llama.Decoder, "_engine_forward", "Decoder._engine_forward (Python)")
    warm: list[float] = []
    if args.norm_twice:
        first = llama.RMSNorm.forward

        def twice(self, x):
            out = first(self, x)
            started = time.perf_counter()
            first(self, x)
            warm.append(time.perf_counter() - started)
            return out

        llama.RMSNorm.forward = twice
    runner = cached_model.CachedModel(target.model)
    token = torch.tensor([17])
    with torch.inference_mode(), threads_for(target.model):
        runner.forward(torch.arange(args.context) % runner.vocab_size, logits_for=1)
        for _ in range(20):  # warm-up
            runner.forward(token, logits_for=1)
            runner.rollback(args.context)
        probe.totals.clear()
        warm.clear()
        started = time.perf_counter()
        for _ in range(args.passes):
            runner.forward(token, logits_for=1)
            runner.rollback(args.context)
        wall = time.perf_counter() - started
    rows = {kind: 1000 * seconds / args.passes for kind, seconds in sorted(probe.totals.items(), key=lambda kv: -kv[1])}
    if warm:  # the second norm ran inside the probed first call's frame: not part of the pass
        rows["final norm (torch)"] -= 1000 * sum(warm) / args.passes
        rows["unaccounted"] = 1000 * (wall - sum(probe.totals.values())) / args.passes
        rows["final norm again, warm (not in the pass)"] = 1000 * statistics.median(warm)
        wall -= sum(warm)
    else:
        rows["unaccounted"] = 1000 * (wall - sum(probe.totals.values())) / args.passes
    featured = {}
    if args.featured:
        from tierspec.heads.shipped import shipped_head

        layers = shipped_head(target).config.feature_layers
        tokens = torch.tensor([17, 18])
        samples: dict[bool, list[float]] = {False: [], True: []}
        with torch.inference_mode(), threads_for(target.model):
            for _ in range(args.passes):
                for hidden in (False, True):
                    started = time.perf_counter()
                    runner.forward(tokens, logits_for=2, with_hidden=hidden, hidden_layers=layers if hidden else ())
                    samples[hidden].append(time.perf_counter() - started)
                    runner.rollback(args.context)
        featured = {"hidden_layers": list(layers), "plain_ms": round(1000 * statistics.median(samples[False]), 3),
                    "featured_ms": round(1000 * statistics.median(samples[True]), 3)}
    maxima = {}
    if args.maxima:
        head = target.model.lm_head.qweight
        with torch.inference_mode(), threads_for(target.model):
            for count in [int(r) for r in args.maxima.split(",")]:
                x = torch.randn(count, head.in_features, generator=torch.Generator().manual_seed(count))
                keys = [Noise(count, head.out_features).key(row) for row in range(count)]

                def drawn_after(rows: torch.Tensor) -> None:
                    logits, _ = head.multiply_with_maxima(rows)
                    keyed_tokens(logits, keys)

                kinds = (("plain", head.multiply), ("maxima", head.multiply_with_maxima),
                         ("draws", lambda rows: head.multiply_with_draws(rows, keys, [1.0] * count)),
                         ("draws_after", drawn_after))
                timed: dict[str, list[float]] = {kind: [] for kind, _ in kinds}
                for _ in range(args.passes):
                    for kind, product in kinds:
                        started = time.perf_counter()
                        product(x)
                        timed[kind].append(time.perf_counter() - started)
                maxima[count] = {kind: round(1000 * statistics.median(v), 3) for kind, v in timed.items()}
    result = {"command": " ".join(sys.argv), "dtype": args.dtype, "context": args.context, "passes": args.passes,
              "ms_per_pass": round(1000 * wall / args.passes, 3), "rows_ms": {k: round(v, 3) for k, v in rows.items()},
              "two_token_pass_with_hidden_states": featured, "lm_head_with_maxima_ms": maxima}
    print(f"one-token pass after {args.context} cached tokens, mean of {args.passes}: {result['ms_per_pass']} ms")
    for kind, ms in result["rows_ms"].items():
        print(f"  {kind:45s} {ms:7.3f} ms")
    if featured:
        print(f"two-token pass, medians of {args.passes} in turn: {featured['plain_ms']} ms, with the hidden states of "
              f"layers {featured['hidden_layers']} and the final ones {featured['featured_ms']} ms")
    for count, ms in maxima.items():
        print(f"LM head product over {count} rows, medians of {args.passes} in turn: {ms['plain']} ms, with each "
              f"row's first maximum {ms['maxima']} ms; with each row's keyed draw {ms['draws']} ms, the maxima's and "
              f"the draws after it {ms['draws_after']} ms")
    atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
