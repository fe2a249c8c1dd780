"""How close the pass engine's text is to the file's model: greedy `ar` on the engine (its default
numerics for this CPU, and int8, bfloat16 and float32 rows) against greedy `ar` on the float32
de-quantised model, with llama.cpp and OpenVINO GenAI on the same file beside them.

    python benchmarks/engine_fidelity.py [--prompts 72] [--max-new-tokens 128] [--dtypes auto,int8,bfloat16,float32]
                                         [--out results/engine_fidelity]

Every text is scored by the float32 de-quantised model (the GGUF's values in float32, torch's
operators: ``load_model(dtype="float32", kernels="packed")``): the mean negative log-likelihood per
generated token, which the targets compare (the default within +4% of the reference's own `ar`,
float32 rows +0.00%). Also: the share of prompts whose text equals the reference's, and where the first token
differs. Greedy texts part at the first near-tie and then score different texts, so that column
moves by several points with the prompts (its 95% bootstrap interval over prompts is shown); the engine's own error is read without that noise by
teacher forcing: each engine model reads the reference's text in one cached pass (its attention over its
own cache, float16 under auto; runs before 2026-12-04 used an uncached pass, torch's attention over float32
keys: their KL measured the products alone), and its next-token distributions
are compared with the reference's at every generated position (mean KL(reference ‖ engine) in
nats, and how often the two argmaxes agree). Prompts: MT-Bench first turns and GSM8K test questions (neither tunes anything here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import tierspec
from tierspec.cached_model import CachedModel
from tierspec.bench.metrics import target_nll
from tierspec.data import load_prompts
from tierspec.prompting import encode_prompt, eos_ids


def prompts(count: int) -> list[str]:
    texts = [p.text for p in load_prompts("mt_bench")][: count // 2]
    texts += [p.text for p in load_prompts("gsm8k")][: count - len(texts)]
    return texts


def llama_cpp_greedy(path: Path, ids: list[int], budget: int, eos: set[int]) -> list[int]:
    from llama_cpp import Llama

    llama = getattr(llama_cpp_greedy, "model", None)
    if llama is None:
        llama = llama_cpp_greedy.model = Llama(str(path), n_ctx=2048, n_threads=torch.get_num_threads(), verbose=False)
    llama.reset()
    out = []
    for token in llama.generate(ids, temp=0.0, reset=True, repeat_penalty=1.0, top_k=1):
        out.append(int(token))
        if out[-1] in eos or len(out) >= budget:
            break
    return out


def openvino_greedy(path: Path, ids: list[int], budget: int, eos: set[int]) -> list[int]:
    import numpy as np
    import openvino
    import openvino_genai

    pipeline = getattr(openvino_greedy, "pipeline", None)
    if pipeline is None:
        pipeline = openvino_greedy.pipeline = openvino_genai.LLMPipeline(
            str(path), "CPU", INFERENCE_NUM_THREADS=torch.get_num_threads())
    array = np.asarray([ids], dtype=np.int64)
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens, config.do_sample, config.stop_token_ids = budget, False, eos
    result = pipeline.generate(openvino_genai.TokenizedInputs(openvino.Tensor(array), openvino.Tensor(np.ones_like(array))),
                               config)
    tokens = [int(t) for t in result.tokens[0]][:budget]
    return next((tokens[: i + 1] for i, t in enumerate(tokens) if t in eos), tokens)


def teacher_forced(reference, engines: dict, ids: torch.Tensor, base: list[int]) -> dict[str, dict]:
    """Each engine model's next-token distributions on the reference's own text ``base`` against the
    reference's: mean KL(reference ‖ engine) per generated position and the share of positions
    whose argmaxes agree (module docstring)."""
    if not base:
        return {}
    full = torch.cat([ids, torch.tensor(base, dtype=torch.long)])[None]
    keep = len(base)

    def logprobs(model) -> torch.Tensor:  # [n, V] at the positions that predicted each generated token
        # one cached pass, as generation computes (an uncached one would run torch's attention over
        # fresh float32 keys, never the engine's attention over its cache)
        with torch.inference_mode():
            return CachedModel(model.model).forward(full[0], logits_for=keep + 1).logits[:-1].float().log_softmax(-1)

    expected = logprobs(reference)
    result = {}
    for name, model in engines.items():
        got = logprobs(model)
        result[name] = {"kl": float((expected.exp() * (expected - got)).sum(-1).mean()),
                        "same_argmax": float((expected.argmax(-1) == got.argmax(-1)).float().mean())}
    return result


def relative_interval(records: list[dict], reference: list[dict], resamples: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval (percent) of mean NLL / the reference's mean NLL − 1, prompts
    resampled in pairs (seeded: the same records give the same interval). How far the column can
    move with the prompts: greedy texts part at near-ties, so a few prompts carry much of it."""
    import random

    pairs = [(r["nll"], b["nll"]) for r, b in zip(records, reference)]
    draw = random.Random(0)
    ratios = []
    for _ in range(resamples):
        sample = [pairs[draw.randrange(len(pairs))] for _ in pairs]
        ratios.append(100 * (sum(a for a, _ in sample) / sum(b for _, b in sample) - 1))
    ratios.sort()
    return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def forced_column(records: list[dict], key: str, form: str) -> str:
    values = [r[key] for r in records if key in r]
    return format(statistics.mean(values), form) if values else "–"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=72,
                        help="prompts (half MT-Bench, half GSM8K): on 24 the NLL column's 95%% interval spans ~15 points")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("results/engine_fidelity"))
    parser.add_argument("--peers", action="store_true", help="also llama.cpp and OpenVINO GenAI on the same file")
    parser.add_argument("--dtypes", default="auto,int8,bfloat16,float32",
                        help="the engine's numerics to run (comma-separated; auto: the default numerics, float16 "
                             "KV caches with them, where a dtype named keeps float32 caches)")
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    unknown = sorted(set(dtypes) - {"auto", "int8", "bfloat16", "float32"})
    if unknown:
        parser.error(f"--dtypes takes auto, int8, bfloat16 and float32, not {', '.join(unknown)}")
    reference = tierspec.load_model("smollm2-135m", dtype="float32", kernels="packed")
    default = tierspec.load_model("smollm2-135m", dtype="auto").model.model.embed_tokens.qweight.numerics
    engines = {}
    for dtype in dtypes:  # auto's row (or the one whose numerics are auto's) says it is the default
        model = tierspec.load_model("smollm2-135m", dtype=dtype, kernels="gguf")
        numerics = model.model.model.embed_tokens.qweight.numerics
        engines[f"engine {dtype}" + (" (the default here)" if numerics == default else "")
                + f": {numerics.description}"] = model
    from tierspec.models import default_model_file

    gguf = default_model_file()
    eos = set(eos_ids(reference))
    texts = prompts(args.prompts)
    rows: dict[str, list[dict]] = {name: [] for name in ["reference float32 (torch)", *engines]
                                   + (["llama.cpp greedy", "OpenVINO GenAI greedy"] if args.peers else [])}
    for index, text in enumerate(texts):
        ids = encode_prompt(reference, text)
        outputs = {"reference float32 (torch)": tierspec.generate(ids, target=reference, method="ar",
                                                                  max_new_tokens=args.max_new_tokens).token_ids}
        for name, model in engines.items():
            outputs[name] = tierspec.generate(ids, target=model, method="ar", max_new_tokens=args.max_new_tokens).token_ids
        if args.peers:
            outputs["llama.cpp greedy"] = llama_cpp_greedy(gguf, ids.tolist(), args.max_new_tokens, eos)
            outputs["OpenVINO GenAI greedy"] = openvino_greedy(gguf, ids.tolist(), args.max_new_tokens, eos)
        base = outputs["reference float32 (torch)"]
        forced = teacher_forced(reference, engines, ids, base)
        for name, tokens in outputs.items():
            parted = next((i for i, (a, b) in enumerate(zip(tokens, base)) if a != b),
                          None if len(tokens) == len(base) else min(len(tokens), len(base)))
            rows[name].append({"nll": target_nll(reference.model, ids, tokens), "same": tokens == base,
                               "parted_at": parted, "tokens": len(tokens), **forced.get(name, {})})
        print(f"prompt {index + 1}/{len(texts)}", file=sys.stderr, flush=True)
    reference_nll = statistics.mean(r["nll"] for r in rows["reference float32 (torch)"])
    lines = [f"Greedy `ar`, {len(texts)} prompts (MT-Bench first turns and GSM8K test questions), "
             f"{args.max_new_tokens} new tokens, {torch.get_num_threads()} threads; every text scored by the float32 "
             "de-quantised model (the file's values, torch's operators):", "",
             "| model | mean NLL per token | vs the reference's own (95% interval over prompts) | same text "
             "| first token parted (median, when parted) "
             "| KL to the reference, teacher-forced (nats/token) | same argmax, teacher-forced |",
             "|---|---|---|---|---|---|---|"]
    for name, records in rows.items():
        nll = statistics.mean(r["nll"] for r in records)
        parted = [r["parted_at"] for r in records if not r["same"] and r["parted_at"] is not None]
        low, high = relative_interval(records, rows["reference float32 (torch)"])
        lines.append(f"| {name} | {nll:.4f} | {100 * (nll / reference_nll - 1):+.2f}% ({low:+.2f}% .. {high:+.2f}%) | "
                     f"{sum(r['same'] for r in records)}/{len(records)} | "
                     f"{statistics.median(parted) if parted else '–'} | {forced_column(records, 'kl', '.5f')} | "
                     f"{forced_column(records, 'same_argmax', '.4f')} |")
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.md").write_text(text + "\n")
    (args.out / "records.json").write_text(json.dumps(rows, indent=1))
    if getattr(llama_cpp_greedy, "model", None) is not None:
        llama_cpp_greedy.model.close()  # before the interpreter's teardown, which its destructor trips over


if __name__ == "__main__":
    main()
