"""A GGUF model on tierspec's own forward against transformers' float32 modules on the same file's
de-quantised weights: greedy text of both on each prompt, equal or not, and where they part.

    python benchmarks/model_fidelity.py [--target gemma3-270m] [--prompts 24] [--max-new-tokens 48]
                                        [--dtype float32] [--out results/models]

The reference is ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=..., dtype=float32)``: the
file's values de-quantised by gguf-py, transformers' modelling code. Both get the same prompt ids
(tierspec's tokenizer of the file, without a chat template: the default target is a base model) and
stop at the same budget or end-of-sequence id. Every text is scored by the reference (mean negative
log-likelihood per generated token, teacher-forced), so a parting is weighed: the target is equal
text on every prompt, or a mean NLL within +1% of the reference's own. Prompts: MT-Bench first turns
and GSM8K test questions, as benchmarks/engine_fidelity.py uses.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import tierspec
from tierspec.data import load_prompts
from tierspec.prompting import eos_ids


def prompts(count: int) -> list[str]:
    texts = [p.text for p in load_prompts("mt_bench")][: count // 2]
    texts += [p.text for p in load_prompts("gsm8k")][: count - len(texts)]
    return texts


def reference_greedy(model, ids: list[int], budget: int, eos: set[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=budget, do_sample=False,
                             eos_token_id=sorted(eos) or None, pad_token_id=0)[0, len(ids):].tolist()
    for i, token in enumerate(out):
        if token in eos:
            return out[: i + 1]
    return out


def nll(model, ids: list[int], continuation: list[int]) -> float:
    """Mean −log p(continuation | prompt) per token under ``model`` (teacher-forced)."""
    if not continuation:
        return 0.0
    with torch.inference_mode():
        logits = model(torch.tensor([ids + continuation])).logits[0, len(ids) - 1 : -1].float()
    picked = torch.log_softmax(logits, -1).gather(1, torch.tensor(continuation).unsqueeze(1))
    return float(-picked.mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="gemma3-270m")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="float32", help="tierspec's dtype (the reference is always float32)")
    parser.add_argument("--out", type=Path, default=Path("results/models"))
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from tierspec.model_files import KNOWN_MODELS, known_model_file

    path = known_model_file(args.target) if args.target in KNOWN_MODELS else Path(args.target)
    ours = tierspec.load_model(args.target, dtype=args.dtype)
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    eos = set(eos_ids(ours))
    rows, started = [], time.perf_counter()
    for index, text in enumerate(prompts(args.prompts)):
        ids = ours.tokenizer(text)["input_ids"]
        mine = tierspec.generate(ids, target=ours, method="ar", max_new_tokens=args.max_new_tokens).token_ids
        theirs = reference_greedy(reference, ids, args.max_new_tokens, eos)
        parting = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if parting is None and len(mine) != len(theirs):
            parting = min(len(mine), len(theirs))
        row = {"prompt": index, "equal": mine == theirs, "tokens": len(mine),
               "nll_tierspec": nll(reference, ids, mine), "nll_reference": nll(reference, ids, theirs)}
        if parting is not None:
            row["parting"] = {"position": parting, "tierspec": ours.tokenizer.decode(mine[parting : parting + 4]),
                              "reference": ours.tokenizer.decode(theirs[parting : parting + 4])}
        rows.append(row)
        print(json.dumps(row, ensure_ascii=False), file=sys.stderr, flush=True)
    equal = sum(row["equal"] for row in rows)
    mine_nll = statistics.mean(row["nll_tierspec"] for row in rows)
    their_nll = statistics.mean(row["nll_reference"] for row in rows)
    summary = {
        "command": "python benchmarks/model_fidelity.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "target": args.target, "file": path.name, "dtype": args.dtype, "prompts": len(rows),
        "max_new_tokens": args.max_new_tokens, "equal_text": equal,
        "mean_nll_tierspec": round(mine_nll, 5), "mean_nll_reference": round(their_nll, 5),
        "nll_difference_percent": round(100 * (mine_nll - their_nll) / their_nll, 3) if their_nll else 0.0,
        "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "seconds": round(time.perf_counter() - started, 1), "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{args.target.replace('/', '_')}-fidelity.json"
    out.write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    print(f"{args.target}: greedy text equal to transformers' float32 on {equal} of {len(rows)} prompts; "
          f"mean NLL {mine_nll:.4f} vs {their_nll:.4f} ({summary['nll_difference_percent']:+.2f}%); {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
