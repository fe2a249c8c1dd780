"""Cached passes of 1, 8 and 16 new rows (after 256 cached tokens) on GGUF files, tierspec beside
llama.cpp on the same file in the same run: the measurement behind issue 38's K-quant cells.

    PYTHONPATH=<checkout> python benchmarks/kquant_passes.py FILE_OR_KNOWN_MODEL ... [--rounds 3] [--dtypes auto,int8]

The ``tierspec`` timed is whichever one Python imports (run it once with an older checkout on
PYTHONPATH for the "before"). Each round times tierspec then llama.cpp (median of 5 passes each);
the medians over rounds are printed, in ms, with the engine's kernel report. Products over a few rows
run on the threads a generation settles for each model on this machine (``costs.few_row_threads``,
measured once and cached; printed as ``one_thread_rows``), or with ``--engine-default-threads`` on the
ISA's default (one thread for 1-2 rows on the AVX-512 paths).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pass_cost import time_passes  # noqa: E402
from scale import CONTEXT, LlamaCppPasses, tierspec_model  # noqa: E402

WIDTHS = (1, 8, 16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", default="auto", help="the engine's numerics, each timed (auto: --dtype auto's)")
    parser.add_argument("--engine-default-threads", action="store_true",
                        help="time few-row products on the ISA's default threads, not on those a generation settles "
                             "for the model on this machine (costs.few_row_threads)")
    args = parser.parse_args(argv)
    import tierspec
    from tierspec.cached_model import CachedModel
    from tierspec.costs import few_row_threads
    from tierspec.engine import kernel_report, threads_for
    from tierspec.models import wrap_model
    from tierspec.model_files import KNOWN_MODELS, known_model_file

    threads = torch.get_num_threads()
    print(f"tierspec from {Path(tierspec.__file__).parent.parent}; {kernel_report()}; {threads} threads", flush=True)
    dtypes = args.dtypes.split(",")
    for spec in args.files:
        path = known_model_file(spec) if spec in KNOWN_MODELS else Path(spec)
        models = {f"tierspec {dtype}": tierspec_model(path, dtype) for dtype in dtypes}
        settled = {}
        if not args.engine_default_threads:  # the threads a generation's products over a few rows run on
            for who, model in models.items():
                found = few_row_threads(wrap_model(model, name=f"{path.stem} ({who})"))
                settled[who] = None if found is None else found.one_thread_rows
        runners = {who: CachedModel(model) for who, model in models.items()}
        llama = LlamaCppPasses(path, threads)
        context = [int(t) for t in torch.arange(CONTEXT) % llama.vocab]
        runs: dict[str, list[dict]] = {**{who: [] for who in runners}, "llama.cpp": []}
        with torch.inference_mode(), threads_for(next(iter(models.values()))):
            for runner in runners.values():
                runner.forward(torch.tensor(context), logits_for=1)
            llama._rollback(0)
            llama.llama.eval(context)
            for _ in range(args.rounds):
                for who, runner in runners.items():
                    runs[who].append(time_passes(runner, CONTEXT, WIDTHS, 5))
                runs["llama.cpp"].append({k: llama._timed([int(t) for t in (torch.arange(k) * 7 + 11) % llama.vocab],
                                                          CONTEXT, 5) for k in WIDTHS})
        row = {who: {k: round(1e3 * statistics.median(run[k] for run in got), 2) for k in WIDTHS}
               for who, got in runs.items()}
        stacked = {who: getattr(model.model, "engine_stack", None) is not None for who, model in models.items()}
        print(json.dumps({"file": path.name, "engine_stack": stacked, "one_thread_rows": settled, "ms": row}), flush=True)
        del models, runners, llama
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
