"""One command that checks tierspec on a GPU: exactness of every lossless method, then a small bench.

    python benchmarks/gpu_check.py                          # CUDA, a few minutes → results/gpu_check/
    python benchmarks/gpu_check.py --device cpu --quick     # the same steps, shrunk, on the CPU (the test runs it)

1. Exactness: on one Spec-Bench prompt per category, the greedy output of every lossless method
   (every method whose rule is lossless at its default settings; ``self`` with the shipped
   r = 0.1 mask) must equal ``ar``'s token for token, in float32 and in bfloat16. Where one parts,
   the report gives the position, both tokens and the gap between their logits there (a gap of a
   few hundredths is a near-tie that rounding flipped; a large one is a bug).
2. A small bench through the bench runner (one prompt per category, greedy): ``ar``, ``hybrid``,
   ``eagle``, ``hf-greedy-stock``, ``hf-assisted-stock``.

It writes ``summary.md`` and ``summary.json`` under ``--out`` and the bench's own folder
(``bench/``: records, summary, plots), and exits 1 when any output parted from ``ar``'s. On a
machine whose torch sees no CUDA device it refuses (exit 2) unless ``--device cpu``; the CUDA run
needs a CUDA build of torch (the pinned one here is the CPU build).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tierspec.bench.report import markdown_table
from tierspec.bench.runner import BenchConfig, run_bench
from tierspec.data import load_prompts, select
from tierspec.decode import DecodeConfig, DecodeRun
from tierspec.errors import TierspecError
from tierspec.methods import MethodOptions, build_method, method_names
from tierspec.models import DEFAULT_MODEL, load_model
from tierspec.prompting import encode_prompt, eos_ids
from tierspec.layerskip.masks import RoutingMask
from tierspec.util import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
BENCH_METHODS = ("ar", "hybrid", "eagle", "hf-greedy-stock", "hf-assisted-stock")
SELF_MASK = ROOT / "masks" / "smollm2-135m-sublayer-r0.1.json"


@dataclass
class Divergence:
    """Where a method's greedy output first parted from ``ar``'s on one prompt."""

    prompt_id: str
    position: int  # index of the first differing new token
    ar_token: int | None  # None: that output ended there
    method_token: int | None
    logit_gap: float | None  # target logit of ar's token minus the method's, at that position (float32)


@dataclass
class ExactnessRow:
    dtype: str
    method: str
    prompts: int
    equal: int
    tokens_per_s: float
    divergences: list[Divergence]
    skipped: str | None = None  # why the method could not be built for this target


def describe_machine(device: torch.device) -> str:
    torch_line = f"torch {torch.__version__} ({torch.get_num_threads()} CPU threads)"
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return (f"{properties.name} ({properties.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}, {torch_line}, "
                f"Python {platform.python_version()}")
    return f"CPU ({platform.processor() or platform.machine()}), {torch_line}, Python {platform.python_version()}"


def method_options(target) -> MethodOptions:
    """Default options, plus the shipped routing mask for ``self`` where it fits the target."""
    try:
        return MethodOptions(mask=RoutingMask.load(SELF_MASK, target.identity))
    except TierspecError:  # made for another model (or missing): `self` is then reported as skipped
        return MethodOptions()


def lossless_methods(target, options: MethodOptions, only: list[str] | None) -> tuple[dict, dict[str, str]]:
    """The methods whose rule is lossless at these options (name → Method), and those that
    cannot be built for this target (name → why)."""
    built, skipped = {}, {}
    for name in only or method_names():
        try:
            method = build_method(name, target, None, options, strict=False)  # the options serve whichever uses them
        except TierspecError as error:
            skipped[name] = str(error)
            continue
        if method.rule.lossless:
            built[name] = method
    return built, skipped


def greedy_ids(target, method, prompt_ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], float]:
    """The method's greedy output ids and its wall seconds (the loop's results are on the host)."""
    config = DecodeConfig(max_new_tokens, eos_token_ids=eos_ids(target))
    run = DecodeRun(target, method, prompt_ids, config).finish()
    return run.token_ids, run.stats.wall_seconds


def divergence(target, prompt_id: str, prompt_ids: torch.Tensor, reference: list[int], output: list[int]) -> Divergence:
    """The first position where ``output`` parts from ``reference``, with the target's logit gap
    there computed by one uncached pass over the prompt and the common prefix."""
    position = next((i for i, (a, b) in enumerate(zip(reference, output)) if a != b), min(len(reference), len(output)))
    ar_token = reference[position] if position < len(reference) else None
    method_token = output[position] if position < len(output) else None
    gap = None
    if ar_token is not None and method_token is not None:
        ids = torch.cat([prompt_ids, torch.tensor(reference[:position], dtype=torch.long)]).to(target.device)
        with torch.inference_mode():
            logits = target.model(input_ids=ids[None]).logits[0, -1].float()
        gap = round(float(logits[ar_token] - logits[method_token]), 4)
    return Divergence(prompt_id, position, ar_token, method_token, gap)


def check_exactness(spec: str, device: str, dtype: str, prompts, max_new_tokens: int, only: list[str] | None,
                    log) -> list[ExactnessRow]:
    target = load_model(spec, dtype, device)
    options = method_options(target)
    methods, skipped = lossless_methods(target, options, only)
    encoded = {p.id: encode_prompt(target, p.text) for p in prompts}
    reference = {}
    for prompt in prompts:
        reference[prompt.id], _ = greedy_ids(target, methods["ar"], encoded[prompt.id], max_new_tokens)
    rows = []
    for name, method in methods.items():
        equal, emitted, seconds, parted = 0, 0, 0.0, []
        for prompt in prompts:
            output, elapsed = greedy_ids(target, method, encoded[prompt.id], max_new_tokens)
            emitted, seconds = emitted + len(output), seconds + elapsed
            if output == reference[prompt.id]:
                equal += 1
            else:
                parted.append(divergence(target, prompt.id, encoded[prompt.id], reference[prompt.id], output))
        row = ExactnessRow(dtype, name, len(prompts), equal, emitted / seconds if seconds else 0.0, parted)
        log(f"{dtype:9s} {name:14s} {equal}/{len(prompts)} equal to ar, {row.tokens_per_s:.1f} tok/s")
        rows.append(row)
    rows += [ExactnessRow(dtype, name, 0, 0, 0.0, [], why) for name, why in skipped.items()]
    return rows


def exactness_table(rows: list[ExactnessRow]) -> str:
    lines = ["| dtype | method | equal to `ar` | tok/s | first divergences (prompt: position, ar → method token, logit gap) |",
             "|---|---|---|---|---|"]
    for row in rows:
        if row.skipped:
            lines.append(f"| {row.dtype} | `{row.method}` | skipped | – | {row.skipped} |")
            continue
        parted = "; ".join(f"{d.prompt_id}: {d.position}, {d.ar_token} → {d.method_token}, "
                           f"{'–' if d.logit_gap is None else f'{d.logit_gap:.3f}'}" for d in row.divergences)
        lines.append(f"| {row.dtype} | `{row.method}` | {row.equal}/{row.prompts} | {row.tokens_per_s:.1f} | {parted or '–'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default; refused when torch sees none) or cpu")
    parser.add_argument("--target", default=DEFAULT_MODEL)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="dtypes of the exactness check")
    parser.add_argument("--methods", default=None,
                        help="lossless methods to check (comma-separated; default: every method lossless by default)")
    parser.add_argument("--bench-methods", default=",".join(BENCH_METHODS))
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per exactness generation")
    parser.add_argument("--bench-max-new-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true",
                        help="one prompt, 16 tokens, a one-prompt bench of 16 tokens: the smoke test of this script")
    parser.add_argument("--out", default=str(ROOT / "results" / "gpu_check"))
    args = parser.parse_args(argv)

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: this machine's torch sees no CUDA device (a CPU build, or no GPU); run it where one is, "
              "or smoke-test it here with --device cpu --quick", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    per_category, limit = (1, 1) if args.quick else (1, None)
    max_new = 16 if args.quick else args.max_new_tokens
    bench_new = 16 if args.quick else args.bench_max_new_tokens
    prompts = select(load_prompts("spec_bench"), per_category, limit)
    only = ["ar"] + [m for m in args.methods.split(",") if m and m != "ar"] if args.methods else None

    def log(line: str) -> None:
        print(f"gpu_check: {line}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    rows = []
    for dtype in [d for d in args.dtypes.split(",") if d]:
        rows += check_exactness(args.target, args.device, dtype, prompts, max_new, only, log)

    bench_config = BenchConfig(target=args.target, dtype="float32", device=args.device,
                               methods=tuple(m for m in args.bench_methods.split(",") if m), per_category=per_category,
                               limit=limit, max_new_tokens=bench_new, temperature=0.0)
    bench_out = out / "bench"
    log(f"bench of {', '.join(bench_config.methods)} into {bench_out}")
    bench = run_bench(bench_config, bench_out, progress=False)
    seconds = time.perf_counter() - started

    parted = [row for row in rows if not row.skipped and row.equal < row.prompts]
    command = "python benchmarks/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = [
        "# GPU check", "",
        f"`{command.strip()}` on {describe_machine(device)}; {seconds:.0f} s in all.", "",
        f"## Greedy exactness: every lossless method against `ar` ({len(prompts)} Spec-Bench prompt(s), {max_new} new tokens)", "",
        exactness_table(rows), "",
        ("All outputs equal `ar`'s." if not parted else
         f"**{len(parted)} method/dtype pair(s) parted from `ar`.** A logit gap of a few hundredths at the first "
         "divergence is a near-tie flipped by rounding that depends on the pass width; a large one is a bug."), "",
        f"## Bench ({'one prompt' if args.quick else 'one prompt per category'}, float32, greedy, {bench_new} new tokens)", "",
        markdown_table(bench),
    ]
    atomic_write_text(out / "summary.md", "\n".join(report))
    atomic_write_text(out / "summary.json", json.dumps({
        "command": command.strip(), "machine": describe_machine(device), "seconds": round(seconds, 1),
        "exactness": [asdict(row) for row in rows],
        "bench": {name: result["overall"] for name, result in bench["methods"].items()},
    }, indent=2))
    log(f"{'all equal to ar' if not parted else f'{len(parted)} method/dtype pair(s) parted from ar'}; "
        f"report in {out / 'summary.md'} ({seconds:.0f} s)")
    return 1 if parted else 0


if __name__ == "__main__":
    sys.exit(main())
