"""The default model's cached forward passes on tierspec's own Llama code against transformers'
modules (both with the few-row kernels), measured in one process, interleaved.

    python benchmarks/model_code.py [--rounds 5]

Each round measures the forward-cost table (``costs.measure_forward_costs``: passes of 1..8
new tokens at a 256-token context) of one implementation, then of the other; the report gives
the median over rounds per token count and the ratio. Writes results/model_code.md (quoted in
BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from tierspec.costs import measure_forward_costs
from tierspec.models import load_model
from tierspec.util import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
TOKENS = (1, 2, 4, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "model_code.md")
    args = parser.parse_args()
    models = {code: load_model("smollm2-135m", implementation=code) for code in ("tierspec", "transformers")}
    samples = {code: {n: [] for n in TOKENS} for code in models}
    for _ in range(args.rounds):
        for code, loaded in models.items():
            table = measure_forward_costs(loaded.model, max_tokens=max(TOKENS))
            for n in TOKENS:
                samples[code][n].append(table.seconds[n])
    lines = ["## The default model's forward pass: tierspec's Llama code against transformers' modules", "",
             f"`python benchmarks/model_code.py --rounds {args.rounds}` — cached passes at a 256-token context, "
             "the same few-row kernels, medians over rounds that alternate the two implementations in one process.", "",
             "| new tokens | tierspec ms | transformers ms | tierspec ÷ transformers |", "|---|---|---|---|"]
    for n in TOKENS:
        ours, theirs = (statistics.median(samples[code][n]) * 1000 for code in ("tierspec", "transformers"))
        lines.append(f"| {n} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.3f} |")
    text = "\n".join(lines) + "\n"
    atomic_write_text(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
