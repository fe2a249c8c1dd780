"""bfloat16 against float32 on Spec-Bench, greedy: does bfloat16 keep the target's quality, and
does every lossless method reproduce plain decoding (`ar`) of its own dtype?

    python benchmarks/dtype_quality.py [--per-category 5] [--max-new-tokens 128]
        [--methods pld,adaptive-pld,eagle,hybrid] [--dtypes float32,bfloat16] [--kernels auto]
        [--out results/dtype_quality]

For each dtype the default model is loaded once; on every prompt `ar` and each method generate
greedily. Reported:

* divergence: prompts on which a lossless method's tokens differ from `ar`'s of the same dtype
  (and where they first part) — 0 is the claim;
* quality of bfloat16: the float32 model's mean negative log-likelihood of each dtype's `ar`
  text (the float32 model scores both), the share of prompts whose bfloat16 `ar` text equals
  float32 `ar`'s, and the mean common prefix;
* `ar` tokens/s per dtype (one process, prompts interleaved dtype by dtype).

Per-prompt results go to ``records.jsonl`` in ``--out`` (a rerun resumes); ``summary.md`` is
written at the end. Uses only APIs that also existed before the packed kernels, so the same
script measures older code (``PYTHONPATH=<old checkout>``) for a before/after comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import tierspec
from tierspec.bench.metrics import target_nll
from tierspec.data import load_prompts, select
from tierspec.prompting import encode_prompt


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-category", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--methods", default="pld,adaptive-pld,eagle,hybrid")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--out", type=Path, default=Path("results/dtype_quality"))
    args = parser.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    dtypes = args.dtypes.split(",")
    prompts = select(load_prompts("spec_bench"), per_category=args.per_category)
    args.out.mkdir(parents=True, exist_ok=True)
    records_path = args.out / "records.jsonl"
    done = {}
    if records_path.exists():
        for line in records_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[(record["dtype"], record["prompt"])] = record
    targets = {dtype: tierspec.load_model("smollm2-135m", dtype=dtype, kernels=args.kernels) for dtype in dtypes}
    for target in targets.values():  # warm-up (and the cost tables the adaptive methods measure once)
        for method in ["ar", *methods]:
            tierspec.generate("Hello", target=target, method=method, max_new_tokens=8)
    with open(records_path, "a") as log:
        for index, prompt in enumerate(prompts):
            for dtype, target in targets.items():
                if (dtype, prompt.id) in done:
                    continue
                ar = tierspec.generate(prompt.text, target=target, method="ar", max_new_tokens=args.max_new_tokens)
                record = {"dtype": dtype, "prompt": prompt.id, "category": prompt.category, "ar": ar.token_ids,
                          "ar_tokens_per_s": ar.stats.tokens_per_second, "methods": {}}
                for method in methods:
                    out = tierspec.generate(prompt.text, target=target, method=method,
                                            max_new_tokens=args.max_new_tokens)
                    parted = common_prefix(out.token_ids, ar.token_ids)
                    record["methods"][method] = {"same": out.token_ids == ar.token_ids,
                                                 "parted_at": None if out.token_ids == ar.token_ids else parted,
                                                 "tokens_per_s": out.stats.tokens_per_second}
                done[(dtype, prompt.id)] = record
                log.write(json.dumps(record) + "\n")
                log.flush()
            print(f"prompt {index + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    targets.clear()
    scorer = tierspec.load_model("smollm2-135m", dtype="float32", kernels=args.kernels)
    nll = {dtype: [] for dtype in dtypes}
    same_as_float32, prefixes = [], []
    for prompt in prompts:
        prompt_ids = encode_prompt(scorer, prompt.text)
        for dtype in dtypes:
            nll[dtype].append(target_nll(scorer.model, prompt_ids, done[(dtype, prompt.id)]["ar"]))
        if "float32" in dtypes:
            reference = done[("float32", prompt.id)]["ar"]
            for dtype in dtypes:
                if dtype != "float32":
                    same_as_float32.append(done[(dtype, prompt.id)]["ar"] == reference)
                    prefixes.append(common_prefix(done[(dtype, prompt.id)]["ar"], reference))
    lines = [f"Spec-Bench, {args.per_category} prompts per category ({len(prompts)}), greedy, "
             f"{args.max_new_tokens} new tokens, kernels `{args.kernels}`, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads.", "",
             "| dtype | method | same tokens as `ar` of the dtype | first parting (token index) | tokens/s (mean) |",
             "|---|---|---|---|---|"]
    for dtype in dtypes:
        rows = [done[(dtype, p.id)] for p in prompts]
        lines.append(f"| {dtype} | ar | – | – | {statistics.mean(r['ar_tokens_per_s'] for r in rows):.1f} |")
        for method in methods:
            same = sum(r["methods"][method]["same"] for r in rows)
            parted = sorted(r["methods"][method]["parted_at"] for r in rows if not r["methods"][method]["same"])
            lines.append(f"| {dtype} | {method} | {same}/{len(rows)} | {parted or '–'} | "
                         f"{statistics.mean(r['methods'][method]['tokens_per_s'] for r in rows):.1f} |")
    lines += ["", "| dtype | NLL of its `ar` text under the float32 model (nats/token) |", "|---|---|"]
    lines += [f"| {dtype} | {statistics.mean(values):.4f} |" for dtype, values in nll.items()]
    if same_as_float32:
        lines += ["", f"bfloat16 `ar` text equal to float32 `ar`'s on {sum(same_as_float32)}/{len(same_as_float32)} "
                  f"prompts; mean common prefix {statistics.mean(prefixes):.1f} of {args.max_new_tokens} tokens."]
    text = "\n".join(lines) + "\n"
    (args.out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
