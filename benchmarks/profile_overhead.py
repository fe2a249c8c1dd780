"""Per-cycle overhead of the decode loop outside model forwards (issue: < 5% of cycle time).

    python benchmarks/profile_overhead.py --methods ar,adaptive-pld,pld,sd --prompts 6

Runs each method greedily on Spec-Bench prompts under cProfile and splits the decode time
into time inside ``CachedModel.forward`` (the model passes: target, drafter, slim verifier,
including transformers' own Python inside the forward) and everything else (drafting logic,
rules, commit/rollback, statistics). Prints one line per method and the functions with the
most own time (torch kernels included, to show what the forwards spend their time on).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import tierspec
from tierspec.api import encode_prompt
from tierspec.data import load_prompts, select


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", default="ar,adaptive-pld,pld")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    target = tierspec.load_model("smollm2-135m")
    prompts = select(load_prompts("spec_bench"), per_category=1, seed=1)[: args.prompts]
    ids = [encode_prompt(target, p.text) for p in prompts]
    tierspec.generate(ids[0], target=target, method="ar", max_new_tokens=8)  # warm-up
    for method in args.methods.split(","):
        profiler = cProfile.Profile()
        profiler.enable()
        for prompt_ids in ids:
            tierspec.generate(prompt_ids, target=target, method=method, max_new_tokens=args.max_new_tokens)
        profiler.disable()
        stats = pstats.Stats(profiler)
        total = forward = 0.0
        for (filename, _, name), (_, _, _, cumulative, _) in stats.stats.items():
            if name == "stream" and filename.endswith("api.py"):
                total = cumulative
            if name == "forward" and filename.endswith("tierspec/models.py"):
                forward = cumulative
        print(f"{method}: decode {total:.2f} s, model forwards {forward:.2f} s, "
              f"outside forwards {total - forward:.2f} s = {100 * (total - forward) / total:.1f}% of the time")
        stats.sort_stats("tottime")
        own = sorted(((v[2], k) for k, v in stats.stats.items()), reverse=True)[:6]
        for seconds, (filename, line, name) in own:
            print(f"    {seconds:6.3f} s own time  {name} ({filename.split('/')[-1]}:{line})")


if __name__ == "__main__":
    main()
