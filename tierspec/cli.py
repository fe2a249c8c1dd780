"""Command line: ``tierspec generate [PROMPT]`` (and the other sub-commands as they land)."""

from __future__ import annotations

import argparse
import json
import sys

from .methods import DEFAULT_METHOD, method_names
from .models import DEFAULT_MODEL


def _add_generate(sub) -> None:
    parser = sub.add_parser(
        "generate",
        help="generate text from a prompt, streaming to stdout",
        description="Generate a completion with speculative decoding. Text streams to stdout.",
    )
    parser.add_argument("prompt", nargs="?", help="the prompt (read from stdin when omitted)")
    parser.add_argument(
        "--method",
        default=DEFAULT_METHOD,
        help=f"decoding method: {', '.join(method_names())} (default {DEFAULT_METHOD}, the fastest lossless one)",
    )
    parser.add_argument("--target", default=DEFAULT_MODEL, help="target model: HF folder, .gguf file or smollm2-135m")
    parser.add_argument("--drafter", default=None, help="drafter model for sd (default: the target drafts for itself)")
    parser.add_argument("--num-draft", type=int, default=5, help="tokens drafted per cycle (γ)")
    parser.add_argument("--ngram-size", type=int, default=3, help="prompt lookup: longest n-gram matched")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampling generator")
    parser.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    parser.add_argument("--mask", default=None, help="routing mask JSON from `tierspec route` (self, via)")
    parser.add_argument(
        "--confidence-threshold", type=float, default=0.8,
        help="self/swift: stop drafting when the draft's top probability falls below this",
    )
    parser.add_argument("--stats", action="store_true", help="print statistics as one JSON line on stderr")
    parser.set_defaults(run=_run_generate)


def _add_route(sub) -> None:
    parser = sub.add_parser(
        "route",
        help="search a routing mask for the slim verifier / self-drafter (DIMR)",
        description="DIMR: random search with periodic Bayesian optimisation over routing masks, minimising the "
        "KL-style cost of the masked target against the full target on calibration text. Resumable: rerun the "
        "same command after an interruption.",
    )
    parser.add_argument("--target", default=DEFAULT_MODEL)
    parser.add_argument("--ratio", type=float, default=0.45, help="fraction of units bypassed (r)")
    parser.add_argument("--unit", choices=["layer", "sublayer"], default="sublayer")
    parser.add_argument("--budget", type=int, default=100, help="mask evaluations at most (S)")
    parser.add_argument("--bo-every", type=int, default=2, help="a Bayesian-optimisation step every θ evaluations")
    parser.add_argument("--patience", type=int, default=40, help="stop after this many evaluations without improvement")
    parser.add_argument("--objective", choices=["kl", "agreement"], default="kl", help="kl: DIMR cost; agreement: SWIFT's")
    parser.add_argument("--strategy", choices=["dimr", "random"], default="dimr", help="random: random search alone")
    parser.add_argument("--alpha", type=float, default=0.0, help="cost tolerance α")
    parser.add_argument("--beta", type=float, default=1.0, help="cost tolerance β")
    parser.add_argument("--calibration-prompts", type=int, default=8, help="prompts sampled from the data folder")
    parser.add_argument("--calibration-file", default=None, help="your own prompts: a text file, one per line, or JSONL with 'prompt'")
    parser.add_argument("--data-dir", default=None, help="evaluation data folder (default ../shared/data)")
    parser.add_argument("--window", type=int, default=32, help="τ: scored positions per calibration sequence")
    parser.add_argument("--context", type=int, default=32, help="prompt tokens kept before each window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="where to write the mask JSON (atomically)")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(run=_run_route)


def _read_calibration_file(path: str) -> list[str]:
    from pathlib import Path

    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    prompts = []
    for line in lines:
        if line.lstrip().startswith("{"):
            record = json.loads(line)
            prompts.append(record.get("prompt") or record.get("text") or record["turns"][0])
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"calibration file {path} holds no prompt")
    return prompts


def _run_route(args) -> int:
    from pathlib import Path

    from .data import calibration_prompts
    from .models import load_model
    from .search import SearchConfig, build_calibration, search_mask

    config = SearchConfig(
        ratio=args.ratio, unit=args.unit, budget=args.budget, bo_every=args.bo_every, patience=args.patience,
        objective=args.objective, strategy=args.strategy, alpha=args.alpha, beta=args.beta, seed=args.seed,
    )
    target = load_model(args.target)
    if args.calibration_file:
        prompts = _read_calibration_file(args.calibration_file)
    else:
        prompts = calibration_prompts(args.calibration_prompts, Path(args.data_dir) if args.data_dir else None, args.seed)
    calibration = build_calibration(target, prompts, args.context, args.window, progress=not args.no_progress)
    out = Path(args.out)
    checkpoint = out.with_name(out.name + ".partial.json")
    result = search_mask(target, calibration, config, checkpoint=checkpoint, progress=not args.no_progress)
    result.mask.save(out)
    checkpoint.unlink(missing_ok=True)
    summary = result.summary()
    print(
        f"best cost {summary['best_cost']:.4f} (greedy agreement {summary['best_agreement']:.3f}) after "
        f"{summary['evaluations']} evaluations ({summary['bo_evaluations']} Bayesian) in {summary['seconds']:.1f} s"
    )
    if summary["random_best_cost"] is not None:
        print(
            f"random-search evaluations alone: best cost {summary['random_best_cost']:.4f}, "
            f"mean cost {summary['random_mean_cost']:.4f}, best agreement {summary['random_best_agreement']:.3f}"
        )
    print(f"mask written to {out}: {len(result.mask.bypassed_units())} {args.unit} units bypassed")
    return 0


def _run_generate(args) -> int:
    from .api import stream
    from .decode import GenerationStats
    from .methods import MethodOptions, UnknownMethodError
    from .models import load_model
    from .routing import RoutingMask

    if args.method not in method_names():
        raise UnknownMethodError(f"unknown method '{args.method}'; choose one of: {', '.join(method_names())}")
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    target = load_model(args.target)
    drafter = load_model(args.drafter) if args.drafter else None
    mask = RoutingMask.load(args.mask, target.identity) if args.mask else None
    stats = GenerationStats()
    for piece in stream(
        prompt,
        target=target,
        method=args.method,
        drafter=drafter,
        num_draft=args.num_draft,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        chat_template=not args.no_chat_template,
        options=MethodOptions(ngram_size=args.ngram_size, mask=mask, confidence_threshold=args.confidence_threshold),
        stats=stats,
    ):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.stats:
        print(json.dumps({"method": args.method, **stats.to_dict()}), file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierspec", description="Speculative decoding for Hugging Face causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_route(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError, FileNotFoundError) as error:
        print(f"tierspec: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
