"""What a sampled token costs under top-k and top-p: the filtered keyed draw of a target's rows
(``sampling.keyed_allowed_tokens``) by finding each row's allowed tokens and drawing among them, against
checking the row's unfiltered draw (``sampling.surely_allowed``), with the draw made here or given as a
pass makes it (``cached_model.RowDraws``), and the rows the check leaves under top-k found from their k largest
logits (``sampling._plain_top_k_allowed``) or the nucleus's way — the same tokens, row by row.

    python benchmarks/filtered_draws.py [--prompts 8] [--tokens 64] [--filters 1/p0.95,0.7/k40/p0.9,1/k40,0.8/p0.9]
                                        [--rows 1,4,13] [--out results/filtered_draws.json]

Rows: ``--prompts`` MT-Bench prompts answered by ``ar`` at temperature 1 (seeds 0, 1, …), each prompt
and answer run teacher-forced through the default model; every answer position's logits row is kept
(the rows a verifier pass scores). Per filter (``T/kK/pP``, as ``loop_time.py`` reads them) and
group size (rows drawn in one call, as a batch's walk draws one depth of all its sequences), each way
draws every row under its own key, and the medians of three sweeps are reported in microseconds a row,
with the share of rows the check settles (the others go the nucleus's way too). Every way's tokens
are compared with the nucleus's: a difference is an error, not a number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

from tierspec import api, sampling
from tierspec.data import load_prompts
from tierspec.prompting import encode_prompt
from tierspec.sampling import Noise, SamplingConfig, keyed_allowed_tokens, keyed_tokens
from tierspec.util import atomic_write_text

from loop_time import sampling_setting  # (the script's folder is on the path: ``T/kK/pP`` as loop_time reads it)


def target_rows(prompts: int, tokens: int) -> torch.Tensor:
    """[n, V] float32: the default model's logits at every answer position of ``ar``'s answers at
    temperature 1 to the first ``prompts`` MT-Bench prompts."""
    target = api.shared_model()
    rows = []
    for seed, prompt in enumerate(load_prompts("mt_bench")[:prompts]):
        ids = torch.as_tensor(encode_prompt(target, prompt.text)).flatten()
        answer = api.generate(ids, target=target, method="ar", max_new_tokens=tokens, temperature=1.0, seed=seed)
        full = torch.cat([ids, torch.tensor(answer.token_ids, dtype=torch.long)])
        with torch.inference_mode():
            logits = target.model(full[None]).logits[0].float()
        rows.append(logits[len(ids) - 1 : len(full) - 1])
    return torch.cat(rows).contiguous()


def sweep(rows: torch.Tensor, config: SamplingConfig, group: int, way: str) -> tuple[float, list[int], int]:
    """(seconds, tokens, rows the check settled) for every row drawn ``group`` rows a call, ``way``:
    ``nucleus`` (every row's allowed tokens found, then drawn among), ``check`` (the unfiltered draw made
    here, then checked), ``pass draw`` (the unfiltered draw given, as a pass makes it), ``pass draw, nucleus
    after`` (the same, the rows it leaves finding their allowed tokens the nucleus's way — as before
    ``sampling._plain_top_k_allowed``, which ``nucleus`` never uses either). Since that function, ``check``
    and ``pass draw`` under top-k include it: their columns in files made before it are stop 71's way."""
    noise = Noise(11, rows.shape[-1])
    keys = [noise.key(position) for position in range(len(rows))]
    given = None
    if way.startswith("pass draw"):
        scaled = rows if config.temperature == 1.0 else rows / config.temperature
        given = keyed_tokens(scaled, keys)
    settled = 0
    real = sampling.surely_allowed

    def counted(*args):
        nonlocal settled
        sure = real(*args)
        settled += sum(sure)
        return sure

    tokens: list[int] = []
    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(sampling, "surely_allowed", counted))
        if way == "nucleus":  # no unfiltered draw: every row's allowed tokens found, as before the check
            patches.enter_context(mock.patch.object(sampling, "_unfiltered_draws", lambda *args: None))
        if way in ("nucleus", "pass draw, nucleus after"):
            patches.enter_context(mock.patch.object(sampling, "_plain_top_k_allowed", lambda *args: None))
        started = time.perf_counter()
        for first in range(0, len(rows), group):
            which = list(range(first, min(first + group, len(rows))))
            tokens += keyed_allowed_tokens(rows, config, keys[which[0] : which[-1] + 1], which,
                                           None if given is None else given[which[0] : which[-1] + 1])
        seconds = time.perf_counter() - started
    return seconds, tokens, settled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--filters", default="1/p0.95,0.7/k40/p0.9,1/k40,0.8/p0.9")
    parser.add_argument("--rows", default="1,4,13", help="rows drawn in one call")
    parser.add_argument("--out", type=Path, default=Path("results/filtered_draws.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = target_rows(args.prompts, args.tokens)
    print(f"{len(rows)} rows of {rows.shape[-1]} logits", flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown") if Path("/proc/cpuinfo").exists() else "unknown"
    report = {"rows": len(rows), "threads": torch.get_num_threads(), "cpu": cpu,
              "noise_loop": ["plain", "AVX2", "AVX-512"][sampling._NOISE_LOOP], "results": []}
    lines = ["| filter | rows a call | nucleus µs/row | check µs/row | pass draw, nucleus after µs/row | "
             "pass draw µs/row | settled by the check |", "|---|---|---|---|---|---|---|"]
    for text in args.filters.split(","):
        config = SamplingConfig(*sampling_setting(text))
        for group in (int(g) for g in args.rows.split(",")):
            times: dict[str, list[float]] = {"nucleus": [], "check": [], "pass draw, nucleus after": [], "pass draw": []}
            reference, settled = None, 0
            for _ in range(3):
                for way in times:
                    seconds, tokens, count = sweep(rows, config, group, way)
                    times[way].append(seconds / len(rows) * 1e6)
                    if reference is None:
                        reference = tokens
                    elif tokens != reference:
                        raise SystemExit(f"{text}, {group} rows a call: {way} drew other tokens than the nucleus")
                    settled = max(settled, count)
            us = {way: round(statistics.median(values), 1) for way, values in times.items()}
            report["results"].append({"filter": text, "rows_per_call": group, "us_per_row": us,
                                      "settled": round(settled / len(rows), 4)})
            lines.append(f"| {text} | {group} | {us['nucleus']} | {us['check']} | {us['pass draw, nucleus after']} | "
                         f"{us['pass draw']} | "
                         f"{settled / len(rows):.1%} |")
            print(lines[-1], flush=True)
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(report, indent=1) + "\n")
    atomic_write_text(args.out.with_suffix(".md"), "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
