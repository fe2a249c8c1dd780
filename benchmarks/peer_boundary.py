"""What running a bench peer in a worker process of its own changes (issue 40, item 3).

The llama.cpp peer (``llamacpp-greedy``) on the default model, built twice in one run: in this
process (as the bench ran it before) and in a worker process (``peer_process.PeerProcess``, as it
runs now), fed the same prompts' token ids, the two interleaved prompt by prompt and repeated.
Per generation: the peer's own clock (prompt in to last token out, measured where the peer runs),
tokens per second, and for the worker the round trip the boundary adds outside that clock (the
parent's wall time of the call less the worker's clock). The two must give the same tokens.

    flock -x /tmp/tierspec-cpu.lock python benchmarks/peer_boundary.py [--prompts 6] [--tokens 64] [--repeats 3]

Writes results/peer_workers/boundary.json and .md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from tierspec.bench.llamacpp import LlamaCppPeer
from tierspec.bench.peer_process import PeerProcess, PeerSpec
from tierspec.bench.runner import PEER_FACTORIES
from tierspec.data import load_prompts
from tierspec.models import load_model
from tierspec.prompting import encode_prompt, eos_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="results/peer_workers")
    args = parser.parse_args()
    target = load_model("smollm2-135m", dtype="auto")
    eos = tuple(sorted(eos_ids(target)))
    threads = torch.get_num_threads()
    name = "llamacpp-greedy"
    started = time.perf_counter()
    here = LlamaCppPeer(name, {}, "smollm2-135m", target.vocab_size, eos, 0.0, 0, 1.0, threads)
    load_here = time.perf_counter() - started
    started = time.perf_counter()
    worker = PeerProcess(PeerSpec(PEER_FACTORIES[name], name, {}, "smollm2-135m", target.vocab_size, eos, 0.0, 0, 1.0,
                                  threads), "cpu", run_seed=0)
    start_worker = time.perf_counter() - started
    prompts = [encode_prompt(target, p.text) for p in load_prompts("spec_bench")[: args.prompts]]
    for ids in prompts[:1]:  # warm-up, both
        here.run(ids.tolist(), 8, None)
        worker.run(ids, 8, None)
    rows = []
    for repeat in range(args.repeats):
        for i, ids in enumerate(prompts):
            order = ("here", "worker") if (i + repeat) % 2 == 0 else ("worker", "here")
            result = {}
            for side in order:
                called = time.perf_counter()
                outcome = here.run(ids.tolist(), args.tokens, None) if side == "here" else worker.run(ids, args.tokens, None)
                wall = time.perf_counter() - called
                result[side] = {"tokens": outcome.token_ids, "seconds": outcome.seconds,
                                "tokens_per_s": len(outcome.token_ids) / outcome.seconds,
                                "round_trip": outcome.record_fields.get("worker_round_trip_seconds", wall - outcome.seconds)}
            assert result["here"]["tokens"] == result["worker"]["tokens"], f"prompt {i}: the two gave other tokens"
            rows.append({"prompt": i, "repeat": repeat, "emitted": len(result["here"]["tokens"]),
                         **{f"{side}_{key}": value for side in ("here", "worker")
                            for key, value in result[side].items() if key != "tokens"}})
    worker.close()
    here.close()
    median = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    summary = {"command": "flock -x /tmp/tierspec-cpu.lock python benchmarks/peer_boundary.py "
                          f"--prompts {args.prompts} --tokens {args.tokens} --repeats {args.repeats}",
               "cpu": platform.processor() or platform.machine(), "threads": threads, "generations": len(rows),
               "in_process_tokens_per_s_median": round(median("here_tokens_per_s"), 2),
               "worker_tokens_per_s_median": round(median("worker_tokens_per_s"), 2),
               "ratio_worker_to_in_process": round(median("worker_tokens_per_s") / median("here_tokens_per_s"), 4),
               "worker_round_trip_ms_median": round(1000 * median("worker_round_trip"), 3),
               "worker_round_trip_ms_max": round(1000 * max(r["worker_round_trip"] for r in rows), 3),
               "model_load_in_process_s": round(load_here, 2), "worker_start_and_load_s": round(start_worker, 2),
               "same_tokens": True, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "boundary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "boundary.md").write_text(
        "# llama.cpp peer: in the bench's process vs a worker process\n\n"
        f"`{summary['command']}` ({summary['cpu']}, {threads} threads)\n\n"
        f"{len(rows)} generations of up to {args.tokens} tokens, the same tokens on both sides. Median tok/s by the "
        f"peer's own clock: in process {summary['in_process_tokens_per_s_median']}, worker "
        f"{summary['worker_tokens_per_s_median']} (ratio {summary['ratio_worker_to_in_process']}). The boundary adds "
        f"{summary['worker_round_trip_ms_median']} ms per generation outside the clock (median; max "
        f"{summary['worker_round_trip_ms_max']} ms). Starting the worker and loading the model: "
        f"{summary['worker_start_and_load_s']} s (in process: {summary['model_load_in_process_s']} s), once per run.\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()
