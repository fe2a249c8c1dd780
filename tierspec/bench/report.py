"""Benchmark summary (summary.json), table (summary.md) and plots, rebuilt from the records."""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter, defaultdict
from pathlib import Path

from ..util import atomic_write, atomic_write_text
from . import metrics

TASK_METRICS = ("gsm8k_exact_match", "humaneval_pass@1", "rouge_l", "json_valid", "json_cut", "json_answer_match")


def _mean(values):
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else None


def _group_summary(rows: list[dict], baseline: dict, hf_greedy: dict, dataset: str, references: dict,
                   fidelity_baseline: dict) -> dict:
    tps = _mean([r["tokens_per_s"] for r in rows])
    base = _mean([baseline[(r["prompt_id"], r["repeat"])]["tokens_per_s"] for r in rows if (r["prompt_id"], r["repeat"]) in baseline])
    hf = _mean([hf_greedy[(r["prompt_id"], r["repeat"])]["tokens_per_s"] for r in rows if (r["prompt_id"], r["repeat"]) in hf_greedy])
    ours = [r for r in rows if "target_calls" in r]
    emitted = sum(r["emitted"] for r in ours)
    target_calls = sum(r["target_calls"] for r in ours)
    evaluated = sum(r["evaluated"] for r in ours)
    tiers: dict[str, int] = defaultdict(int)
    for r in ours:
        for tier, count in r.get("tiers", {}).items():
            tiers[tier] += count
    by_repeat = defaultdict(list)
    for r in rows:
        if (r["prompt_id"], r["repeat"]) in baseline:
            by_repeat[r["repeat"]].append((r["tokens_per_s"], baseline[(r["prompt_id"], r["repeat"])]["tokens_per_s"]))
    repeat_speedups = [_mean([a for a, _ in pairs]) / _mean([b for _, b in pairs]) for _, pairs in sorted(by_repeat.items())]
    drafted = [0] * max((len(r.get("position_drafted", [])) for r in ours), default=0)
    accepted_at = [0] * len(drafted)
    for r in ours:
        for i, (d, a) in enumerate(zip(r.get("position_drafted", []), r.get("position_accepted", []))):
            drafted[i] += d
            accepted_at[i] += a
    drafter_calls = sum(r.get("drafter_calls", 0) for r in ours)
    cycles = sum(r.get("cycles", 0) for r in ours)
    trees = [r for r in ours if r.get("tree_cycles")]
    tree_cycles = sum(r["tree_cycles"] for r in trees)
    summary = {
        "n_prompts": len(rows),
        "tokens_per_s": tps,
        "speedup": tps / base if tps and base else None,
        "speedup_by_repeat": repeat_speedups,
        "speedup_std": statistics.stdev(repeat_speedups) if len(repeat_speedups) > 1 else None,
        "acceptance_by_position": [a / d if d else None for a, d in zip(accepted_at, drafted)] or None,
        "draft_seconds_per_drafter_call": (sum(r.get("draft_seconds", 0.0) for r in ours) / drafter_calls
                                           if drafter_calls else None),
        "draft_time_share": (sum(r.get("draft_seconds", 0.0) for r in ours) / sum(r["seconds"] for r in ours)
                             if ours and sum(r["seconds"] for r in ours) > 0 else None),
        "pass_time_share": (sum(r.get("pass_seconds", 0.0) for r in ours) / sum(r["seconds"] for r in ours)
                            if ours and sum(r["seconds"] for r in ours) > 0 and any("pass_seconds" in r for r in ours)
                            else None),
        # the constraint's own work (its masks, cuts, forced tokens, advancing), apart from drafting
        "grammar_time_share": (sum(r.get("grammar_seconds", 0.0) for r in ours) / sum(r["seconds"] for r in ours)
                               if ours and sum(r["seconds"] for r in ours) > 0
                               and any(r.get("grammar_seconds") for r in ours) else None),
        "drafter_calls_per_token": drafter_calls / emitted if emitted else None,
        "speedup_vs_hf_greedy": tps / hf if tps and hf else None,
        "speedup_vs_best_plain": tps / max(base or 0, hf or 0) if tps and (base or hf) else None,
        "mean_accepted_tokens": emitted / target_calls if target_calls else None,
        "rejection_rate": (evaluated - sum(r["accepted"] for r in ours)) / evaluated if evaluated else (0.0 if ours else None),
        "target_calls_per_token": target_calls / emitted if emitted else None,
        "slim_calls_per_token": sum(r["slim_calls"] for r in ours) / emitted if emitted else None,
        "tier_fractions": {t: c / sum(tiers.values()) for t, c in sorted(tiers.items())} if tiers else None,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in rows),
        "mean_emitted": _mean([r["emitted"] for r in rows]),
        "target_nll": _mean([r.get("target_nll") for r in rows]),
        "accepted_per_cycle": sum(r["accepted"] for r in ours) / cycles if cycles else None,
    }
    if tree_cycles:  # a token-tree method (docs/algorithms.md §Token trees): its shape, and acceptance read by depth
        summary["nodes_per_pass"] = sum(r["tree_nodes"] for r in trees) / tree_cycles
        summary["tree_depth_mean"] = sum(r["tree_depth"] for r in trees) / tree_cycles
        summary["max_nodes"] = max(r.get("tree_max_nodes", 0) for r in trees)
        summary["acceptance_by_depth"] = summary["acceptance_by_position"]
    paired = [(r, fidelity_baseline[(r["prompt_id"], r["repeat"])]) for r in rows
              if (r["prompt_id"], r["repeat"]) in fidelity_baseline]
    if paired:
        summary["fidelity_exact_match"] = _mean([float(r["token_ids"] == b["token_ids"]) for r, b in paired])
        summary["fidelity_rouge_l"] = _mean([metrics.rouge_l(r["text"], b["text"]) if b["text"] else None for r, b in paired])
    for name in TASK_METRICS:
        value = _mean([r.get(name) for r in rows])
        if value is not None:
            summary[name] = value
    if dataset == "wmt14":
        refs = [references.get(r["prompt_id"]) for r in rows]
        if all(refs):
            summary["bleu"] = metrics.corpus_bleu([r["text"] for r in rows], refs)
    return summary


def unique_records(records: list[dict]) -> list[dict]:
    """The first record of each (method, prompt, repeat), with a warning on stderr when there
    are more: a folder two runs wrote at once (before runs locked their folder) holds each twice,
    and counting both would weigh those prompts double."""
    import sys

    seen, unique = set(), []
    for record in records:
        key = (record["method"], record["prompt_id"], record["repeat"])
        if key not in seen:
            seen.add(key)
            unique.append(record)
    if len(unique) < len(records):
        print(f"tierspec: warning: the records hold {len(records) - len(unique)} duplicate records (the same method, "
              "prompt and repeat more than once); the summary counts the first of each", file=sys.stderr)
    return unique


def failed_records(records: list[dict]) -> dict[str, dict]:
    """The generations a peer could not give (error records: its worker died, hung or raised), by
    method: how many prompts and each distinct reason. A generation that a rerun then made is not
    counted (its error record is superseded)."""
    made = {(r["method"], r["prompt_id"], r["repeat"]) for r in records if "error" not in r}
    failures: dict[str, dict] = {}
    for record in records:
        key = (record["method"], record["prompt_id"], record["repeat"])
        if "error" in record and key not in made:
            entry = failures.setdefault(record["method"], {"prompts": 0, "reasons": []})
            entry["prompts"] += 1
            if record["error"] not in entry["reasons"]:
                entry["reasons"].append(record["error"])
    return failures


def machine_label(worker: dict | None) -> str:
    """The machine a record was made on, as far as its numbers depend on it: CPU model, torch
    threads, device ("unrecorded" for records made before records named their worker)."""
    if not worker:
        return "unrecorded"
    threads = worker["threads"]
    return f"{worker['cpu']}, {threads} thread{'' if threads == 1 else 's'}, {worker['device']}"


def _by_method(records: list[dict]) -> dict[str, list[dict]]:
    by_method: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        by_method[record["method"]].append(record)
    return by_method


def _method_summary(rows: list[dict], by_method: dict[str, list[dict]], dataset: str, references: dict,
                    fidelity_baseline: dict, categories: bool) -> dict:
    """One method's summary over ``rows``, overall (and by category), its speed-ups against the
    `ar` (and hf-greedy) records of ``by_method``."""
    baseline = {(r["prompt_id"], r["repeat"]): r for r in by_method.get("ar", [])}
    hf_greedy = {(r["prompt_id"], r["repeat"]): r for r in by_method.get("hf-greedy", [])}
    summary = {"overall": _group_summary(rows, baseline, hf_greedy, dataset, references, fidelity_baseline)}
    if categories:
        by_category = defaultdict(list)
        for r in rows:
            by_category[r["category"]].append(r)
        summary["categories"] = {c: _group_summary(rs, baseline, hf_greedy, dataset, references, fidelity_baseline)
                                 for c, rs in by_category.items()}
    return summary


def summarize(records: list[dict], config, references: dict, fidelity_reference: dict | None = None) -> dict:
    """Per-method summaries, overall and by category. Speed-ups are against `ar` of the same
    records; fidelity against ``fidelity_reference`` (`ar` records of another run, by prompt id
    and repeat) when given, else against the same `ar`. Each (method, prompt, repeat) counts
    once: ``unique_records``. ``workers``: who made the records (where they say); ``machines``,
    where records come from more than one machine (``machine_label``): each method's overall
    summary on each, against `ar` on the same machine."""
    failures = failed_records(records)
    unique = unique_records([r for r in records if "error" not in r])
    by_method = _by_method(unique)
    baseline = {(r["prompt_id"], r["repeat"]): r for r in by_method.get("ar", [])}
    fidelity_baseline = fidelity_reference if fidelity_reference is not None else baseline
    methods = {}
    for name in config.methods:
        rows = by_method.get(name, [])
        if not rows:
            continue
        methods[name] = _method_summary(rows, by_method, config.dataset, references, fidelity_baseline, categories=True)
        engines = sorted({r["engine"] for r in rows if "engine" in r})
        if engines:  # a peer outside tierspec says what it ran (llama.cpp: version, weights, threads)
            methods[name]["engine"] = "; ".join(engines)
    from dataclasses import asdict

    summary = {"config": asdict(config), "methods": methods}
    if failures:
        summary["failures"] = failures
    workers: dict[str, dict] = {}
    for record in unique:
        if record.get("worker"):
            entry = workers.setdefault(record["worker"]["worker"], {"machine": machine_label(record["worker"]),
                                                                    "hosts": [], "records": 0})
            entry["records"] += 1
            if record["worker"]["host"] not in entry["hosts"]:
                entry["hosts"].append(record["worker"]["host"])
    if workers:
        summary["workers"] = workers
    by_machine: dict[str, list[dict]] = defaultdict(list)
    for record in unique:
        by_machine[machine_label(record.get("worker"))].append(record)
    if len(by_machine) > 1:  # speed-ups per machine, each against `ar` on that machine
        summary["machines"] = {}
        for label, rows in by_machine.items():
            here = _by_method(rows)
            summary["machines"][label] = {
                "workers": sorted({r["worker"]["worker"] for r in rows if r.get("worker")}),
                "records": len(rows),
                "methods": {name: _method_summary(here[name], here, config.dataset, references, fidelity_baseline,
                                                  categories=False)["overall"]
                            for name in config.methods if here.get(name)},
            }
    ar, hf = methods.get("ar"), methods.get("hf-greedy")
    if ar and hf:
        ar_tps, hf_tps = ar["overall"]["tokens_per_s"], hf["overall"]["tokens_per_s"]
        summary["baseline_check"] = {
            "ar_tokens_per_s": ar_tps,
            "hf_greedy_tokens_per_s": hf_tps,
            "ar_at_least_as_fast_as_hf_greedy": ar_tps >= hf_tps,
            "note": "speed-ups are against `ar`; if hf-greedy is faster they are inflated: use speedup_vs_best_plain",
        }
    return summary


def _fmt(value, digits=2):
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(summary: dict) -> str:
    methods = summary["methods"]
    categories = sorted({c for m in methods.values() for c in m["categories"]})
    config = summary["config"]
    lines = [
        f"Target `{config['target']}`, dataset `{config['dataset']}`, {config['max_new_tokens']} new tokens, "
        f"temperature {config['temperature']}, "
        f"γ = {config['num_draft'] if config.get('num_draft') is not None else 'each method’s own'}, "
        f"repeats {config['repeats']}. "
        "Speed-up = mean per-prompt tokens/s ÷ that of `ar` on the same prompts, same run.",
        "",
    ]
    if "ar" in methods:
        counts = ", ".join(f"{c} {methods['ar']['categories'][c]['n_prompts']}" for c in categories if c in methods["ar"]["categories"])
        lines += [f"Prompts measured per category: {counts} ({methods['ar']['overall']['n_prompts']} in all).", ""]
    for name, failure in summary.get("failures", {}).items():
        lines += [f"**`{name}` failed on {failure['prompts']} prompt(s)** (no records; a rerun tries them again): "
                  + "; ".join(failure["reasons"]), ""]
    check = summary.get("baseline_check")
    if check:
        flag = "" if check["ar_at_least_as_fast_as_hf_greedy"] else " **⚠ hf-greedy is faster than ar: speed-ups vs ar are inflated; see 'vs best plain'.**"
        lines += [f"Plain decoding: `ar` {check['ar_tokens_per_s']:.2f} tok/s, `hf-greedy` {check['hf_greedy_tokens_per_s']:.2f} tok/s.{flag}", ""]
    header = ["method", "speed-up", "vs best plain", *categories, "tok/s", "τ", "rejection", "target calls/tok", "slim calls/tok",
              "fidelity EM", "fidelity ROUGE-L", "target NLL"]
    extra = [m for m in ("gsm8k_exact_match", "humaneval_pass@1", "rouge_l", "bleu", "json_valid", "json_cut",
                         "json_answer_match")
             if any(m in v["overall"] for v in methods.values())]
    header += extra
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for name, result in methods.items():
        o = result["overall"]
        speedup = "–"
        if o["speedup"]:
            spread = f" ± {o['speedup_std']:.2f}" if o.get("speedup_std") is not None else ""
            speedup = f"{o['speedup']:.2f}{spread}×"
        row = [f"`{name}`", speedup, _fmt(o["speedup_vs_best_plain"])]
        row += [_fmt(result["categories"].get(c, {}).get("speedup")) for c in categories]
        row += [_fmt(o["tokens_per_s"], 1), _fmt(o["mean_accepted_tokens"]), _fmt(o["rejection_rate"]),
                _fmt(o["target_calls_per_token"]), _fmt(o["slim_calls_per_token"]),
                _fmt(o.get("fidelity_exact_match")), _fmt(o.get("fidelity_rouge_l")), _fmt(o["target_nll"], 3)]
        row += [_fmt(o.get(m)) for m in extra]
        lines.append("| " + " | ".join(row) + " |")
    lines += _worker_lines(summary)
    against = (f"the `ar` output of the reference run `{config['fidelity_reference']}`" if config.get("fidelity_reference")
               else "`ar`'s output")
    if config.get("repeats", 1) > 1:
        lines += ["", f"Speed-up ± the standard deviation of the per-repeat speed-ups ({config['repeats']} repeats, each "
                  "repeat's mean tokens/s ÷ that of `ar` in the same repeat)."]
    lines += ["", "Per-category columns are speed-ups. τ = emitted tokens per full-target call; rejection = rejected / evaluated "
              f"draft tokens; fidelity = agreement with {against} on the same prompt (exact token match rate, ROUGE-L); "
              "target NLL = mean −log q per generated token. `–` = not applicable (transformers peers expose no draft statistics)."]
    if any(str(name).startswith("hf-") for name in summary.get("methods", {})):
        twin = config.get("implementation") == "tierspec"
        lines += ["", "`hf-*`: transformers' own `generate` algorithms on "
                  + ("a copy of the model on transformers' modules (tierspec's methods ran on its own Llama code)"
                     if twin else "the same model object") + ", with tierspec's linear kernels (`--kernels`; an "
                  "algorithm-to-algorithm comparison); `hf-*-stock`: the same on a copy with stock `nn.Linear` modules, "
                  "what a user who picks transformers runs."]
    trees = {name: result["overall"] for name, result in methods.items() if result["overall"].get("nodes_per_pass")}
    if trees:  # token-tree methods (docs/algorithms.md §Token trees): what a pass checked and what survived, by depth
        lines += ["", "| tree method | nodes per pass | largest | depth (mean) | accepted per cycle | acceptance by depth 1–6 |",
                  "|---|---|---|---|---|---|"]
        for name, o in trees.items():
            by_depth = ", ".join(_fmt(a) for a in (o.get("acceptance_by_depth") or [])[:6])
            lines.append(f"| `{name}` | {_fmt(o['nodes_per_pass'], 1)} | {o['max_nodes']} | {_fmt(o['tree_depth_mean'])} | "
                         f"{_fmt(o['accepted_per_cycle'])} | {by_depth} |")
        lines += ["", "Acceptance by depth d: of the cycles whose walk reached depth d − 1 with children to try, the share "
                  "that accepted one of them."]
    timed = {name: result["overall"] for name, result in methods.items()
             if result["overall"].get("pass_time_share") and result["overall"].get("tokens_per_s")}  # peers time no passes
    if timed:  # tierspec's own loop: where a generation's time goes
        grammar = any(o.get("grammar_time_share") for o in timed.values())
        lines += ["", "| where the time goes | ms per token | drafting |" + (" grammar |" if grammar else "")
                  + " verifier passes | rest of the loop |", "|---|---|---|" + ("---|" if grammar else "") + "---|---|"]
        for name, o in timed.items():
            draft, passes = o.get("draft_time_share") or 0.0, o["pass_time_share"]
            constraint = o.get("grammar_time_share") or 0.0
            lines.append(f"| `{name}` | {_fmt(1000 / o['tokens_per_s'], 1)} | {_fmt(draft)} | "
                         + (f"{_fmt(constraint)} | " if grammar else "")
                         + f"{_fmt(passes)} | {_fmt(max(0.0, 1 - draft - constraint - passes))} |")
        lines += ["", "Shares of the generations' wall time: drafting (the drafter's proposal and the policy's trim), "
                  + ("the grammar's own work (its masks, the drafts it cuts, its forced tokens, advancing it by the "
                     "committed tokens; applying the masks to the logits is part of verification), " if grammar else "")
                  + "the verifier passes of the draft–verify cycles (the target's and slim verifier's forward calls "
                  "alone), and the rest (the prompt's prefill, verification rules, commit, rollback, the policy's "
                  "learning)."]
    engines = {name: result["engine"] for name, result in methods.items() if name.startswith("llamacpp-") and "engine" in result}
    if engines:
        ran = "; ".join(f"`{name}`: {engine}" for name, engine in engines.items())
        lines += ["", f"`llamacpp-*`: llama.cpp on the target's GGUF file ({ran}), fed the same prompt token ids, timed "
                  "the same way. It computes with the file's quantised weights and rounds each row of activations to "
                  "8 bits per block of 32, so its text may part from `ar`'s: its fidelity columns measure that "
                  "quantisation and llama.cpp's own order of sums, not a fault (tierspec's engine rounds rows the same "
                  "way under `--dtype auto` on a CPU with int8 dot products, AVX2 and up, with its own sums, float32 "
                  "attention and a float16 cache; `--dtype float32` keeps float32 rows)"
                  + (". Above temperature 0 it samples with its own sampler chain (top-k and top-p before the "
                     "temperature) and random stream." if config.get("temperature") else ".")
                  + " `llamacpp-lookup`'s τ and rejection come from the prompt-lookup proposals and the tokens "
                  "emitted (llama.cpp reports none); its greedy text may part from `llamacpp-greedy`'s at near-ties, "
                  "since llama.cpp's logits shift slightly with the number of tokens in a pass."]
    engines = {name: result["engine"] for name, result in methods.items() if name.startswith("ov-") and "engine" in result}
    if engines:
        ran = "; ".join(f"`{name}`: {engine}" for name, engine in engines.items())
        lines += ["", f"`ov-*`: OpenVINO GenAI's LLMPipeline reading the target's GGUF file itself ({ran}), fed the same "
                  "prompt token ids, timed the same way. Its GGUF reader stores each Q4_1 block's minimum as a 4-bit "
                  "zero point rounded from −m/d, so it computes with weights off the file's (by ~9% of their mean "
                  "magnitude on the default model) and its text may part from `ar`'s early: its fidelity and NLL "
                  "columns measure that, not a fault"
                  + (". Above temperature 0 it samples with its own sampler and random stream." if config.get("temperature")
                     else ".")
                  + " OpenVINO reports no draft statistics, so `ov-lookup` has no τ."]
    return "\n".join(lines) + "\n"


def _worker_lines(summary: dict) -> list[str]:
    """Who made the records, where more than one worker did; per-machine speed-ups where the
    records come from more than one machine."""
    lines = []
    workers = summary.get("workers", {})
    if len(workers) > 1:
        shown = "; ".join(f"`{name}` ({', '.join(w['hosts'])}: {w['machine']}) {w['records']}"
                          for name, w in sorted(workers.items()))
        lines += ["", f"Records per worker: {shown}."]
    machines = summary.get("machines")
    if machines:
        labels = list(machines)
        lines += ["", "The records come from more than one machine; speed-up on each (tok/s, prompts), against `ar` "
                  "on the same machine:", "", "| method | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
        for name in summary["methods"]:
            cells = []
            for label in labels:
                o = machines[label]["methods"].get(name)
                speedup = f"{_fmt(o['speedup'])}×" if o and o["speedup"] else "–"
                cells.append("–" if o is None else f"{speedup} ({_fmt(o['tokens_per_s'], 1)}, {o['n_prompts']})")
            lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return lines


def write_report(summary: dict, records: list[dict], out: Path) -> None:
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    atomic_write_text(out / "summary.md", markdown_table(summary))
    plot(summary, out)


def faster_than_every_as_faithful(point: dict, others: list[dict], key: str, higher_is_better: bool) -> bool | None:
    """Whether ``point`` is faster (``speedup``) than every one of ``others`` whose fidelity
    ``key`` is equal or better — the frontier question VIA-SD must answer against two-tier
    rules. None when ``point`` lacks the metric."""
    if point.get(key) is None:
        return None
    as_faithful = [o for o in others if o.get(key) is not None
                   and (o[key] >= point[key] if higher_is_better else o[key] <= point[key])]
    return all(point["speedup"] > o["speedup"] for o in as_faithful)


def short_label(spec: str, width: int | None = 32) -> str:
    """A label for a method spec: file paths shortened to the last part of their stem
    (masks/smollm2-135m-sublayer-r0.1.json → r0.1), then cut to ``width`` characters (None: never)."""
    name, *params = spec.split(":")
    shown = []
    for param in params:
        key, _, value = param.partition("=")
        if "/" in value or value.endswith(".json"):
            value = Path(value).stem.split("-")[-1]
        shown.append(f"{key}={value}")
    label = name + (f"({','.join(shown)})" if shown else "")
    return label if width is None or len(label) <= width else label[: width - 1] + "…"


def method_labels(names: list[str]) -> dict[str, str]:
    """Plot labels for method specs, whole (``short_label`` without a cut), and distinct: specs
    whose shortened labels coincide (two heads both called head.safetensors) are shown in full."""
    labels = {name: short_label(name, None) for name in names}
    counts = Counter(labels.values())
    return {name: label if counts[label] == 1 else name for name, label in labels.items()}


# Hollow markers of distinct shapes: methods on the same spot (every lossless method has ar's
# text) stay visible. Shape and colour cycle with coprime periods: no two of 70 methods share both.
MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def _method_styles(names: list[str], plt) -> dict[str, dict]:
    return {name: {"marker": MARKERS[i % len(MARKERS)], "edgecolors": plt.cm.tab10(i % 10)}
            for i, name in enumerate(names)}


def quality_panels(points: dict[str, dict], panels: list[tuple[str, str]], title: str, path: Path,
                   xlabel: str = "speed-up vs ar") -> None:
    """One panel per (key, axis label) of ``panels``: each point of ``points`` (label → a dict
    with ``speedup`` and the keys) at (speedup, value), as a hollow marker of its own shape and
    colour, every point named in one legend below the panels — labels written beside the points
    would print over each other where methods land on the same spot, and long ones would be cut."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = _method_styles(list(points), plt)
    longest = max(map(len, points), default=0)
    ncol = 3 if longest <= 40 else 2 if longest <= 75 else 1
    legend_inches = 0.25 + 0.17 * math.ceil(len(points) / ncol)
    fig, axes = plt.subplots(1, len(panels), figsize=(12, 4.2 + legend_inches), squeeze=False)
    handles = {}
    for ax, (key, label) in zip(axes[0], panels):
        for name, point in points.items():
            if point.get("speedup") and point.get(key) is not None:
                handles[name] = ax.scatter(point["speedup"], point[key], facecolors="none", linewidths=1.3, s=50,
                                           **styles[name])
        ax.axvline(1.0, color="grey", linewidth=0.6, linestyle=":")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
    fig.suptitle(title)
    shown = [name for name in points if name in handles]
    fig.legend([handles[name] for name in shown], shown, loc="lower center", ncol=ncol, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, legend_inches / (4.2 + legend_inches), 1, 1))
    _save_figure(fig, path)
    plt.close(fig)


def _row_labels(ax, labels: list[str]) -> None:
    """Methods as rows, top to bottom in the run's order, labels whole."""
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylim(len(labels) - 0.5, -0.5)


def plot(summary: dict, out: Path) -> None:
    """``speedup_by_category.png`` (a table of speed-ups coloured around 1.0),
    ``quality_vs_speedup.png`` (``quality_panels``) and
    ``tier_fractions.png`` (stacked shares per method); every method is named in full."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    methods = summary["methods"]
    names = list(methods)
    labels = method_labels(names)
    categories = sorted({c for m in methods.values() for c in m["categories"]})
    columns = categories + ["overall"]

    # Speed-up by method and category: the numbers themselves, in cells coloured red below ar and green above.
    speedups = [[(methods[n]["overall"] if c == "overall" else methods[n]["categories"].get(c, {})).get("speedup")
                 for c in columns] for n in names]
    grid = [[math.nan if v is None else v for v in row] for row in speedups]
    known = [v for row in grid for v in row if not math.isnan(v)] or [1.0]
    spread = max(max(abs(v - 1.0) for v in known), 0.05)
    fig, ax = plt.subplots(figsize=(2.5 + 0.9 * len(columns) + 0.05 * max(map(len, labels.values())),
                                    1.2 + 0.3 * len(names)))
    ax.imshow(grid, cmap="RdYlGn", norm=TwoSlopeNorm(1.0, 1.0 - spread, 1.0 + spread), aspect="auto")
    for i, row in enumerate(speedups):
        for j, value in enumerate(row):
            ax.text(j, i, "–" if value is None else f"{value:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(columns)), columns, fontsize=7, rotation=20, ha="right")
    _row_labels(ax, [labels[n] for n in names])
    ax.set_title("Speed-up vs ar by category (green: faster than ar)", fontsize=9)
    fig.tight_layout()
    _save_figure(fig, out / "speedup_by_category.png")
    plt.close(fig)

    quality_panels({labels[n]: methods[n]["overall"] for n in names},
                   [("target_nll", "target NLL per token (lower = closer to target)"),
                    ("fidelity_rouge_l", "ROUGE-L vs ar output")],
                   "Quality against speed-up", out / "quality_vs_speedup.png")

    # Which tier decided each emitted token: stacked shares, one row per method that reports tiers.
    tiered = [n for n in names if methods[n]["overall"].get("tier_fractions")]
    fig, ax = plt.subplots(figsize=(7 + 0.05 * max(map(len, labels.values())), 1.4 + 0.3 * max(len(tiered), 1)))
    lefts = [0.0] * len(tiered)
    for tier in ("drafter", "judge", "slim", "target"):
        values = [methods[n]["overall"]["tier_fractions"].get(tier, 0.0) for n in tiered]
        ax.barh(range(len(tiered)), values, left=lefts, label=tier)
        lefts = [b + v for b, v in zip(lefts, values)]
    _row_labels(ax, [labels[n] for n in tiered])
    ax.set_xlabel("fraction of emitted tokens")
    ax.set_title("Which tier decided each emitted token", fontsize=9)
    ax.legend(fontsize=7, ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.06), frameon=False)
    fig.tight_layout()
    _save_figure(fig, out / "tier_fractions.png")
    plt.close(fig)


def _save_figure(fig, path: Path) -> None:
    """``fig`` as a PNG at ``path``, written atomically (a stopped run leaves the old plot or the new one)."""
    atomic_write(path, lambda staging: fig.savefig(staging, dpi=120, format="png"))
