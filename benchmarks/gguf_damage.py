"""Damaged copies of the default model's GGUF file through `tierspec generate` (issue 40, item 1).

Each variant is the real file with one kind of damage (the issue's 36 and more: metadata values,
tensor types, offsets and shapes, string lengths and counts, cuts, magic and version, a NaN in a
norm), written to a temporary folder and run as a user runs it:
`tierspec generate --target damaged.gguf --max-new-tokens 8 "Hello"` with its own empty cache, under
a timeout. Each run is classed:

- refused: exit 2 with one line on stderr and nothing on stdout (what every variant must give);
- accepted: exit 0 (text written from a damaged file: the worst outcome);
- hang: still running at the timeout;
- crash: anything else (a traceback, a signal).

It also times ``gguf_check.check_gguf`` alone on each variant (the header-only refusal; the issue's
bound is 2 s). ``--checks-only`` skips the CLI runs (the timing pass, run under the exclusive lock);
without it the CLI's outcomes are the point and its seconds are wall times of a whole process
start-up, under whatever else the machine runs. Writes results/gguf_check/damage{,-timing}.json and .md.

    flock -s /tmp/tierspec-cpu.lock python benchmarks/gguf_damage.py             # outcomes
    flock -x /tmp/tierspec-cpu.lock python benchmarks/gguf_damage.py --checks-only  # header check times
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGUFReader

from tierspec.gguf_check import GgufFileError, check_gguf
from tierspec.models import default_model_file


def positions(path: Path) -> dict:
    """Byte offsets of what the variants damage, found with gguf-py's own reader."""
    reader = GGUFReader(path)
    fields = {key: field.offset + 8 + len(key.encode()) + 4 for key, field in reader.fields.items()
              if not key.startswith("GGUF.")}
    keys = {key: field.offset for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    tensors = {}
    for tensor in reader.tensors:
        n_dims = tensor.field.offset + 8 + len(tensor.name.encode())
        count = len(tensor.shape)
        tensors[tensor.name] = {"name": tensor.field.offset, "n_dims": n_dims, "dims": n_dims + 4,
                                "type": n_dims + 4 + 8 * count, "offset": n_dims + 4 + 8 * count + 4,
                                "data": int(tensor.data_offset), "nbytes": int(tensor.n_bytes)}
    return {"fields": fields, "keys": keys, "tensors": tensors, "size": path.stat().st_size}


def variants(at: dict) -> list[tuple[str, list[tuple[int, str, object]] | str]]:
    """(name, patches) — each patch (offset, struct format, value) — or (name, "cut:N")."""
    f, t = at["fields"], at["tensors"]
    up, embd, norm = t["blk.0.ffn_up.weight"], t["token_embd.weight"], t["blk.3.attn_norm.weight"]
    last = max(t.values(), key=lambda v: v["data"])
    out: list = []
    for value in (0, 1, 29, 31, 1000, 2**31):
        out.append((f"block_count={value}", [(f["llama.block_count"], "<I", value)]))
    for key, values in (("llama.embedding_length", (0, 575, 1152)), ("llama.feed_forward_length", (0, 1535, 3072)),
                        ("llama.attention.head_count", (0, 8, 10)), ("llama.attention.head_count_kv", (0, 2, 4)),
                        ("llama.vocab_size", (49151, 0)), ("llama.context_length", (0,)),
                        ("llama.rope.dimension_count", (63, 128)), ("tokenizer.ggml.eos_token_id", (49152,))):
        out += [(f"{key.split('.', 1)[1]}={value}", [(f[key], "<I", value)]) for value in values]
    out.append(("rms_epsilon=nan", [(f["llama.attention.layer_norm_rms_epsilon"], "<f", float("nan"))]))
    out.append(("rope_base=0", [(f["llama.rope.freq_base"], "<f", 0.0)]))
    out.append(("block_count as float", [(f["llama.block_count"] - 4, "<I", 6)]))
    for kind, label in ((8, "Q8_0"), (0, "F32"), (2, "Q4_0"), (1, "F16"), (12, "Q4_K"), (99, "id 99")):
        out.append((f"ffn_up Q4_1→{label}", [(up["type"], "<I", kind)]))
    out += [("token_embd Q8_0→Q4_1", [(embd["type"], "<I", 3)]), ("token_embd Q8_0→F32", [(embd["type"], "<I", 0)])]
    out += [("ffn_up offset onto token_embd", [(up["offset"], "<Q", 0)]),
            ("ffn_up offset misaligned", [(up["offset"], "<Q", up["data"] - at["data_offset"] + 4)]),
            ("ffn_up offset past the end", [(up["offset"], "<Q", at["size"])]),
            ("ffn_up rows 1536→1535", [(up["dims"] + 8, "<Q", 1535)]),
            ("ffn_up row length 576→560", [(up["dims"], "<Q", 560)]),
            ("ffn_up n_dims 2→3", [(up["n_dims"], "<I", 3)]),
            ("ffn_up dims overflow", [(up["dims"] + 8, "<Q", 2**62)])]
    out += [("tensor count +1", [(8, "<Q", len(t) + 1)]), ("tensor count -1", [(8, "<Q", len(t) - 1)]),
            ("tensor count 2^50", [(8, "<Q", 2**50)]), ("metadata count +1", [(16, "<Q", len(f) + 1)]),
            ("metadata count 2^62", [(16, "<Q", 2**62)]),
            ("key length 2^63", [(at["keys"]["general.architecture"], "<Q", 2**63)]),
            ("token count +1", [(f["tokenizer.ggml.tokens"] + 4, "<Q", 49153)]),
            ("token count -1", [(f["tokenizer.ggml.tokens"] + 4, "<Q", 49151)]),
            ("token count 2^60", [(f["tokenizer.ggml.tokens"] + 4, "<Q", 2**60)]),
            ("a token's length +1", [(f["tokenizer.ggml.tokens"] + 12, "<Q", 14)]),
            ("a key not UTF-8", [(at["keys"]["llama.block_count"] + 8, "1s", b"\xff")]),
            ("bad magic", [(0, "4s", b"GGUL")]), ("version 1", [(4, "<I", 1)]), ("version 4", [(4, "<I", 4)]),
            ("NaN in a norm", [(norm["data"] + 40, "<f", float("nan"))]),
            ("a value type 77", [(f["general.file_type"] - 4, "<I", 77)])]
    out += [("cut at half", f"cut:{at['size'] // 2}"), ("cut in the header", f"cut:{t['blk.5.ffn_up.weight']['type']}"),
            ("cut 1 byte short", f"cut:{at['size'] - 1}"), ("empty", "cut:0"),
            ("last tensor F32→F16", [(last["type"], "<I", 1)])]
    return out


def make(source: bytes, variant, out: Path) -> None:
    if isinstance(variant, str):
        out.write_bytes(source[: int(variant.split(":")[1])])
        return
    data = bytearray(source)
    for offset, fmt, value in variant:
        struct.pack_into(fmt, data, offset, value)
    out.write_bytes(bytes(data))


def classify(result: subprocess.CompletedProcess | None) -> str:
    if result is None:
        return "hang"
    lines = result.stderr.strip().splitlines()
    if result.returncode == 0:
        return "accepted"
    if result.returncode == 2 and len(lines) == 1 and lines[0].startswith("tierspec: error: ") and not result.stdout:
        return "refused"
    return "crash"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--out", default="results/gguf_check")
    parser.add_argument("--checks-only", action="store_true", help="time the header checks alone (no CLI runs)")
    parser.add_argument("--rounds", type=int, default=5, help="--checks-only: the median of this many checks")
    args = parser.parse_args()
    real = default_model_file()
    source = real.read_bytes()
    at = positions(real)
    at["data_offset"] = check_gguf(real).data_offset
    started = time.perf_counter()
    check_gguf(real)
    sound_seconds = time.perf_counter() - started
    rows = []
    with tempfile.TemporaryDirectory(prefix="gguf-damage-") as folder:
        folder = Path(folder)
        damaged = folder / "damaged.gguf"
        for name, variant in variants(at):
            make(source, variant, damaged)
            times = []
            for _ in range(args.rounds if args.checks_only else 1):
                started = time.perf_counter()
                try:
                    check_gguf(damaged)
                    check = None
                except GgufFileError as error:
                    check = str(error).replace(str(damaged), "damaged.gguf")
                times.append(time.perf_counter() - started)
            check_seconds = sorted(times)[len(times) // 2]
            if args.checks_only:
                rows.append({"variant": name, "outcome": "refused" if check else "accepted",
                             "check_seconds": round(check_seconds, 4), "check_message": check})
                print(f"{check_seconds * 1000:7.1f} ms  {name}", flush=True)
                continue
            cache = folder / "cache"
            shutil.rmtree(cache, ignore_errors=True)
            env = {**os.environ, "TIERSPEC_CACHE": str(cache)}
            started = time.perf_counter()
            try:
                result = subprocess.run([sys.executable, "-m", "tierspec.cli", "generate", "--target", str(damaged),
                                         "--max-new-tokens", "8", "Hello"], capture_output=True, text=True, env=env,
                                        timeout=args.timeout, stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                result = None
            seconds = time.perf_counter() - started
            outcome = classify(result)
            line = (result.stderr.strip().splitlines() or [""])[-1] if result else ""
            rows.append({"variant": name, "outcome": outcome, "cli_seconds": round(seconds, 2),
                         "check_seconds": round(check_seconds, 4), "check_message": check,
                         "cli_line": line.replace(str(damaged), "damaged.gguf")[:400],
                         "converted": cache.exists() and any(cache.iterdir())})
            print(f"{outcome:9s} {seconds:6.1f} s  check {check_seconds * 1000:6.1f} ms  {name}: {rows[-1]['cli_line'][:150]}",
                  flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.checks_only:
        timing = {"command": "flock -x /tmp/tierspec-cpu.lock python benchmarks/gguf_damage.py --checks-only "
                             f"--rounds {args.rounds}", "file": real.name, "variants": len(rows),
                  "refused": sum(r["check_message"] is not None for r in rows),
                  "median_check_ms": round(1000 * sorted(r["check_seconds"] for r in rows)[len(rows) // 2], 1),
                  "worst_check_ms": round(1000 * max(r["check_seconds"] for r in rows), 1),
                  "sound_file_check_ms": round(1000 * sound_seconds, 1), "rows": rows}
        (out / "damage-timing.json").write_text(json.dumps(timing, indent=2) + "\n")
        (out / "damage-timing.md").write_text(
            f"# The header check on damaged copies of {real.name}\n\n`{timing['command']}`\n\n{len(rows)} variants, "
            f"{timing['refused']} refused; the check (median of {args.rounds}) takes {timing['median_check_ms']} ms "
            f"at the median, {timing['worst_check_ms']} ms at worst; {timing['sound_file_check_ms']} ms on the "
            "sound file.\n\n| variant | ms |\n|---|---|\n"
            + "\n".join(f"| {r['variant']} | {r['check_seconds'] * 1000:.1f} |" for r in rows) + "\n")
        print(json.dumps({k: v for k, v in timing.items() if k != "rows"}, indent=2))
        return
    counts = {kind: sum(r["outcome"] == kind for r in rows) for kind in ("refused", "accepted", "hang", "crash")}
    summary = {"command": "flock -s /tmp/tierspec-cpu.lock python benchmarks/gguf_damage.py", "file": real.name,
               "cpu": platform.processor() or platform.machine(), "variants": len(rows), **counts,
               "worst_check_seconds": max(r["check_seconds"] for r in rows),
               "worst_cli_seconds": max(r["cli_seconds"] for r in rows),
               "sound_file_check_seconds": round(sound_seconds, 4),
               "converted": sum(r["converted"] for r in rows), "rows": rows}
    (out / "damage.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = ["| variant | outcome | CLI s | message |", "|---|---|---|---|"]
    table += [f"| {r['variant']} | {r['outcome']} | {r['cli_seconds']} | "
              f"{(r['check_message'] or r['cli_line']).replace('|', '/')} |" for r in rows]
    (out / "damage.md").write_text(
        f"# Damaged copies of {real.name} through `tierspec generate`\n\n`{summary['command']}`\n\n"
        f"{len(rows)} variants: {counts['refused']} refused in one line, {counts['accepted']} accepted, "
        f"{counts['hang']} hangs, {counts['crash']} crashes; {summary['converted']} converted. The longest CLI run "
        f"took {summary['worst_cli_seconds']:.1f} s (a whole process start-up, on a shared machine: not a timing; the "
        "header check's own times are in damage-timing.md).\n\n" + "\n".join(table) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()
