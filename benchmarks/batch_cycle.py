"""Where a batch's time goes: continuous batching in process (no server), by batch size.

    python benchmarks/batch_cycle.py [--sizes 1,2,4,8] [--methods hybrid,ar,adaptive-pld]
                                     [--prompts 16] [--max-new-tokens 128] [--temperature 0] [--top-k 0] [--top-p 1]
                                     [--presence-penalty 0] [--frequency-penalty 0]
                                     [--noise-rows-shared-from 8,24] [--out results/batch_cycle.json]

For each method and batch size B, the same ``--prompts`` MT-Bench first turns (greedy) run through one
``BatchDecoder`` with at most B generations at a time (a finished one's place taken by the next
prompt, as the server does); reported: total tokens per second, the mean batch, rows per pass and
tokens emitted per cycle, and each cycle's wall time split into drafting (every generation's drafter
and policy, the draft head's steps, the batch's cut), the batched target pass, verifying and
committing (``decode.CycleTimes``) — so that a ratio to B = 1 can be read in calls and costs per token. Every generation's tokens are checked
against its B = 1 tokens (the batch's invariance). The methods are interleaved size by size.
``--alone-costs`` adds each speculative method with its policies costing drafts as if alone
(``BatchDecoder(shared_costs=False)``: only the batch's own cut), for comparison. ``--temperature``
above 0 samples under seed 0 (keyed noise: the batch's texts are still each one's solo text), with
``--top-k`` and ``--top-p`` filtering the rows as users set them (and ``--presence-penalty``,
``--frequency-penalty`` changing them: ``tierspec.modifiers``);
``--noise-rows-shared-from`` adds each method with the batch's keyed draws shared among the engine's
threads from that many rows (``sampling.PARALLEL_ROWS``; the default is the noise loop's own).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tierspec import load_model
from tierspec.batch import BatchDecoder
from tierspec.data import load_prompts
from tierspec.decode import DecodeConfig
from tierspec.methods import MethodOptions, build_method
from tierspec.modifiers import LogitModifiers
from tierspec.prompting import encode_prompt, eos_ids
from tierspec import sampling
from tierspec.sampling import SamplingConfig
from tierspec.util import atomic_write_text


def run_batch(target, method: str, prompts, size: int, max_new_tokens: int, shared_costs: bool = True,
              temperature: float = 0.0, noise_rows_shared_from: int | None = None, top_k: int = 0,
              top_p: float = 1.0, modifiers: LogitModifiers = LogitModifiers()) -> dict:
    config = DecodeConfig(max_new_tokens=max_new_tokens, sampling=SamplingConfig(temperature, top_k, top_p),
                          eos_token_ids=eos_ids(target), modifiers=modifiers)
    batch = BatchDecoder(target, max_batch=size, shared_costs=shared_costs)
    built = build_method(method, target, None, MethodOptions())
    default_rows = sampling.PARALLEL_ROWS
    if noise_rows_shared_from is not None:
        sampling.PARALLEL_ROWS = noise_rows_shared_from
    try:
        started = time.perf_counter()
        runs = batch.run_all(prompts, built, config, seed=0)
        wall = time.perf_counter() - started
    finally:
        sampling.PARALLEL_ROWS = default_rows
    tokens = sum(len(run.token_ids) for run in runs)
    times = batch.times
    cycles = max(times.cycles, 1)
    seconds = times.to_dict()
    label = method + ("" if shared_costs else " (policies cost alone)")
    if noise_rows_shared_from is not None:
        label += f" (noise rows shared from {noise_rows_shared_from})"
    return {"method": label, "batch": size, "wall_s": round(wall, 3),
            "tokens": tokens, "tokens_per_s": round(tokens / wall, 1), "cycles": times.cycles,
            "mean_batch": round(times.sequences / cycles, 2), "rows_per_pass": round(times.rows / cycles, 2),
            "tokens_per_cycle": round(tokens / cycles, 2),
            "ms_per_cycle": {k: round(v * 1000 / cycles, 3) for k, v in seconds.items()},
            "rest_ms_per_cycle": round((wall - sum(seconds.values())) * 1000 / cycles, 3),
            "token_ids": [run.token_ids for run in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--methods", default="hybrid,ar,adaptive-pld")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--alone-costs", action="store_true",
                        help="also each method with its policies costing drafts as if alone (the batch's cut only)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--noise-rows-shared-from", default="",
                        help="also each method with its keyed draws shared among threads from these row counts")
    parser.add_argument("--out", type=Path, default=Path("results/cycle/batch_cycle.json"))
    args = parser.parse_args()

    target = load_model("smollm2-135m", dtype="auto")
    texts = [p.text for p in load_prompts("mt_bench")]
    prompts = [encode_prompt(target, texts[i % len(texts)]) for i in range(args.prompts)]
    sizes = [int(s) for s in args.sizes.split(",")]
    methods = args.methods.split(",")
    for method in methods:  # builds each method once (cost tables, the head) before any timing
        run_batch(target, method, prompts[:1], 1, 8)
    rows, solo = [], {}
    modifiers = LogitModifiers(presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)
    variants = [(m, True, None) for m in methods]
    variants += [(m, False, None) for m in methods if m != "ar"] if args.alone_costs else []
    variants += [(m, True, int(rows)) for rows in args.noise_rows_shared_from.split(",") if rows for m in methods]
    for size in sizes:
        for method, shared, noise_rows in variants:
            row = run_batch(target, method, prompts, size, args.max_new_tokens, shared, args.temperature, noise_rows,
                            args.top_k, args.top_p, modifiers)
            ids = row.pop("token_ids")
            solo.setdefault(method, ids)  # every variant's tokens against the method's B = 1 tokens
            row["every_text_its_solo_text"] = ids == solo[method]
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = [f"`python benchmarks/batch_cycle.py --sizes {args.sizes} --methods {args.methods} --prompts {args.prompts} "
             f"--max-new-tokens {args.max_new_tokens} --temperature {args.temperature:g}"
             f"{f' --top-k {args.top_k}' if args.top_k else ''}{f' --top-p {args.top_p:g}' if args.top_p < 1 else ''}"
             f"{f' --presence-penalty {args.presence_penalty:g}' if args.presence_penalty else ''}"
             f"{f' --frequency-penalty {args.frequency_penalty:g}' if args.frequency_penalty else ''}"
             f"{' --alone-costs' if args.alone_costs else ''}"
             f"{' --noise-rows-shared-from ' + args.noise_rows_shared_from if args.noise_rows_shared_from else ''}` "
             f"(MT-Bench first turns, seed 0):", "",
             "| method | B | tok/s | vs B=1 | mean batch | rows/pass | tokens/cycle | ms/cycle: draft | pass | verify | "
             "commit | rest | solo text |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        one = next(r for r in rows if r["method"] == row["method"] and r["batch"] == sizes[0])
        ms = row["ms_per_cycle"]
        lines.append(f"| `{row['method']}` | {row['batch']} | {row['tokens_per_s']} | "
                     f"{row['tokens_per_s'] / one['tokens_per_s']:.2f}× | {row['mean_batch']} | {row['rows_per_pass']} | "
                     f"{row['tokens_per_cycle']} | {ms['draft']} | {ms['pass']} | {ms['verify']} | {ms['commit']} | "
                     f"{row['rest_ms_per_cycle']} | {row['every_text_its_solo_text']} |")
    table = "\n".join(lines)
    print(table)
    atomic_write_text(args.out, json.dumps({"rows": rows, "table": table}, indent=2))


if __name__ == "__main__":
    main()
