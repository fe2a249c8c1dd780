"""Regenerate BENCHMARKS.md: every method and the transformers peers on Spec-Bench, one run.

    python benchmarks/spec_bench.py --out results/spec_bench

Runs ``tierspec bench`` (resumable: rerun the same command after an interruption) with the
method list below, then writes BENCHMARKS.md from its summary, with the machine described.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} CPU cores ({cpu or platform.processor()}), {memory:.0f} GiB RAM, no GPU; "
            f"Python {platform.python_version()}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"transformers {transformers.__version__}; a shared machine, so compare ratios within one run only.")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results/spec_bench")
    parser.add_argument("--mask", default="masks/smollm2-135m-sublayer-r0.1.json", help="DIMR mask for self / via / bild")
    parser.add_argument("--draft-mask", default="masks/smollm2-135m-sublayer-r0.45.json", help="mask of the layer-skip drafter")
    parser.add_argument("--more-via-masks", nargs="*", default=["masks/smollm2-135m-sublayer-r0.2.json",
                                                                "masks/smollm2-135m-sublayer-r0.45.json"],
                        help="further slim-verifier masks for via (the r the issue asks for besides --mask)")
    parser.add_argument("--per-category", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--write", default=str(ROOT / "BENCHMARKS.md"))
    parser.add_argument("--summarize-only", action="store_true", help="report on the records so far (a stopped run)")
    args = parser.parse_args()
    methods = [
        "ar", "hf-greedy", "pld", "adaptive-pld", "sd", "csd", f"self:mask={args.mask}", "swift",
        "lossy:alpha=0.3:draft_with=ngram",
        f"cascade:deferral=opt:alpha=0.3:draft_with=self:draft_mask={args.draft_mask}",
        f"bild:draft_with=self:draft_mask={args.draft_mask}",
        f"via:mask={args.mask}:draft_with=ngram",
        *(f"via:mask={mask}:draft_with=ngram" for mask in args.more_via_masks),
        "hf-pld", "hf-assisted", "hf-early-exit",
    ]
    command = [sys.executable, "-m", "tierspec.cli", "bench", "--target", "smollm2-135m", "--dataset", "spec_bench",
               "--per-category", str(args.per_category), "--max-new-tokens", str(args.max_new_tokens), "--temperature", "0",
               "--methods", ",".join(methods), "--out", args.out]
    subprocess.run(command + (["--summarize-only", "--no-progress"] if args.summarize_only else []), check=True, cwd=ROOT)
    out_dir = Path(args.out) if Path(args.out).is_absolute() else ROOT / args.out
    table = out_dir / "summary.md"
    shown = " ".join(command[1:]).replace(sys.executable, "python")
    import json

    ar = json.loads((out_dir / "summary.json").read_text())["methods"]["ar"]
    measured = min(c["n_prompts"] for c in ar["categories"].values())
    status = ""
    if measured < args.per_category:
        status = (f"\n**Partial run:** stopped after {measured} of {args.per_category} prompts per category "
                  f"({ar['overall']['n_prompts']} prompts); rerunning the command resumes it and rewrites this file.\n")
    text = f"""# Benchmarks

Produced by `python benchmarks/spec_bench.py --out {args.out}` (which runs
`python {shown}` and writes this file).

Machine: {machine()}
{status}
Spec-Bench, {args.per_category} prompts per category (seeded sample, first turn), {args.max_new_tokens} new tokens, greedy.
`hf-*` are transformers' own `generate` in the same process: plain greedy, assisted generation
with the target itself as assistant (the same drafter as `sd`), prompt lookup (10 tokens), and
early exit (`assistant_early_exit` = half the layers). Masks: `{args.mask}` (DIMR, slim
verifier / self-drafter), `{args.draft_mask}` (BiLD's layer-skip drafter).

{table.read_text()}
Plots: `{args.out}/speedup_by_category.png`, `{args.out}/quality_vs_speedup.png`, `{args.out}/tier_fractions.png`.
"""
    Path(args.write).write_text(text)
    print(f"wrote {args.write}")


if __name__ == "__main__":
    main()
