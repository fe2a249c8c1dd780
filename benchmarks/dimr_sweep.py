"""DIMR vs equal-budget random search on the default model, for several ratios and units.

    python benchmarks/dimr_sweep.py --out results/dimr --budget 120

Builds the calibration text once, then for every (ratio, unit) runs DIMR and random search
with the same budget and no early stop, writes each best mask to OUT/mask-{unit}-r{ratio}.json
and a table to OUT/summary.md (and summary.json). Resumable: finished runs are skipped.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tierspec.data import calibration_prompts
from tierspec.models import load_model
from tierspec.layerskip.search import SearchConfig, search_mask
from tierspec.training.calibration import build_calibration
from tierspec.util import atomic_write_text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--ratios", default="0.1,0.2,0.3,0.45")
    parser.add_argument("--units", default="sublayer,layer")
    parser.add_argument("--budget", type=int, default=120)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--out", default="results/dimr")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = load_model(args.target)
    calibration = build_calibration(target, calibration_prompts(args.prompts))
    summary_path = out / "summary.json"
    rows = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    for unit in args.units.split(","):
        for ratio in (float(r) for r in args.ratios.split(",")):
            for strategy in ("dimr", "random"):
                key = f"{unit}-r{ratio}-{strategy}"
                if key in rows:
                    continue
                config = SearchConfig(ratio=ratio, unit=unit, budget=args.budget, patience=args.budget, strategy=strategy)
                result = search_mask(target, calibration, config, checkpoint=out / f"{key}.partial.json")
                result.mask.save(out / f"mask-{unit}-r{ratio}-{strategy}.json")
                rows[key] = {"unit": unit, "ratio": ratio, "strategy": strategy, **result.summary()}
                atomic_write_text(summary_path, json.dumps(rows, indent=2))
    lines = [
        f"DIMR vs random search, budget {args.budget} evaluations each, {calibration.sequences.shape[0]} calibration "
        f"sequences × τ = {calibration.window} positions (cost summed over all of them).",
        "",
        "| unit | r | DIMR best cost | DIMR agreement | random best cost | random mean cost | random best agreement | DIMR s | random s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for unit in args.units.split(","):
        for ratio in (float(r) for r in args.ratios.split(",")):
            d, r = rows[f"{unit}-r{ratio}-dimr"], rows[f"{unit}-r{ratio}-random"]
            lines.append(
                f"| {unit} | {ratio} | {d['best_cost']:.1f} | {d['best_agreement']:.3f} | {r['best_cost']:.1f} | "
                f"{r['random_mean_cost']:.1f} | {r['best_agreement']:.3f} | {d['seconds']:.0f} | {r['seconds']:.0f} |"
            )
    atomic_write_text(out / "summary.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
