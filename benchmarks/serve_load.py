"""Serving and start-up: a bounded load test of ``tierspec serve`` on loopback with the official
``openai`` client, and the start-up times of ``import tierspec`` and a short cached generation.

Starts the server in this process (127.0.0.1, a free port), then for each method sends the same
fixed list of chat requests from ``--clients`` concurrent clients (streaming, greedy), and
reports requests per second, p50 / p99 latency and p50 / p99 time to first token. The server
generates one request at a time (a queue), so with more clients than one the latency includes
queueing: the comparison between methods is like for like. Stops by itself.

    python benchmarks/serve_load.py [--requests 16] [--clients 2] [--max-tokens 64]
    python benchmarks/serve_load.py --concurrency 1,2,4,8 [--requests-per-client 2] [--max-tokens 128] [--peers]
                                    [--before FOLDER --rounds 3] [--settings 0,1,1/p0.95,0/pres0.5/freq0.3]

The second form (batching, issue 31) runs one batching server (``tierspec serve`` in a process of its
own, as deployed, ``--max-batch`` the largest concurrency) and, for each client count, that many concurrent clients sending their requests back
to back (greedy, then seeded at temperature 1: request i has seed i; ``--settings`` other samplings, top-k,
top-p and the penalties among them): total tokens per second,
median and p99 latency, whether every reply equals the same request's reply with one client (its
solo text), replies lost (no finish reason), and where the server's cycles went (``/health``'s
cycle times: draft, pass, verify, commit per cycle, and the time outside the pass against one
client's round and against the same requests sent by one client one after another, before the rounds:
a one-sequence cycle on the same prompts — a 1-client round sends only the first requests — and the CPU
time a cycle of the server's event loop, whose handlers take it from the pass's threads); ``--peers`` adds OpenVINO GenAI's ContinuousBatchingPipeline on the same GGUF, fed as
many prompts at a time; ``--before FOLDER`` runs a second server from another checkout (its extensions
built) beside this one, the two taking turns for ``--rounds`` rounds at each client count (the first
of a round goes last in the next), so a change is measured against its parent on the same load
within minutes. Writes results/batch_load.json.

Start-up (before the load test, in fresh processes, the model and its cost table already
cached): ``python -c "import tierspec"`` (median of 5) and ``tierspec generate "Hi"
--max-new-tokens 8`` (median of 3), wall time, with the default ``--implementation auto``
(tierspec's own Llama code) and with ``--implementation transformers`` for comparison.

Writes results/serve_load.json and results/serving-report.md (earlier runs: docs/history.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from tierspec import load_model
from tierspec.methods import DEFAULT_METHOD
from tierspec.server import Scheduler, serving_in_background
from tierspec.util import atomic_write_text

# Written for this script; not from any evaluation set.
PROMPTS = [
    "Give three reasons to learn a second language.",
    "Explain what a hash table is in two sentences.",
    "Write a haiku about autumn rain.",
    "How do vaccines train the immune system?",
    "Suggest a name for a bakery and explain it.",
    "What is the difference between weather and climate?",
    "List four uses of a paper clip.",
    "Describe how to make a cup of tea.",
]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def one_request(client: openai.OpenAI, prompt: str, method: str, max_tokens: int) -> dict:
    started = time.perf_counter()
    first = None
    usage = None
    stream = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"method": method})
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    return {"latency": time.perf_counter() - started, "ttft": first or float("nan"),
            "tokens": usage["completion_tokens"], "tau": usage["mean_accepted_tokens"]}


def run_method(port: int, method: str, requests: int, clients: int, max_tokens: int) -> dict:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
    one_request(client, PROMPTS[0], method, 8)  # warm-up: builds the method, measures its cost table once
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: one_request(client, p, method, max_tokens), prompts))
    wall = time.perf_counter() - started
    latencies = [r["latency"] for r in results]
    ttfts = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"method": method, "requests": requests, "clients": clients, "wall_s": round(wall, 2),
            "requests_per_s": round(requests / wall, 3), "tokens_per_s": round(tokens / wall, 2),
            "latency_p50_s": round(statistics.median(latencies), 3), "latency_p99_s": round(percentile(latencies, 0.99), 3),
            "ttft_p50_s": round(statistics.median(ttfts), 3), "ttft_p99_s": round(percentile(ttfts, 0.99), 3),
            "mean_tau": round(statistics.mean(r["tau"] for r in results), 3)}


def wall(command: list[str], runs: int) -> dict:
    """Median and spread of the wall time of ``command`` over ``runs`` fresh processes."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        times.append(time.perf_counter() - started)
    return {"median_s": round(statistics.median(times), 2), "min_s": round(min(times), 2), "max_s": round(max(times), 2),
            "runs": runs}


def startup() -> dict:
    cli = shutil.which("tierspec") or "tierspec"
    subprocess.run([cli, "generate", "Hi", "--max-new-tokens", "8"], check=True, capture_output=True)  # fill the caches
    heavy = subprocess.run([sys.executable, "-c", "import sys, tierspec; print(','.join(m for m in ('transformers', "
                            "'sklearn', 'matplotlib', 'rouge_score', 'sacrebleu', 'starlette', 'uvicorn') if m in sys.modules))"],
                           check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([cli, "generate", "Hi", "--max-new-tokens", "8", "--implementation", "transformers"], check=True,
                   capture_output=True)  # its own cost table
    by_generate = subprocess.run([sys.executable, "-c", "import sys, tierspec; tierspec.generate('Hi', max_new_tokens=8); "
                                  "print(','.join(m for m in ('transformers', 'sklearn', 'scipy', 'matplotlib', 'starlette') "
                                  "if m in sys.modules))"], check=True, capture_output=True, text=True).stdout.strip()
    return {"import": wall([sys.executable, "-c", "import tierspec"], 5),
            "import_transformers_llama": wall([sys.executable, "-c", "import transformers.models.llama.modeling_llama"], 3),
            "generate_hi_8_tokens": wall([cli, "generate", "Hi", "--max-new-tokens", "8"], 3),
            "generate_hi_8_tokens_transformers": wall([cli, "generate", "Hi", "--max-new-tokens", "8",
                                                       "--implementation", "transformers"], 3),
            "heavy_modules_imported_by_import_tierspec": heavy.split(",") if heavy else [],
            "heavy_modules_imported_by_a_generation": by_generate.split(",") if by_generate else []}


def report(rows: list[dict], start: dict, args, table: str) -> str:
    generate, theirs = start["generate_hi_8_tokens"], start["generate_hi_8_tokens_transformers"]
    return f"""## Serving and start-up

`python benchmarks/serve_load.py --requests {args.requests} --clients {args.clients} --max-tokens {args.max_tokens}` —
the server in-process on 127.0.0.1, the official `openai` client, streaming chat requests (greedy, {args.max_tokens}
tokens at most) from {args.clients} concurrent clients; the server generates one request at a time, so latency includes
queueing. Requests per second and latency are over {args.requests} requests per method (p99 of so few requests is
about their maximum).

{table}

Start-up, wall time in fresh processes with the model and its cost table cached:
`python -c "import tierspec"` {start['import']['median_s']} s (median of {start['import']['runs']}; mostly importing
torch), `tierspec generate "Hi" --max-new-tokens 8` {generate['median_s']} s (median of {generate['runs']}, range
{generate['min_s']}–{generate['max_s']} s; target ≤ 3 s: {"met" if generate['median_s'] <= 3 else "**not met**"}).
Heavy optional libraries imported by `import tierspec`: {", ".join(start['heavy_modules_imported_by_import_tierspec']) or "none"};
by a whole short generation: {", ".join(start['heavy_modules_imported_by_a_generation']) or "none"}.
The default model runs on tierspec's own Llama forward pass and reads its tokenizer.json directly
(`--implementation auto`); the same command with `--implementation transformers` takes {theirs['median_s']} s
(range {theirs['min_s']}–{theirs['max_s']} s), because transformers' Llama modules import torch's compiler stack
(`torch._dynamo`, `torch.distributed.tensor`, sympy): `python -c "import transformers.models.llama.modeling_llama"`
alone takes {start['import_transformers_llama']['median_s']} s here (median of 3).
"""


# ---- batching: 1 / 2 / 4 / 8 clients against one batching server (issue 31) ---------------------------


def load_prompts_for_load(count: int) -> list[str]:
    """MT-Bench first turns (nothing here was tuned on them), as many as asked, cycled."""
    from tierspec.data import load_prompts

    texts = [p.text for p in load_prompts("mt_bench")]
    return [texts[i % len(texts)] for i in range(count)]


DEFAULT_SETTINGS = "0,1"  # greedy, then seeded at temperature 1


@dataclass(frozen=True)
class Setting:
    """A round's sampling fields: ``temperature``, ``top_p``, ``top_k`` (tierspec's extra field; 0: none),
    the two penalties — every request of the round sends them; ``label``: the ``--settings`` text."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    label: str = "0"


def parse_setting(spec: str) -> Setting:
    """``T`` then any of ``/kK`` (top-k), ``/pP`` (top-p) — ``loop_time.sampling_setting``'s syntax — and
    ``/presP`` (presence penalty), ``/freqF`` (frequency penalty): ``1/p0.95``, ``0/pres0.5/freq0.3``."""
    from loop_time import sampling_setting  # (the script's folder is on the path)

    spec = spec.strip()
    head, *rest = spec.split("/")
    penalties = {prefix: part[len(prefix):] for part in rest for prefix in ("pres", "freq") if part.startswith(prefix)}
    filters = [part for part in rest if not part.startswith(("pres", "freq"))]
    kinds = [part[:4] if part.startswith(("pres", "freq")) else part[:1] for part in rest]
    if len(set(kinds)) != len(kinds):
        raise SystemExit(f"a setting gives each part once, not {spec!r}")
    try:
        temperature, top_k, top_p = sampling_setting("/".join([head, *filters]))
        presence, frequency = (float(penalties.get(prefix, 0.0)) for prefix in ("pres", "freq"))
    except ValueError as error:
        raise SystemExit(f"a setting is T then /kK, /pP, /presP or /freqF parts, not {spec!r}: {error}") from None
    return Setting(temperature, top_p, top_k, presence, frequency, spec)


def chat(client: openai.OpenAI, prompt: str, max_tokens: int, seed: int | None, setting: Setting | float) -> dict:
    started = time.perf_counter()
    setting = setting if isinstance(setting, Setting) else Setting(float(setting), label=f"{float(setting):g}")
    reply = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=max_tokens, temperature=setting.temperature, seed=seed,
                                           top_p=setting.top_p, presence_penalty=setting.presence_penalty,
                                           frequency_penalty=setting.frequency_penalty,
                                           extra_body={"top_k": setting.top_k} if setting.top_k else None)
    choice = reply.choices[0]
    return {"latency": time.perf_counter() - started, "text": choice.message.content,
            "finish_reason": choice.finish_reason, "tokens": reply.usage.completion_tokens}


def cycle_times(port: int) -> dict:
    """The server's cycles so far (``/health``: cycles, generations, rows, seconds by phase)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as response:
        return json.loads(response.read())["cycles"]


def per_cycle(before: dict, after: dict) -> dict:
    """What the cycles between two ``cycle_times`` spent, per cycle: ms by phase (draft includes
    the draft head's steps; outside = everything but the pass), mean generations and rows."""
    cycles = max(after["cycles"] - before["cycles"], 1)
    ms = {k: 1000 * (after["seconds"][k] - before["seconds"][k]) / cycles for k in after["seconds"]}
    ms["outside"] = ms["draft"] + ms["verify"] + ms["commit"]
    return {"cycles": cycles, "mean_batch": round((after["sequences"] - before["sequences"]) / cycles, 2),
            "rows_per_pass": round((after["rows"] - before["rows"]) / cycles, 2),
            "ms_per_cycle": {k: round(v, 3) for k, v in ms.items()}}


#: The server process on each port (``serving_process``), for its threads' CPU time.
SERVER_PIDS: dict[int, int] = {}


def event_loop_cpu_seconds(port: int) -> float | None:
    """CPU seconds the server's event loop has used: its process's main thread, which runs the
    HTTP handlers (``/proc``; None elsewhere, or for a server this script did not start)."""
    pid = SERVER_PIDS.get(port)
    try:  # the nanoseconds the thread ran (schedstat's first field; stat's ticks are 10 ms)
        return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, IndexError, ValueError):  # (no pid: the path names no process)
        return None


def load_round(port: int, prompts: list[str], clients: int, max_tokens: int, setting: Setting | float) -> dict:
    """``clients`` concurrent clients, each sending its share of ``prompts`` back to back (request
    i seeded with i); every reply, its latency, the wall time, where the server's cycles went, and
    its event loop's CPU time a cycle (the handlers' work: it takes CPU from the pass's threads)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=900)
    before, loop_before = cycle_times(port), event_loop_cpu_seconds(port)
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        replies = list(pool.map(lambda i: chat(client, prompts[i], max_tokens, i, setting), range(len(prompts))))
    wall = time.perf_counter() - started
    cycles, loop_after = per_cycle(before, cycle_times(port)), event_loop_cpu_seconds(port)
    if loop_before is not None and loop_after is not None:
        cycles["event_loop_cpu_ms_per_cycle"] = round(1000 * (loop_after - loop_before) / cycles["cycles"], 3)
    return {"wall": wall, "replies": replies, "cycles": cycles}


def openvino_batch_round(prompts_ids: list[list[int]], clients: int, max_tokens: int, lookup: bool) -> dict | None:
    """OpenVINO GenAI's ContinuousBatchingPipeline on the same GGUF, fed ``clients`` prompts at a
    time (its own batching), the same budget; None where it cannot run here (the reason printed)."""
    try:
        import numpy as np
        import openvino
        import openvino_genai as genai
    except ImportError as error:
        print(f"OpenVINO peer skipped: {error}", file=sys.stderr)
        return None
    from tierspec.models import default_model_file

    import torch

    try:
        scheduler = genai.SchedulerConfig()
        scheduler.cache_size = 1
        properties = {"INFERENCE_NUM_THREADS": torch.get_num_threads()}
        if lookup:
            properties["prompt_lookup"] = True
        pipe = genai.ContinuousBatchingPipeline(str(default_model_file()), scheduler, "CPU", properties)
    except RuntimeError as error:
        print(f"OpenVINO ContinuousBatchingPipeline failed: {str(error).splitlines()[0]}", file=sys.stderr)
        return None
    config = genai.GenerationConfig()
    config.max_new_tokens, config.do_sample = max_tokens, False
    if lookup:
        config.num_assistant_tokens, config.max_ngram_size = 5, 3
    warm = genai.GenerationConfig()
    warm.max_new_tokens, warm.do_sample = 8, False
    if lookup:
        warm.num_assistant_tokens, warm.max_ngram_size = 5, 3
    pipe.generate([openvino.Tensor(np.asarray([prompts_ids[0]], dtype=np.int64))], [warm])  # compiles for this CPU
    tokens = 0
    started = time.perf_counter()
    for at in range(0, len(prompts_ids), clients):
        group = prompts_ids[at : at + clients]
        inputs = [openvino.Tensor(np.asarray([ids], dtype=np.int64)) for ids in group]
        results = pipe.generate(inputs, [config] * len(group))
        tokens += sum(len(r.m_generation_ids[0]) for r in results)
    return {"wall": time.perf_counter() - started, "tokens": tokens}


@contextlib.contextmanager
def serving_process(max_batch: int, checkout: Path | None = None):
    """``tierspec serve`` as deployed: a process of its own on a free loopback port (so the load
    generator's client threads do not share the server's interpreter), stopped by SIGTERM.
    ``checkout``: the server runs that folder's tierspec (another commit's tree, its extensions
    built) instead of the installed one."""
    import os
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    options = ["serve", "--port", str(port), "--max-batch", str(max_batch), "--max-queue", "64", "--log-level", "warning"]
    if checkout is None:
        process = subprocess.Popen([shutil.which("tierspec") or "tierspec", *options], stderr=subprocess.PIPE)
    else:
        process = subprocess.Popen([sys.executable, "-m", "tierspec.cli", *options], stderr=subprocess.PIPE,
                                   cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout.resolve())})
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise SystemExit(f"tierspec serve exited {process.returncode}: {process.stderr.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("tierspec serve did not come up within 300 s")
                time.sleep(0.5)
        SERVER_PIDS[port] = process.pid
        yield port
    finally:
        SERVER_PIDS.pop(port, None)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def batching(args) -> None:
    """Total tokens/s and latency at each concurrency against one batching server, every reply
    checked against the same request's solo reply, beside OpenVINO's continuous batching."""
    import torch

    from tierspec.prompting import encode_prompt

    target = load_model("smollm2-135m", dtype="auto")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    rows, checks = [], []
    with contextlib.ExitStack() as stack:
        servers = {"tierspec serve": stack.enter_context(serving_process(max(concurrency)))}
        if args.before is not None:
            servers["tierspec serve (before)"] = stack.enter_context(serving_process(max(concurrency), args.before))
        for port in servers.values():
            warm = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=900)
            chat(warm, "Hi", 8, None, 0.0)  # builds the method and its cost table
        this_port = servers["tierspec serve"]
        for setting in args.sampling_settings:
            # every request's solo text: the largest round's requests, one client, one at a time
            everything = load_prompts_for_load(max(concurrency) * args.requests_per_client)
            solo = [r["text"] for r in load_round(this_port, everything, 1, args.max_tokens, setting)["replies"]]
            for clients in concurrency:
                prompts = load_prompts_for_load(clients * args.requests_per_client)
                # A one-sequence cycle on these very requests (one client sending them one after another,
                # before the rounds): what batching adds to a cycle outside its pass, on the same prompts
                # (a 1-client round sends only the first requests, whose drafts differ).
                alone = {} if clients == 1 else {
                    engine: load_round(port, prompts, 1, args.max_tokens, setting)["cycles"]
                    for engine, port in servers.items()}
                for round_index in range(args.rounds):
                    # the servers take turns, the first in the next round going last
                    order = list(servers.items()) if round_index % 2 == 0 else list(reversed(servers.items()))
                    for engine, port in order:
                        done = load_round(port, prompts, clients, args.max_tokens, setting)
                        same = all(r["text"] == solo[i] for i, r in enumerate(done["replies"]))
                        lost = sum(1 for r in done["replies"] if r["finish_reason"] not in ("stop", "length"))
                        tokens = sum(r["tokens"] for r in done["replies"])
                        latencies = [r["latency"] for r in done["replies"]]
                        rows.append({"engine": engine, "round": round_index + 1, "temperature": setting.temperature,
                                     "setting": setting.label,
                                     "clients": clients, "requests": len(prompts),
                                     "tokens_per_s": round(tokens / done["wall"], 1),
                                     "latency_p50_s": round(statistics.median(latencies), 3),
                                     "latency_p99_s": round(percentile(latencies, 0.99), 3),
                                     "same_as_solo": same, "lost": lost, **done["cycles"],
                                     "alone": alone.get(engine, done["cycles"])})
                        checks.append(same and lost == 0)
                        print(json.dumps(rows[-1]), flush=True)
    if args.peers:
        for lookup in (False, True):
            for clients in concurrency:
                prompts = load_prompts_for_load(clients * args.requests_per_client)
                ids = [encode_prompt(target, p).tolist() for p in prompts]
                done = openvino_batch_round(ids, clients, args.max_tokens, lookup)
                if done is None:
                    break
                rows.append({"engine": "OpenVINO ContinuousBatchingPipeline" + (" + prompt lookup" if lookup else ""),
                             "temperature": 0.0, "setting": "0", "clients": clients, "requests": len(prompts),
                             "tokens_per_s": round(done["tokens"] / done["wall"], 1)})
                print(json.dumps(rows[-1]), flush=True)
    lines = [f"`python benchmarks/serve_load.py --concurrency {args.concurrency} --requests-per-client "
             f"{args.requests_per_client} --max-tokens {args.max_tokens}{' --peers' if args.peers else ''}"
             f"{f' --before {args.before} --rounds {args.rounds}' if args.before else ''}"
             f"{f' --settings {args.settings_text}' if args.settings_text != DEFAULT_SETTINGS else ''}`, "
             f"{torch.get_num_threads()} threads, MT-Bench first turns:", "",
             "| engine | round | sampling | clients | requests | total tok/s | vs 1 client | p50 latency s | "
             "p99 latency s | every text its solo text | lost |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        one = next(r for r in rows if r["engine"] == row["engine"] and r["setting"] == row["setting"]
                   and r["clients"] == concurrency[0])  # its first round
        lines.append(f"| {row['engine']} | {row.get('round', 1)} | {row['setting']} | {row['clients']} | {row['requests']} | "
                     f"{row['tokens_per_s']} | {row['tokens_per_s'] / one['tokens_per_s']:.2f}× | "
                     f"{row.get('latency_p50_s', '–')} | {row.get('latency_p99_s', '–')} | "
                     f"{row.get('same_as_solo', '–')} | {row.get('lost', '–')} |")
    lines += ["", "Where tierspec's cycles went, ms per cycle (draft: every generation's drafter and policy, the "
              "draft head's steps included; outside: all but the pass):", "",
              "| engine | round | sampling | clients | mean batch | rows/pass | draft | pass | verify | commit | outside "
              "| outside vs 1 client | the same requests alone: outside | outside vs alone | event loop's CPU |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "ms_per_cycle" not in row:
            continue
        ms = row["ms_per_cycle"]
        one = next(r for r in rows if "ms_per_cycle" in r and r["engine"] == row["engine"]
                   and r["setting"] == row["setting"] and r["clients"] == concurrency[0])["ms_per_cycle"]
        lines.append(f"| {row['engine']} | {row['round']} | {row['setting']} | {row['clients']} | "
                     f"{row['mean_batch']} | {row['rows_per_pass']} | "
                     f"{ms['draft']} | {ms['pass']} | {ms['verify']} | {ms['commit']} | {ms['outside']} | "
                     f"{ms['outside'] / one['outside']:.2f}× | {row['alone']['ms_per_cycle']['outside']} | "
                     f"{ms['outside'] / row['alone']['ms_per_cycle']['outside']:.2f}× | "
                     f"{row.get('event_loop_cpu_ms_per_cycle', '–')} |")
    table = "\n".join(lines)
    print(table)
    atomic_write_text(args.out, json.dumps({"rows": rows, "table": table, "all_checks_hold": all(checks)}, indent=2))
    if args.report is not None:  # the tables as markdown (default: the JSON and the log only)
        atomic_write_text(args.report, table + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default=None,
                        help="batching mode: comma-separated client counts against one batching server, e.g. 1,2,4,8")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--peers", action="store_true", help="batching mode: also OpenVINO's continuous batching")
    parser.add_argument("--before", type=Path, default=None,
                        help="batching mode: a second server from this folder (another commit's tree, extensions "
                             "built), taking turns with this checkout's round by round")
    parser.add_argument("--rounds", type=int, default=1, help="batching mode: rounds per client count (alternating "
                                                               "the servers' order with --before)")
    parser.add_argument("--settings", dest="settings_text", default=DEFAULT_SETTINGS,
                        help="batching mode: the sampling of each set of rounds, comma-separated, each T then any of "
                             "/kK (top-k), /pP (top-p), /presP, /freqF (the penalties): e.g. 0,1,1/p0.95,0/pres0.5/freq0.3")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--methods", default=f"{DEFAULT_METHOD},ar")
    parser.add_argument("--out", type=Path, default=Path("results/serve_load.json"))
    parser.add_argument("--report", type=Path, default=None,
                        help="the markdown report (default results/serving-report.md; batching mode: none unless given)")
    args = parser.parse_args()
    if args.concurrency:
        settings = [parse_setting(spec) for spec in args.settings_text.split(",") if spec.strip()]
        if not settings or len({s.label for s in settings}) != len(settings):
            parser.error(f"--settings {args.settings_text!r}: one setting or more, each once")
        args.sampling_settings = settings  # (the batching tables' rows; not a setting the plain form dumps)
        if args.rounds < 1:
            parser.error("--rounds must be >= 1")
        if args.before is not None and not (args.before / "tierspec" / "__init__.py").is_file():
            parser.error(f"--before {args.before}: no tierspec package in that folder")
        if args.out == Path("results/serve_load.json"):
            args.out = Path("results/batch_load.json")
        batching(args)
        return
    if args.requests < 1 or args.clients < 1:
        parser.error("--requests and --clients must be >= 1")
    start = startup()
    print(json.dumps(start), flush=True)
    scheduler = Scheduler(load_model("smollm2-135m", dtype="auto"), max_queue=max(8, args.clients))
    with serving_in_background(scheduler) as port:
        rows = [run_method(port, method.strip(), args.requests, args.clients, args.max_tokens)
                for method in args.methods.split(",") if method.strip()]
    base = next((r for r in rows if r["method"] == "ar"), None)
    lines = ["| method | req/s | tok/s | vs ar | p50 latency s | p99 latency s | p50 TTFT s | p99 TTFT s | τ |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['requests_per_s'] / base['requests_per_s']:.2f}×" if base else "–"
        lines.append(f"| {r['method']} | {r['requests_per_s']} | {r['tokens_per_s']} | {ratio} | {r['latency_p50_s']} | "
                     f"{r['latency_p99_s']} | {r['ttft_p50_s']} | {r['ttft_p99_s']} | {r['mean_tau']} |")
    table = "\n".join(lines)
    print(table)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    atomic_write_text(args.out, json.dumps({"settings": settings, "rows": rows, "startup": start, "table": table}, indent=2))
    atomic_write_text(args.report or Path("results/serving-report.md"), report(rows, start, args, table))


if __name__ == "__main__":
    main()
