"""Pass costs at real model sizes, measured on random-weight GGUF files of real shapes, beside
llama.cpp on the same files in the same run, with the bytes-over-bandwidth floor of the machine.

    python benchmarks/scale.py [--models qwen2.5-0.5b,qwen3-0.6b,llama-3.2-1b,qwen2.5-1.5b,phi-3-mini,llama-3.1-8b]
                               [--mixes Q8_0,Q4_K_M] [--rounds 3] [--no-llamacpp] [--out results/scale]

Files: written once under ``$TIERSPEC_CACHE/scale`` (default ~/.cache/tierspec/scale), each to a
temporary name and renamed when complete (an interrupted run leaves no partial file; a rerun writes
only the files still missing). Weights are random valid blocks (a random byte pool with finite
fp16 scales), laid out as llama.cpp lays out its files of that mix: Q8_0 = every matrix Q8_0;
Q4_K_M = Q4_K, with attn_v and ffn_down Q6_K in llama.cpp's "more bits" layers (the first and last
eighth and every third between), the LM head (or a tied embedding) Q6_K, and a matrix whose rows are
not whole 256-value super-blocks in Q5_0 / Q8_0 instead of Q4_K / Q6_K (Qwen2.5's 896 and 1536).
Norms are F32 ones (Qwen3's q/k norms too), Qwen2's q/k/v biases F32 zeros; Phi-3's fused q/k/v and
gate/up tensors as its files hold them (q/k/v Q5_K in the "more bits" layers).

Per file (context: 256 cached tokens; medians over ``--rounds``, tierspec and llama.cpp interleaved):
the pass of 1, 2, 4, 8, 16 new rows; a 512-token prefill; the slim verifier's pass (1 and 6 rows: a
γ = 5 block) under random sub-layer masks bypassing 10 / 25 / 45% of the units. The floor: the
bytes a pass must read (the file's weight bytes) over the machine's streaming read bandwidth,
measured by summing a 1 GiB buffer as int64 on the run's threads (best of 5); each pass is printed
as a multiple of it. Memory: a file whose model would not fit in the memory available is refused
before loading (``gguf_model.refuse_if_too_large``), with the sizes, and the run goes on.

Then the cost model: per emitted token, cost = target calls × full pass (6 rows) + slim calls × slim
pass (6 rows) + drafter calls × draft step, with the calls per token of `eagle` (plain speculative
decoding with the draft head), `via` (r = 0.1 and 0.45) and `judge` as measured on the default model
(results/engine_via_judge/summary.json) and the draft step as the same share of a one-row pass as
measured there. Acceptance and tier fractions at these sizes are NOT measured (no model of the
default's tokenizer exists at these sizes offline): the predictions assume the default model's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pass_cost import median_seconds, time_passes  # noqa: E402  (the same pass timing as pass_cost.py)

WRITER_VERSION = 2  # in the file names: a change to the writer writes new files, never misreads old ones
WIDTHS = (1, 2, 4, 8, 16)
MASK_RATIOS = (0.1, 0.25, 0.45)
CONTEXT = 256


@dataclass(frozen=True)
class Shape:
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    theta: float
    head_dim: int | None = None  # None: hidden / heads (Qwen3's heads are 128 wide whatever the hidden size)

    @property
    def head_width(self) -> int:
        return self.head_dim or self.hidden // self.heads


SHAPES = {  # the published configs' shapes
    "qwen2.5-0.5b": Shape("qwen2", 896, 24, 14, 2, 4864, 151936, True, 1e6),
    "qwen3-0.6b": Shape("qwen3", 1024, 28, 16, 8, 3072, 151936, True, 1e6, head_dim=128),  # q/k norms
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 128256, True, 5e5),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960, 151936, True, 1e6),
    "phi-3-mini": Shape("phi3", 3072, 32, 32, 32, 8192, 32064, False, 1e4),  # fused qkv and gate/up
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128256, False, 5e5),
}


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's layers that get more bits in a _M mix."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _fallback(kind: str, width: int) -> str:
    """llama.cpp's substitute where rows are not whole 256-value super-blocks."""
    return {"Q4_K": "Q5_0", "Q5_K": "Q5_0", "Q6_K": "Q8_0"}.get(kind, kind) if width % 256 else kind


def tensor_layout(shape: Shape, mix: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape [rows, row length] or [n], ggml type name) of every tensor of the file."""
    H, d = shape.hidden, shape.head_width
    q, kv, inter = shape.heads * d, shape.kv_heads * d, shape.intermediate

    def kind(base: str, width: int) -> str:
        return "Q8_0" if mix == "Q8_0" else _fallback(base, width)

    out = [("token_embd.weight", (shape.vocab, H), kind("Q6_K" if shape.tied else "Q4_K", H))]
    for i in range(shape.layers):
        p = f"blk.{i}."
        more = _more_bits(i, shape.layers)
        out += [(p + "attn_norm.weight", (H,), "F32"), (p + "ffn_norm.weight", (H,), "F32")]
        if shape.arch == "phi3":  # one q/k/v tensor and one gate/up tensor (llama.cpp: Q5_K where _M gives more bits)
            out += [(p + "attn_qkv.weight", (q + 2 * kv, H), kind("Q5_K" if more else "Q4_K", H)),
                    (p + "ffn_up.weight", (2 * inter, H), kind("Q4_K", H))]
        else:
            out += [(p + "attn_q.weight", (q, H), kind("Q4_K", H)), (p + "attn_k.weight", (kv, H), kind("Q4_K", H)),
                    (p + "attn_v.weight", (kv, H), kind("Q6_K" if more else "Q4_K", H)),
                    (p + "ffn_gate.weight", (inter, H), kind("Q4_K", H)), (p + "ffn_up.weight", (inter, H), kind("Q4_K", H))]
        out += [(p + "attn_output.weight", (H, q), kind("Q4_K", q)),
                (p + "ffn_down.weight", (H, inter), kind("Q6_K" if more else "Q4_K", inter))]
        if shape.arch == "qwen3":
            out += [(p + "attn_q_norm.weight", (d,), "F32"), (p + "attn_k_norm.weight", (d,), "F32")]
        if shape.arch == "qwen2":
            out += [(p + "attn_q.bias", (q,), "F32"), (p + "attn_k.bias", (kv,), "F32"), (p + "attn_v.bias", (kv,), "F32")]
    out.append(("output_norm.weight", (H,), "F32"))
    if not shape.tied:
        out.append(("output.weight", (shape.vocab, H), kind("Q6_K", H)))
    return out


# where each block type keeps its fp16 scale(s), and the scale that keeps weights near 1/sqrt(K)
_SCALE_AT = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
_LEVELS = {"Q8_0": 127, "Q4_0": 8, "Q5_0": 16, "Q4_K": 63 * 15, "Q5_K": 63 * 31, "Q6_K": 128 * 32}


def random_blocks(kind: str, rows: int, width: int, pool: np.ndarray) -> np.ndarray:
    """uint8 [rows, bytes per row] of valid ``kind`` blocks: the random ``pool`` tiled, every fp16
    scale then set to a finite value."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    values, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    blocks = rows * (width // values)
    data = np.resize(pool, blocks * size).reshape(blocks, size)
    scale = np.array([2.0 / np.sqrt(width) / _LEVELS[kind]], dtype=np.float16).view(np.uint8)
    for at in _SCALE_AT[kind]:
        data[:, at : at + 2] = scale
    return data.reshape(rows, -1)


def file_path(name: str, mix: str) -> Path:
    from tierspec.util import cache_root

    return cache_root() / "scale" / f"{name}-{mix}-v{WRITER_VERSION}.gguf"


def write_file(name: str, mix: str) -> Path:
    """The random-weight file of ``name`` in ``mix``, written once, atomically."""
    from gguf import GGMLQuantizationType, GGUFWriter

    path = file_path(name, mix)
    if path.exists():
        return path
    shape = SHAPES[name]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + f".partial-{os.getpid()}")
    layout = tensor_layout(shape, mix)
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 256, size=(1 << 24) + 7, dtype=np.uint8)  # 16 MiB, an odd length: tiles do not repeat by row
    writer = GGUFWriter(str(partial), shape.arch)
    writer.add_name(f"random {name}")
    writer.add_block_count(shape.layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    if shape.head_dim is not None:  # heads not hidden / heads wide (the older files' header is unchanged)
        writer.add_key_length(shape.head_width)
        writer.add_value_length(shape.head_width)
    if shape.arch == "phi3":
        writer.add_rope_dimension_count(shape.head_width)
    writer.add_rope_freq_base(shape.theta)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(shape.vocab)
    _add_vocabulary(writer, shape.vocab, PHI3_SPECIALS if shape.arch == "phi3" else ())
    for tensor, dims, kind in layout:
        if kind == "F32":
            writer.add_tensor_info(tensor, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            data_shape = (dims[0], random_blocks(kind, 1, dims[1], pool).shape[1])
            writer.add_tensor_info(tensor, data_shape, np.dtype(np.uint8), data_shape[0] * data_shape[1],
                                   raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor, dims, kind in layout:
        if kind == "F32":
            writer.write_tensor_data(np.full(dims, 0.0 if tensor.endswith(".bias") else 1.0, dtype=np.float32))
        else:
            writer.write_tensor_data(random_blocks(kind, dims[0], dims[1], pool))
    writer.close()
    os.replace(partial, path)
    return path


#: Phi-3's control tokens from id 32000: llama.cpp's loader looks "<|endoftext|>" up by its text in any
#: file whose name says Phi-3 (and refuses the file without it: "unordered_map::at").
PHI3_SPECIALS = ("<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
                 "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>")


def _add_vocabulary(writer, size: int, specials: tuple[str, ...] = ()) -> None:
    """A SentencePiece-style vocabulary of ``size`` placeholder tokens, which llama.cpp needs to load
    a file (the passes are fed token ids, never text): <unk>, <s>, </s>, the 256 byte tokens its
    loader looks up, then "<t{i}>"; ``specials`` (control tokens) from id 32000."""
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"<t{i}>" for i in range(len(tokens), size)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    types += [TokenType.NORMAL] * (size - len(types))
    for offset, text in enumerate(specials if size >= 32000 + len(specials) else ()):
        tokens[32000 + offset], types[32000 + offset] = text, TokenType.CONTROL
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * size)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


def read_bandwidth(threads: int) -> float:
    """Bytes per second of a streaming read on ``threads`` threads: the best of 5 sums of a 1 GiB
    buffer as int64 (far larger than the caches)."""
    buffer = torch.ones(1 << 27, dtype=torch.int64)  # 1 GiB
    best = float("inf")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(5):
            started = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)
    return buffer.numel() * 8 / best


class LlamaCppPasses:
    """llama.cpp on ``path``: cached passes after ``CONTEXT`` tokens, and a prefill from empty."""

    def __init__(self, path: Path, threads: int):
        from llama_cpp import Llama

        self.llama = Llama(str(path), n_ctx=1024, n_batch=512, n_threads=threads, n_threads_batch=threads,
                           logits_all=True, verbose=False)
        self.vocab = self.llama.n_vocab()

    def _rollback(self, length: int) -> None:
        self.llama._ctx.kv_cache_seq_rm(-1, length, -1)
        self.llama.n_tokens = length

    def _timed(self, tokens: list[int], start: int, repeats: int) -> float:
        samples = []
        for i in range(repeats + 1):
            began = time.perf_counter()
            self.llama.eval(tokens)
            elapsed = time.perf_counter() - began
            self._rollback(start)
            if i:
                samples.append(elapsed)
        return statistics.median(samples)

    def measure(self, repeats: int) -> dict:
        self._rollback(0)
        prefill = self._timed([int(t) for t in np.arange(512) % self.vocab], 0, 1)
        self.llama.eval([int(t) for t in np.arange(CONTEXT) % self.vocab])
        passes = {k: self._timed([int(t) for t in (np.arange(k) * 7 + 11) % self.vocab], CONTEXT, repeats)
                  for k in WIDTHS}
        return {"passes": passes, "prefill_512": prefill}


def tierspec_model(path: Path, dtype: str = "auto"):
    """The file's model as ``load_model`` builds it (the file's blocks where the engine has the type,
    de-quantised weights packed for oneDNN elsewhere), without a tokenizer; ``dtype`` "auto" is the
    engine's default numerics for this CPU (``quant.default_numerics``), as ``--dtype auto``."""
    from tierspec.gguf_model import build_gguf_model
    from tierspec.kernels import packing_available, use_packed_linears
    from tierspec.models import resolve_dtype
    from tierspec.quant import default_numerics, numerics_for, read_gguf_tensors

    numerics = default_numerics() if dtype == "auto" else numerics_for(resolve_dtype(dtype))
    tensors, fields = read_gguf_tensors(path)
    model = build_gguf_model(path, tensors, fields, numerics, torch.float32 if numerics.dtype == torch.int8 else numerics.dtype)
    if packing_available():
        use_packed_linears(model)
    return model


def measure_tierspec(model, repeats: int) -> dict:
    from tierspec.cached_model import CachedModel
    from tierspec.engine import threads_for
    from tierspec.layerskip.masks import RoutingMask

    layers = model.config.num_hidden_layers
    units = RoutingMask.eligible_units(layers, "sublayer")
    generator = np.random.default_rng(1)
    runner = CachedModel(model)
    out: dict = {}
    with torch.inference_mode(), threads_for(model):
        prompt = torch.arange(512) % runner.vocab_size
        out["prefill_512"] = median_seconds(lambda: runner.forward(prompt, logits_for=1), runner, 0, 1)
        runner.forward(prompt[:CONTEXT], logits_for=1)
        out["passes"] = time_passes(runner, CONTEXT, WIDTHS, repeats)
        out["slim"] = {}
        for ratio in MASK_RATIOS:
            count = round(ratio * RoutingMask.total_units(layers, "sublayer"))
            chosen = [units[i] for i in generator.choice(len(units), size=count, replace=False)]
            mask = RoutingMask.from_units(layers, "sublayer", chosen)
            out["slim"][ratio] = {k: median_seconds(lambda k=k: runner.forward((torch.arange(k) * 7 + 11) % runner.vocab_size,
                                                                               mask=mask), runner, CONTEXT, repeats)
                                  for k in (1, 6)}
        out["passes"][6] = time_passes(runner, CONTEXT, (6,), repeats)[6]
    return out


def default_model_costs() -> dict:
    """Calls per emitted token of the papers' methods and plain speculative decoding on the default
    model, and its draft step as a share of its one-row pass (results/engine_via_judge)."""
    summary = json.loads((Path(__file__).resolve().parent.parent / "results/engine_via_judge/summary.json").read_text())
    methods = summary["methods"]
    names = {"sd (eagle)": "eagle", "via r=0.1": "via:draft_with=eagle:mask=masks/smollm2-135m-sublayer-r0.1.json",
             "via r=0.45": "via:draft_with=eagle:mask=masks/smollm2-135m-sublayer-r0.45.json",
             "judge": "judge:draft_with=eagle:judge_head=results/judge/head.safetensors"}
    ar = methods["ar"]["overall"]
    pass_seconds = ar["pass_time_share"] / ar["tokens_per_s"]  # ar: one one-row pass per token
    calls = {}
    for label, key in names.items():
        row = methods[key]["overall"]
        calls[label] = {"target": row["target_calls_per_token"], "slim": row["slim_calls_per_token"],
                        "drafter": row["drafter_calls_per_token"],
                        "draft_share": (row["draft_seconds_per_drafter_call"] or 0.0) / pass_seconds}
    return calls


def predictions(measured: dict, calls: dict) -> dict:
    """Seconds per emitted token of each method at this size (see the module docstring), and the
    slim/full pass ratio at which VIA-SD would break even with plain speculative decoding."""
    full, one = measured["passes"][6], measured["passes"][1]
    out = {}
    for label, c in calls.items():
        ratio = 0.1 if "0.1" in label else 0.45
        slim = measured["slim"][ratio][6] if c["slim"] else 0.0
        out[label] = c["target"] * full + c["slim"] * slim + c["drafter"] * c["draft_share"] * one
    sd_cost = out["sd (eagle)"]
    for label in ("via r=0.1", "via r=0.45"):
        c = calls[label]
        rest = c["target"] * full + c["drafter"] * c["draft_share"] * one
        out[f"{label}: slim/full ratio to break even"] = ((sd_cost - rest) / (c["slim"] * full)) if c["slim"] else None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--mixes", default="Q8_0,Q4_K_M")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--write-only", action="store_true", help="write the files and stop")
    parser.add_argument("--files", default="", help="also time these GGUF files (real models, e.g. a known model's name)")
    parser.add_argument("--out", type=Path, default=Path("results/scale"))
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    bandwidth = None if args.write_only else read_bandwidth(threads)
    calls = default_model_costs()
    report = {"command": "python benchmarks/scale.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "cpu": platform.processor() or platform.machine(), "threads": threads,
              "read_bandwidth_gb_s": None if bandwidth is None else round(bandwidth / 1e9, 2),
              "default_model_calls_per_token": calls, "files": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for spec in filter(None, args.files.split(",")):
        from tierspec.model_files import KNOWN_MODELS, known_model_file

        path = known_model_file(spec) if spec in KNOWN_MODELS else Path(spec)
        entry = measure_file(path, bandwidth, threads, args)
        report["files"][path.name] = entry
        print(json.dumps({path.name: entry}, default=str), file=sys.stderr, flush=True)
    for name in filter(None, args.models.split(",")):
        for mix in args.mixes.split(","):
            started = time.perf_counter()
            path = write_file(name, mix)
            print(f"{path.name}: {path.stat().st_size / 1e9:.2f} GB ({time.perf_counter() - started:.0f} s to have it)",
                  file=sys.stderr, flush=True)
            if args.write_only:
                continue
            entry = measure_file(path, bandwidth, threads, args)
            if "passes" in entry:
                entry["predicted_seconds_per_token"] = predictions(entry["tierspec"], calls)
            if "llama.cpp" in entry:  # the papers' methods on a target whose passes cost llama.cpp's (no slim pass there)
                entry["llama.cpp_floor_multiple"] = entry["llama.cpp"]["passes"][1] / entry["floor_seconds"]
            report["files"][path.name] = entry
            print(json.dumps({path.name: entry}, default=str), file=sys.stderr, flush=True)
            (args.out / "scale.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    if not args.write_only:
        (args.out / "scale.md").write_text(markdown(report))
        print(markdown(report))
    return 0


def measure_file(path: Path, bandwidth: float, threads: int, args) -> dict:
    from tierspec.errors import ModelLoadError
    from tierspec.quant import read_gguf_tensors

    tensors, _ = read_gguf_tensors(path)
    weight_bytes = sum(int(t.data.nbytes) for t in tensors.values())
    floor = weight_bytes / bandwidth
    entry: dict = {"weight_bytes": weight_bytes, "floor_seconds": floor}
    try:
        model = tierspec_model(path)
        entry["engine"] = model.model.engine_stack is not None
    except ModelLoadError as error:  # too large for the memory: refused before loading, llama.cpp still timed
        model, entry["refused"] = None, str(error)
        print(f"tierspec: {error}", file=sys.stderr)
    llama = None if args.no_llamacpp else LlamaCppPasses(path, threads)
    runs: dict = {"tierspec": [], "llama.cpp": []}
    for _ in range(args.rounds):  # interleaved: a busy spell hits both alike
        if model is not None:
            runs["tierspec"].append(measure_tierspec(model, 1))
        if llama is not None:
            runs["llama.cpp"].append(llama.measure(1))
    if model is not None:
        entry["tierspec"] = _medians(runs["tierspec"])
        entry["passes"] = True
    if llama is not None:
        entry["llama.cpp"] = _medians(runs["llama.cpp"])
    del model, llama
    return entry


def _break_even(ratio: float | None) -> str:
    if ratio is None:
        return "n/a"
    return f"{ratio:.2f}" if ratio > 0 else "never (its full passes alone cost more than plain SD's)"


def _medians(runs: list[dict]):
    first = runs[0]
    if isinstance(first, dict):
        return {key: _medians([run[key] for run in runs]) for key in first}
    return statistics.median(runs)


def markdown(report: dict) -> str:
    lines = [f"# Pass costs at real sizes (random weights)\n", f"`{report['command']}` — {report['cpu']}, "
             f"{report['threads']} threads, streaming read {report['read_bandwidth_gb_s']} GB/s "
             "(a 1 GiB int64 sum, best of 5). ms per pass at a 256-token context; ×floor = pass / (weight bytes "
             "/ read bandwidth). Acceptance at these sizes is not measured: predictions use the default model's.\n",
             "| file | who | k=1 | ×floor | k=2 | k=4 | k=8 | k=16 | prefill 512 | slim/full 10% | 25% | 45% (6 rows) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, entry in report["files"].items():
        if "refused" in entry:
            lines.append(f"| {name} | tierspec | refused: {entry['refused']} |" + " |" * 10)
        for who in ("tierspec", "llama.cpp"):
            if who not in entry:
                continue
            m = entry[who]
            p = m["passes"]
            slim = [f"{m['slim'][r][6] / p[6]:.2f}" for r in MASK_RATIOS] if "slim" in m else ["", "", ""]
            label = who + (" (engine)" if who == "tierspec" and entry.get("engine") else "")
            lines.append(f"| {name} | {label} | {p[1] * 1e3:.1f} | {p[1] / entry['floor_seconds']:.2f} | "
                         + " | ".join(f"{p[k] * 1e3:.1f}" for k in (2, 4, 8, 16))
                         + f" | {m['prefill_512'] * 1e3:.0f} | " + " | ".join(slim) + " |")
    lines.append("\nPredicted ms per emitted token (calls per token of the default model's runs):\n")
    for name, entry in report["files"].items():
        if "predicted_seconds_per_token" in entry:
            parts = ", ".join(f"{label} {value * 1e3:.1f}" if "break even" not in label else
                              f"{label} {_break_even(value)}"
                              for label, value in entry["predicted_seconds_per_token"].items())
            lines.append(f"- {name}: {parts}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
