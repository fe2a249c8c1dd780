"""How long the cost-aware policies draft, and how often each drafted position is accepted, in
one or more `tierspec bench` runs (e.g. before and after a change to the pass costs).

    python benchmarks/draft_lengths.py results/draft_head-own results/spec_bench-packed [--methods eagle,hybrid]

Reads each run's records.jsonl and prints, per method: drafted tokens per cycle, τ (emitted
tokens per target call), and acceptance by draft position (the share of cycles whose drafted
token i was accepted, given that tokens 1..i−1 were; over all prompts of the run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def summarize(records: list[dict], method: str) -> dict | None:
    rows = [r for r in records if r.get("method") == method]
    if not rows or "cycles" not in rows[0]:
        return None
    drafted_at, accepted_at = [], []
    for row in rows:
        for i, (d, a) in enumerate(zip(row.get("position_drafted", []), row.get("position_accepted", []))):
            while len(drafted_at) <= i:
                drafted_at.append(0)
                accepted_at.append(0)
            drafted_at[i] += d
            accepted_at[i] += a
    cycles = sum(r["cycles"] for r in rows)
    return {"prompts": len(rows), "drafted_per_cycle": sum(r["drafted"] for r in rows) / cycles,
            "tau": sum(r["emitted"] for r in rows) / max(1, sum(r["target_calls"] for r in rows)),
            "acceptance_by_position": [a / d if d else 0.0 for a, d in zip(accepted_at, drafted_at)],
            "cycles_reaching": drafted_at}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--methods", default="adaptive-pld,eagle,hybrid")
    parser.add_argument("--positions", type=int, default=8)
    args = parser.parse_args()
    header = " | ".join(f"p{i + 1}" for i in range(args.positions))
    print(f"| run | method | prompts | drafted/cycle | τ | acceptance by position: {header} |")
    print("|---|---|---|---|---|" + "---|" * args.positions)
    for run in args.runs:
        records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines() if line.strip()]
        for method in args.methods.split(","):
            found = summarize(records, method)
            if found is None:
                continue
            by_position = found["acceptance_by_position"][: args.positions]
            cells = [f"{a:.2f} ({n})" for a, n in zip(by_position, found["cycles_reaching"])]
            cells += ["–"] * (args.positions - len(cells))
            print(f"| {run.name} | {method} | {found['prompts']} | {found['drafted_per_cycle']:.2f} | "
                  f"{found['tau']:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
