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
    parser.add_argument("--stats", action="store_true", help="print statistics as one JSON line on stderr")
    parser.set_defaults(run=_run_generate)


def _run_generate(args) -> int:
    from .api import stream
    from .decode import GenerationStats
    from .methods import MethodOptions, UnknownMethodError
    from .models import load_model

    if args.method not in method_names():
        raise UnknownMethodError(f"unknown method '{args.method}'; choose one of: {', '.join(method_names())}")
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    target = load_model(args.target)
    drafter = load_model(args.drafter) if args.drafter else None
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
        options=MethodOptions(ngram_size=args.ngram_size),
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
