"""The cost of tierspec.grammar's state operations on the default model's vocabulary (49,152
tokens), along the JSON-extraction set's schemas: the first grammar per tokenizer (the
tokenizer's one-off set-up), a compile, ``allowed`` (mask → bool [V]), ``mask_logits`` on one
row, ``forced``, advance + rollback of a 4-token draft, and ``draft_masks`` of 4 sequences × 5
rows in one call. Each task's schema is walked by taking, at each step, the forced token or
else the lowest allowed id (deterministic, always valid, no model needed).

    PYTHONPATH=. flock -x /tmp/tierspec-cpu.lock python benchmarks/grammar_costs.py [--out FILE] [--tasks N]

Writes results/grammar_bakeoff/state_costs.md (``--out``: elsewhere; ``--tasks``: the first N
tasks only, a smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from tierspec.bench.json_extract import load_tasks
from tierspec.costs import _cpu_name
from tierspec.gguf_cache import converted_copy
from tierspec.grammar import GrammarSpec, compile_grammar, draft_masks, mask_logits
from tierspec.models import default_model_file
from tierspec.tokenizer import FastTokenizer

OUT = Path(__file__).resolve().parent.parent / "results" / "grammar_bakeoff" / "state_costs.md"
STEPS = 120


def us(seconds: list[float]) -> str:
    return f"{1e6 * statistics.fmean(seconds):.0f} (max {1e6 * max(seconds):.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--tasks", type=int, default=None, help="the first N tasks only (default: all 52)")
    args = parser.parse_args()
    tokenizer = FastTokenizer(converted_copy(default_model_file()))
    vocab, eos = len(tokenizer), [tokenizer.eos_token_id]
    tasks = load_tasks()[: args.tasks]
    start = time.perf_counter()
    compile_grammar(GrammarSpec.json_object(), tokenizer, vocab, eos)
    first = time.perf_counter() - start
    costs = {name: [] for name in ("compile", "allowed", "mask_logits", "forced", "advance+rollback 4", "draft_masks 4x5")}
    logits = torch.randn(1, vocab)
    forced_tokens = walked = 0
    for task in tasks:
        start = time.perf_counter()
        compiled = compile_grammar(GrammarSpec.json_schema(task.schema), tokenizer, vocab, eos)
        costs["compile"].append(time.perf_counter() - start)
        state = compiled.new_state()
        path = []
        for _ in range(STEPS):
            start = time.perf_counter()
            allowed = state.allowed()
            costs["allowed"].append(time.perf_counter() - start)
            start = time.perf_counter()
            mask_logits(logits, allowed[None])
            costs["mask_logits"].append(time.perf_counter() - start)
            start = time.perf_counter()
            forced = state.forced()
            costs["forced"].append(time.perf_counter() - start)
            if forced and forced[0] in eos or state.finished():
                break
            token = forced[0] if forced else int(torch.nonzero(allowed)[0])
            forced_tokens += bool(forced)
            walked += 1
            path.append(token)
            state.advance([token])
        # drafts: the last 4 tokens of the walk, from 4 copies at different points
        states, drafts = [], []
        for back in (4, 8, 12, 16):
            if len(path) > back:
                copy = state.copy()
                copy.rollback(back)
                states.append(copy)
                drafts.append(path[len(path) - back:len(path) - back + 4])
        for copy, draft in zip(states, drafts):
            start = time.perf_counter()
            copy.advance(draft)
            copy.rollback(len(draft))
            costs["advance+rollback 4"].append(time.perf_counter() - start)
        if states:
            start = time.perf_counter()
            draft_masks(states, drafts)
            costs["draft_masks 4x5"].append(time.perf_counter() - start)
    lines = ["# tierspec.grammar's state costs on the default model's vocabulary (49,152 tokens)", "",
             "Command: `PYTHONPATH=. flock -x /tmp/tierspec-cpu.lock python benchmarks/grammar_costs.py` "
             f"({_cpu_name()}, {torch.get_num_threads()} threads); {len(tasks)} JSON-extraction tasks' schemas, each "
             f"walked up to {STEPS} tokens.", "",
             f"First grammar of a tokenizer (its llguidance tokenizer built once, then cached): {1e3 * first:.0f} ms.", "",
             f"Forced positions on the walk: {forced_tokens} of {walked} tokens ({100 * forced_tokens / max(walked, 1):.0f}%).",
             "", "| operation | µs mean (max) | calls |", "|---|---|---|"]
    lines += [f"| {name} | {us(values)} | {len(values)} |" for name, values in costs.items() if values]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    staging = args.out.with_name(args.out.name + ".tmp")
    staging.write_text("\n".join(lines) + "\n")
    staging.replace(args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
