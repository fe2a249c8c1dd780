"""Greedy tokens/s of several methods on one prompt, in one process (a quick sanity check).

    python benchmarks/one_prompt.py --methods ar,sd,pld,adaptive-pld "Name three primary colours."

Each method runs once to warm up, then twice in alternation; the table shows both runs.
"""

from __future__ import annotations

import argparse

import tierspec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("prompt", nargs="?", default="Name three primary colours.")
    parser.add_argument("--methods", default="ar,sd,pld")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    target = tierspec.load_model("smollm2-135m")
    methods = args.methods.split(",")
    for method in methods:
        tierspec.generate(args.prompt, target=target, method=method, max_new_tokens=8)
    rows = {m: [] for m in methods}
    reference = None
    for _ in range(2):
        for method in methods:
            out = tierspec.generate(args.prompt, target=target, method=method, max_new_tokens=args.max_new_tokens)
            reference = reference or out.token_ids
            rows[method].append((out.stats.tokens_per_second, out.stats.emitted, out.stats.mean_accepted_tokens, out.token_ids == reference))
    print("| method | tokens/s (run 1, run 2) | emitted | τ | same tokens as ar |")
    print("|---|---|---|---|---|")
    for method, runs in rows.items():
        print(f"| {method} | {runs[0][0]:.2f}, {runs[1][0]:.2f} | {runs[0][1]} | {runs[0][2]:.2f} | {all(r[3] for r in runs)} |")


if __name__ == "__main__":
    main()
