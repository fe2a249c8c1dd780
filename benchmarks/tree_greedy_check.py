"""Greedy: eagle-tree / hybrid-tree against ar (and the chain methods eagle / hybrid) on the default model,
4 Spec-Bench prompts (one per category, the first four categories), 48 tokens each: whether the tokens are
ar's, τ, nodes per target pass, acceptance by depth, tokens/s (one run on a shared machine: speeds are
indicative only). One JSON line per prompt on stdout:

    python benchmarks/tree_greedy_check.py [--dtype float32] [--methods ar,eagle-tree,hybrid-tree] > results/tree_check/greedy.jsonl
"""

from __future__ import annotations

import argparse
import json

import tierspec
from tierspec.data import load_prompts, select

METHODS = ("ar", "eagle", "eagle-tree", "hybrid", "hybrid-tree")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--methods", default=",".join(METHODS), help="ar first")
    args = parser.parse_args()
    target = tierspec.load_model("smollm2-135m", dtype=args.dtype)
    for prompt in select(load_prompts("spec_bench"), per_category=1)[:4]:
        row, reference = {"prompt": prompt.id, "dtype": str(target.model.dtype)}, None
        for method in args.methods.split(","):
            out = tierspec.generate(prompt.text, target=target, method=method, max_new_tokens=48)
            stats = out.stats.to_dict()
            reference = out.token_ids if method == "ar" else reference
            row[method] = {"same": out.token_ids == reference, "tau": stats["mean_accepted_tokens"],
                           "tok/s": stats["tokens_per_second"],
                           "nodes/pass": round(stats["drafted"] / max(stats["target_calls"], 1), 2),
                           "acc": stats["acceptance_by_position"][:5], **({"tree": stats["tree"]} if "tree" in stats else {})}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
