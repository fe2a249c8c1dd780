"""Command line: ``tierspec generate [PROMPT]`` (and the other sub-commands as they land)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .methods import DEFAULT_METHOD, DEFAULT_METHOD_WITHOUT_HEAD, method_names
from .limits import check_num_draft
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
        default=None,
        help=f"decoding method: {', '.join(method_names())} (default: {DEFAULT_METHOD}, the fastest lossless one, where "
        f"a draft head exists for the target; else {DEFAULT_METHOD_WITHOUT_HEAD})",
    )
    parser.add_argument("--target", default=DEFAULT_MODEL, help="target model: HF folder, .gguf file, smollm2-135m or gemma3-270m")
    _add_model_flags(parser)
    parser.add_argument("--drafter", default=None, help="drafter model for sd (default: the target drafts for itself)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=None,
                        help="fixes the sampled text: the same seed, prompt, method and settings give the same text "
                        "(README: Same seed, same text); default: a fresh seed")
    parser.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    structured = parser.add_argument_group("structured output (at most one; a lossless method keeps ar's text)")
    structured.add_argument("--json-schema", default=None, metavar="FILE|JSON",
                            help="the text is JSON valid against this schema (a file, or the schema as JSON text)")
    structured.add_argument("--json", action="store_true", help="the text is a JSON object")
    structured.add_argument("--regex", default=None, help="the text matches this regular expression whole")
    structured.add_argument("--grammar", default=None, metavar="FILE", help="the text follows this Lark grammar")
    _add_method_options(parser)
    parser.add_argument("--stats", action="store_true", help="print statistics as one JSON line on stderr")
    parser.set_defaults(run=_run_generate)


def _structured_flags(args) -> dict:
    """--json-schema / --json / --regex / --grammar as ``generate``'s keywords, the spec checked
    (before any model is loaded: a bad schema is a one-line error)."""
    from .api import grammar_spec
    from .errors import PromptError

    schema = args.json_schema
    if schema is not None:
        path = Path(schema)
        if not schema.lstrip().startswith(("{", "[", "true", "false")):
            if not path.is_file():
                raise PromptError(f"--json-schema: {schema} is neither a file nor a JSON schema")
            schema = path.read_text(encoding="utf-8")
    grammar = None
    if args.grammar is not None:
        if not Path(args.grammar).is_file():
            raise PromptError(f"--grammar: no such file {args.grammar}")
        grammar = Path(args.grammar).read_text(encoding="utf-8")
    given = {"json_schema": schema, "json_object": args.json, "regex": args.regex, "grammar": grammar}
    grammar_spec(**given)
    return given


def _add_model_flags(parser) -> None:
    """--dtype, --device, --kernels and --implementation: how every command that loads a model loads it."""
    from .models import DEVICES, DTYPES, IMPLEMENTATIONS, KERNELS

    group = parser.add_argument_group("model loading")
    group.add_argument("--dtype", default="auto", choices=list(DTYPES),
                       help="what the linear layers compute in (the residual stream, attention and logits stay float32): "
                            "for a GGUF model on its own blocks (--kernels gguf), the rows the 4/8-bit weights multiply; "
                            "otherwise the decoder layers' weights. auto = for a GGUF model on the engine int8 rows "
                            "where the CPU has int8 dot products (AVX2 and up: vpmaddubsw, AVX512-VNNI, AMX), float32 rows "
                            "on other CPUs (docs/engine.md: their measured fidelity); for "
                            "other models bfloat16 on a CPU with native bfloat16 products (AVX512-BF16), float32 "
                            "elsewhere (default auto)")
    group.add_argument("--device", default="cpu", choices=list(DEVICES),
                       help="where the model runs; auto = cuda, else mps, else cpu (default cpu)")
    group.add_argument("--kernels", default="auto", choices=list(KERNELS),
                       help="linear kernels: gguf (a GGUF file's own Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K blocks on tierspec's pass engine, "
                            "each layer one call; CPU), packed (de-quantised weights packed once for oneDNN; CPU), "
                            "few-row (CPU), stock nn.Linear; auto = gguf for a GGUF file of native types, else packed "
                            "on a CPU that supports it, few-row on other CPUs, stock elsewhere")
    group.add_argument("--implementation", default="auto", choices=list(IMPLEMENTATIONS),
                       help="model code: tierspec's own Llama forward pass (starts 2-3 s sooner, same results) or "
                            "transformers' modules; auto = tierspec's wherever it covers the architecture")


def _add_ray_flags(parser, unit: str) -> None:
    """--ray and the width of a run on a Ray cluster (commands whose work shares out by ``unit``)."""
    group = parser.add_argument_group("Ray cluster (pip install 'tierspec[ray]')")
    group.add_argument("--ray", default=None, metavar="ADDRESS",
                       help=f"share the {unit}s out to Ray workers, each loading the models once (by path: the same "
                            "files on every node); this process writes every result. ADDRESS: local (a cluster "
                            "started for this run, on the loopback address), auto (the cluster this machine joined "
                            "with `ray start`), or HOST:PORT of its head")
    group.add_argument("--ray-workers", type=int, default=None, metavar="N",
                       help="workers (default: as many as the cluster's CPUs hold at --ray-cpus each, or its GPUs "
                            "at --ray-gpus)")
    group.add_argument("--ray-cpus", type=int, default=1, metavar="C",
                       help="CPUs each worker reserves, and its torch threads (default 1)")
    group.add_argument("--ray-gpus", type=float, default=0.0, metavar="G",
                       help="GPUs each worker reserves: 1 on a GPU cluster, with --device cuda (default 0)")
    group.add_argument("--ray-tries", type=int, default=3, metavar="T",
                       help=f"tries of a {unit} (its worker lost, or an error) before it is reported as failed "
                            "(default 3)")


def _cluster(args):
    """The ClusterConfig the --ray flags ask for, or None; --ray-* without --ray is refused."""
    from .cluster import ClusterConfig, ClusterError

    if args.ray is None:
        defaults = (("--ray-workers", args.ray_workers, None), ("--ray-cpus", args.ray_cpus, 1),
                    ("--ray-gpus", args.ray_gpus, 0.0), ("--ray-tries", args.ray_tries, 3))
        given = [flag for flag, value, default in defaults if value != default]
        if given:
            raise ClusterError(f"{', '.join(given)} without --ray: add --ray local (or auto, or the cluster's address)")
        return None
    return ClusterConfig(args.ray, args.ray_workers, args.ray_cpus, args.ray_gpus, args.ray_tries)


def _load(args, spec, implementation: str | None = None):
    """``load_model(spec)`` with the command's --dtype/--device/--kernels/--implementation."""
    from .models import load_model

    return load_model(spec, args.dtype, args.device, args.kernels, implementation or args.implementation)


def _check_model_flags(args) -> None:
    """--dtype with --device (float16 on a CPU) and --num-draft's bound, refused before anything loads."""
    from .models import check_dtype_for_device, resolve_device, resolve_dtype

    device = resolve_device(args.device)
    check_dtype_for_device(resolve_dtype(args.dtype, device), device)
    check_num_draft(getattr(args, "num_draft", None), "--num-draft")


def _check_generation_budget(max_new_tokens: int, target_spec: str) -> None:
    """--max-new-tokens against 1 and, where the model's config can be read without loading the
    model, its context: refused before the model loads (and before any cost table is measured)."""
    from .errors import PromptError

    if max_new_tokens < 1:
        raise PromptError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    context = _known_context(target_spec)
    if context is not None and max_new_tokens >= context:
        raise PromptError(f"--max-new-tokens {max_new_tokens} does not fit the model's context of {context} positions "
                          "(with the prompt)")


def _known_context(spec: str) -> int | None:
    """The model's context length from a config.json beside it (an HF folder, or the default
    model's converted copy when it exists); None when it cannot be read cheaply."""
    from pathlib import Path

    from .models import DEFAULT_MODEL

    folder = Path(spec)
    if spec == DEFAULT_MODEL:
        try:
            from .gguf_cache import gguf_cache_dir
            from .models import default_model_file

            folder = gguf_cache_dir(default_model_file())
        except Exception:  # not installed: the load reports it
            return None
    try:
        config = json.loads((folder / "config.json").read_text())
        return int(config["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _flag(option) -> str:
    return option.metadata.get("flag") or "--" + option.name.replace("_", "-")


def _add_method_options(parser) -> None:
    """One flag per ``MethodOptions`` field, with the default and help declared there."""
    from .methods import option_fields

    group = parser.add_argument_group("method parameters")
    for option in option_fields():
        kind = option.metadata.get("kind")
        text = str(option.type)
        convert = str if kind else (int if "int" in text else float if "float" in text else str)
        default = option.default
        help_text = option.metadata["help"] + ("" if default is None or kind else f" (default {default})")
        group.add_argument(_flag(option), dest=option.name, type=convert, default=None if kind else default,
                           choices=option.metadata.get("choices"), help=help_text)


def method_options(args, target):
    """MethodOptions from parsed flags; masks and heads are loaded and checked against ``target``."""
    from .methods import MethodOptions, option_fields
    from .layerskip.masks import RoutingMask

    values = {}
    for option in option_fields():
        value = getattr(args, option.name)
        kind = option.metadata.get("kind")
        if value is not None and kind == "mask":
            value = RoutingMask.load(value, target.identity)
        elif value is not None and kind == "judge_head":
            from .heads.judge import JudgeHead

            value = JudgeHead.load(value, target.identity)
        elif value is not None and kind == "draft_head":
            from .heads.draft import DraftHead

            value = DraftHead.load(value, target)
        values[option.name] = value
    return MethodOptions(**values)


CALIBRATION_PROMPTS = 8  # the mask search's calibration prompts drawn from the data folder by default


def _add_route(sub) -> None:
    parser = sub.add_parser(
        "route",
        help="search a routing mask for the slim verifier / self-drafter (DIMR)",
        description="DIMR: random search with periodic Bayesian optimisation over routing masks, minimising the "
        "KL-style cost of the masked target against the full target on calibration text. Resumable: rerun the "
        "same command after an interruption.",
    )
    parser.add_argument("--target", default=DEFAULT_MODEL)
    _add_model_flags(parser)
    parser.add_argument("--ratio", type=float, default=0.45, help="fraction of units bypassed (r), or of a pass's "
                        "measured cost with --ratio-by compute")
    parser.add_argument("--ratio-by", default="units", choices=["units", "compute"],
                        help="units: round(r·U) units; compute: units whose measured per-unit cost (attention / MLP "
                        "sub-layer, cached per machine) sums to r of a full pass")
    parser.add_argument("--unit", choices=["layer", "sublayer"], default="sublayer")
    parser.add_argument("--budget", type=int, default=100, help="mask evaluations at most (S)")
    parser.add_argument("--bo-every", type=int, default=2, help="a Bayesian-optimisation step every θ evaluations")
    parser.add_argument("--patience", type=int, default=40, help="stop after this many evaluations without improvement")
    parser.add_argument("--objective", choices=["kl", "agreement"], default="kl", help="kl: DIMR cost; agreement: SWIFT's")
    parser.add_argument("--strategy", choices=["dimr", "random"], default="dimr", help="random: random search alone")
    parser.add_argument("--alpha", type=float, default=0.0, help="cost tolerance α")
    parser.add_argument("--beta", type=float, default=1.0, help="cost tolerance β")
    parser.add_argument("--calibration-prompts", type=int, default=CALIBRATION_PROMPTS,
                        help="prompts sampled from the data folder")
    parser.add_argument("--calibration-file", default=None, help="your own prompts: a text file, one per line, or JSONL with 'prompt'")
    parser.add_argument("--data-dir", default=None, help="evaluation data folder (default: the copy shipped in the package, or $TIERSPEC_DATA)")
    parser.add_argument("--window", type=int, default=32, help="τ: scored positions per calibration sequence")
    parser.add_argument("--context", type=int, default=32, help="prompt tokens kept before each window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="where to write the mask JSON (atomically)")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(run=_run_route, resume_hint="; rerun the same command to resume the search")


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
        from .errors import TierspecError

        raise TierspecError(f"calibration file {path} holds no prompt")
    return prompts


def _at_least(flags: dict[str, int], least: int = 1) -> None:
    """Refuse a count below ``least`` (a negative count was a traceback, 0 an empty output with exit 0)."""
    from .errors import TierspecError

    for flag, value in flags.items():
        if value < least:
            raise TierspecError(f"{flag} must be at least {least}, got {value}")


def _output_file(path: str) -> None:
    """Refuse an --out that is a folder before the work (it was refused at the write, after it all)."""
    from pathlib import Path

    from .errors import TierspecError

    if Path(path).is_dir():
        raise TierspecError(f"--out {path} is a folder; give the file's path")


def _holding_file(path: str, job: str, what: str):
    """A lock on the output file ``path`` of ``job`` (``tierspec route``, ...), held while the job
    runs: a second run into it is refused at once with the first's pid (``util.exclusive_lock``);
    the lock file sits beside it, named for the job."""
    from pathlib import Path

    from .util import exclusive_lock

    out = Path(path)
    return exclusive_lock(out.with_name(f".{out.name}.{job.split()[-1]}.lock"), f"the {what} {out}", job)


def _check_route_flags(args) -> None:
    """The mask search's flags, refused before the model and the calibration text are loaded: a
    bad count was a traceback after them, an output folder an error after the whole search, and a
    flag the chosen search does not read would change nothing."""
    from .errors import TierspecError
    from .layerskip.search import SearchConfig

    defaults = SearchConfig()
    _at_least({"--budget": args.budget, "--bo-every": args.bo_every, "--patience": args.patience,
               "--calibration-prompts": args.calibration_prompts, "--window": args.window, "--context": args.context})
    moot = []
    if args.calibration_file is not None:
        moot += [f"{flag} (--calibration-file gives the prompts)" for flag, given in (
            ("--calibration-prompts", args.calibration_prompts != CALIBRATION_PROMPTS),
            ("--data-dir", args.data_dir is not None)) if given]
    if args.strategy == "random" and args.bo_every != defaults.bo_every:
        moot.append("--bo-every (--strategy random takes no Bayesian-optimisation step)")
    if args.objective == "agreement" and (args.alpha, args.beta) != (defaults.alpha, defaults.beta):
        moot.append("--alpha / --beta (they weigh the KL cost; --objective agreement chooses by greedy agreement)")
    if moot:
        raise TierspecError(f"these flags would change nothing here: {'; '.join(moot)}")
    _output_file(args.out)


def _run_route(args) -> int:
    from pathlib import Path

    from .layerskip.search import SearchConfig

    _check_route_flags(args)
    config = SearchConfig(
        ratio=args.ratio, ratio_by=args.ratio_by, unit=args.unit, budget=args.budget, bo_every=args.bo_every, patience=args.patience,
        objective=args.objective, strategy=args.strategy, alpha=args.alpha, beta=args.beta, seed=args.seed,
    )
    out = Path(args.out)
    # One search per mask file (its progress is out + .partial.json): a second is refused at once.
    with _holding_file(args.out, "tierspec route", "mask file"):
        return _route_into(args, config, out)


def _route_into(args, config, out) -> int:
    """The mask search into ``out`` (its lock held): the model, the calibration text, the search."""
    from pathlib import Path

    from .data import calibration_prompts
    from .layerskip.search import search_mask
    from .training.calibration import build_calibration

    target = _load(args, args.target)
    if args.calibration_file:
        prompts = _read_calibration_file(args.calibration_file)
    else:
        from .data import task_calibration_prompts
        from .seq2seq import is_encoder_decoder

        sample = task_calibration_prompts if is_encoder_decoder(target.model) else calibration_prompts  # T5's task format
        prompts = sample(args.calibration_prompts, Path(args.data_dir) if args.data_dir else None, args.seed)
    calibration = build_calibration(target, prompts, args.context, args.window, progress=not args.no_progress)
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


def read_prompt(argument: str | None) -> str:
    """The prompt from argv or stdin, refused with a clear message unless it is UTF-8 text."""
    from .api import check_text

    if argument is not None:
        return check_text(argument)
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        from .errors import PromptError

        raise PromptError(f"the prompt on stdin is not valid UTF-8 (byte {error.start}); give UTF-8 input") from None


def _run_generate(args) -> int:
    from .api import stream
    from .methods import check_method_name, default_method
    from .sampling import SamplingConfig

    if args.method is not None:
        check_method_name(args.method)
    # Refuse bad values before loading anything (a load and a cost table take 10-56 s).
    SamplingConfig(args.temperature, args.top_k, args.top_p)
    _check_filters_sample(args)
    _check_model_flags(args)
    _check_generation_budget(args.max_new_tokens, args.target)
    structured = _structured_flags(args)
    prompt = read_prompt(args.prompt)
    if not prompt.strip():
        from .errors import PromptError

        raise PromptError("the prompt is empty: give some text")
    target = _load(args, args.target)
    drafter = _load(args, args.drafter) if args.drafter else None
    options = method_options(args, target)
    method = args.method or default_method(target, options)
    text_stream = stream(
        prompt,
        target=target,
        method=method,
        drafter=drafter,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        chat_template=not args.no_chat_template,
        options=options,
        **structured,
    )
    with text_stream.held():  # between the pieces only writes to stdout: no torch
        for piece in text_stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()  # here, where a closed pipe is caught (main), not at the interpreter's exit
    if args.stats:
        from .engine import kernel_report, runs_on_engine

        kernels = {"kernels": kernel_report()} if runs_on_engine(target.model) else {}
        print(json.dumps({"method": method, "finish_reason": text_stream.finish_reason,
                          **text_stream.stats.to_dict(), **kernels}), file=sys.stderr)
    constrained = any(value is not None and value is not False for value in structured.values())
    if constrained and text_stream.finish_reason == "length":  # incomplete: not valid under its constraint
        print(f"tierspec: the text stopped at --max-new-tokens {args.max_new_tokens} before its constraint was "
              "complete: it is not valid (raise --max-new-tokens)", file=sys.stderr)
        return 1
    return 0


def _add_serve(sub) -> None:
    parser = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /health)",
        description="Serve one model over OpenAI's HTTP API: requests from a bounded queue, their generations run "
        "together by one executor (--max-batch). A request may override the method with an extra body field 'method' "
        "and size its drafts with 'num_draft'; 'usage' carries the speculative statistics.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--method", default=None,
                        help=f"default method of requests that name none (default: {DEFAULT_METHOD} where a draft head "
                        f"exists for the target, else {DEFAULT_METHOD_WITHOUT_HEAD})")
    parser.add_argument("--target", default=DEFAULT_MODEL, help="model to serve: HF folder, .gguf file, smollm2-135m or gemma3-270m")
    _add_model_flags(parser)
    parser.add_argument("--drafter", default=None, help="drafter model for sd (default: the target drafts for itself)")
    parser.add_argument("--max-queue", type=int, default=8,
                        help="requests that may wait behind the running ones; more are answered 503 (default 8)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="generations run at once, one batched pass per cycle, each request still getting exactly "
                        "its solo text (default 8 for a model on the pass engine, else 1: one at a time)")
    parser.add_argument("--max-rows", type=int, default=None,
                        help="at most this many rows per batched pass: drafts are cut to fit, every generation keeps "
                        "its one row (default: no limit but what pays)")
    parser.add_argument("--max-request-bytes", type=int, default=None,
                        help="larger request bodies are answered 413 (default 1 MiB: a whole 8192-token prompt is "
                        "about 40 KB)")
    parser.add_argument("--body-timeout", type=float, default=None,
                        help="seconds a request body may take to arrive; a slower one is answered 408 and its "
                        "connection closed (default 30)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    _add_method_options(parser)
    parser.set_defaults(run=_run_serve)


def _run_serve(args) -> int:
    from .errors import TierspecError
    from .methods import check_method_name
    from .server import DEFAULT_MAX_REQUEST_BYTES, Scheduler, listen, serve, settle_heap
    from .server.app import DEFAULT_BODY_TIMEOUT

    if args.method is not None:
        check_method_name(args.method)
    _check_model_flags(args)
    if not 0 < args.port < 65536:
        raise TierspecError(f"--port must be in 1..65535, got {args.port}")
    if args.max_batch is not None and args.max_batch < 1:
        raise TierspecError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_rows is not None and args.max_rows < (args.max_batch or 1):
        raise TierspecError(f"--max-rows must be at least --max-batch (every generation needs its row), got {args.max_rows}")
    max_request_bytes = DEFAULT_MAX_REQUEST_BYTES if args.max_request_bytes is None else args.max_request_bytes
    if max_request_bytes < 1:
        raise TierspecError(f"--max-request-bytes must be >= 1, got {max_request_bytes}")
    body_timeout = DEFAULT_BODY_TIMEOUT if args.body_timeout is None else args.body_timeout
    if not 0 < body_timeout < float("inf"):
        raise TierspecError(f"--body-timeout must be a number of seconds > 0, got {args.body_timeout}")
    sock = listen(args.host, args.port)  # before loading anything: a port in use is reported at once
    try:
        target = _load(args, args.target)
        drafter = _load(args, args.drafter) if args.drafter else None
        from .engine import runs_on_engine

        max_batch = args.max_batch if args.max_batch is not None else (8 if runs_on_engine(target.model) else 1)
        scheduler = Scheduler(target, args.method, drafter, method_options(args, target), max_queue=args.max_queue,
                              max_batch=max_batch, max_rows=args.max_rows)
        scheduler.method(scheduler.default_method)  # build (and measure costs for) the default method before the first request
        _note_unused_options(scheduler)
        settle_heap()
        serve(scheduler, sock, args.log_level, max_request_bytes, body_timeout)
    finally:
        sock.close()
    import signal

    # Stopped: further signals change nothing. Ignored rather than handled in Python, since the
    # interpreter resets Python handlers to the default while it exits (a late SIGTERM killed the
    # process after its closing line, exit 143).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    return 0


def _note_unused_options(scheduler) -> None:
    """One line on stderr when the server's method options include some its default method does not
    use: they serve only requests naming a method that does (a server's options are pooled)."""
    from .methods import MethodOptionError, build_method

    try:
        build_method(scheduler.default_method, scheduler.target, scheduler.drafter, scheduler.options)
    except MethodOptionError as error:
        print(f"tierspec serve: note: {error} — the server keeps it for requests whose method uses it", file=sys.stderr)


def _add_bench(sub) -> None:
    parser = sub.add_parser(
        "bench",
        help="benchmark methods and transformers peers on a dataset, in one run",
        description="Runs every method on the same prompts in one process (interleaved, warmed up), or shared out by "
        "prompt to the workers of a Ray cluster (--ray), writes per-prompt records (resumable), summary.json, "
        "summary.md and plots to --out.",
    )
    parser.add_argument("--target", default=DEFAULT_MODEL)
    _add_model_flags(parser)
    parser.add_argument("--drafter", default=None, help="drafter model for sd / hf-assisted / lossy rules")
    parser.add_argument("--methods", default="ar,hf-greedy,sd,pld,hf-pld",
                        help="comma-separated method specs, e.g. ar,pld,via:alpha2=0.5:mask=m.json,hf-assisted")
    parser.add_argument("--dataset", default="spec_bench",
                        help="spec_bench, gsm8k, humaneval, mt_bench, cnn_dailymail, xsum, wmt14, json_extract (each text "
                        "constrained to its task's JSON schema: tierspec's lossless methods only; a validity column)")
    parser.add_argument("--free-text", action="store_true",
                        help="json_extract: the same prompts without their schemas (free text, still scored for "
                        "validity): the speed the constrained runs are compared with")
    parser.add_argument("--allow-code-execution", action="store_true",
                        help="humaneval: run the code the model writes (sandboxed with bubblewrap: its own PID, mount "
                        "and network namespaces, a read-only view of the system, time, memory, file-size and process "
                        "limits, a scratch folder) to score pass@1; refused without this flag or "
                        "TIERSPEC_ALLOW_CODE_EXECUTION=1")
    parser.add_argument("--no-sandbox", action="store_true",
                        help="humaneval: run the model's code WITHOUT isolation (only time, memory, file-size and "
                        "process limits) where bubblewrap cannot isolate it; it can then read and write your files "
                        "and signal your processes: only on a machine you do not mind losing (or TIERSPEC_NO_SANDBOX=1)")
    parser.add_argument("--data-dir", default=None, help="data folder (default: the copy shipped in the package, or $TIERSPEC_DATA)")
    parser.add_argument("--per-category", type=int, default=None, help="prompts per category (seeded sample)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--num-draft", type=int, default=None,
                        help="the largest draft of every method that takes one (default: each method's own; "
                        "a spec's num_draft=N wins)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the sampled generations and also picks the prompts --per-category / --limit sample: "
                        "runs with two seeds differ in their prompts too")
    parser.add_argument("--mask", default=None, help="default routing mask for self/via/via-judge/pearl specs that name "
                        "none")
    parser.add_argument("--hf-pld-tokens", type=int, default=10, help="prompt_lookup_num_tokens of hf-pld")
    parser.add_argument("--hf-early-exit-layer", type=int, default=None, help="assistant_early_exit of hf-early-exit")
    parser.add_argument("--no-nll", action="store_true", help="skip the target-NLL pass per record")
    parser.add_argument("--fidelity-reference", default=None,
                        help="records.jsonl (or its folder) of another run whose `ar` outputs fidelity is measured "
                        "against, e.g. a greedy run for a temperature-1 run (default: this run's `ar`)")
    parser.add_argument("--summarize-only", action="store_true",
                        help="rebuild summary, table and plots from the records in --out without generating")
    parser.add_argument("--out", required=True, help="output folder (a rerun resumes)")
    parser.add_argument("--no-progress", action="store_true")
    _add_ray_flags(parser, "prompt")
    parser.set_defaults(run=_run_bench, resume_hint="; rerun the same command to resume")


def _check_filters_sample(args) -> None:
    """--top-k / --top-p filter the distribution a token is sampled from: at temperature 0 (greedy)
    nothing is sampled and they would change nothing."""
    from .errors import TierspecError

    if args.temperature == 0 and (args.top_k != 0 or args.top_p != 1.0):
        raise TierspecError("--top-k and --top-p filter what a sampled token is drawn from; at --temperature 0 "
                            "(greedy) they would change nothing: leave them out or sample (--temperature > 0)")


def _run_bench(args) -> int:
    from pathlib import Path

    _check_filters_sample(args)
    from .bench.report import markdown_table
    from .bench.runner import BenchConfig, run_bench

    per_category = args.per_category
    if per_category is None and args.limit is None:
        per_category = 5 if args.dataset in ("spec_bench", "mt_bench") else None
    check_num_draft(args.num_draft, "--num-draft")
    config = BenchConfig(
        target=args.target, dtype=args.dtype, device=args.device, kernels=args.kernels,
        implementation=args.implementation, methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()), dataset=args.dataset,
        per_category=per_category, limit=args.limit if args.limit is not None else (None if per_category else 20),
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        num_draft=args.num_draft, repeats=args.repeats, seed=args.seed, drafter=args.drafter, data_dir=args.data_dir,
        mask=args.mask, hf_pld_tokens=args.hf_pld_tokens, hf_early_exit_layer=args.hf_early_exit_layer,
        compute_nll=not args.no_nll, fidelity_reference=args.fidelity_reference, code_sandbox=not args.no_sandbox,
        free_text=args.free_text,
    )
    summary = run_bench(config, Path(args.out), progress=not args.no_progress, generate=not args.summarize_only,
                        cluster=_cluster(args), allow_code_execution=args.allow_code_execution)
    print(markdown_table(summary))
    return 0


def _add_judge(sub) -> None:
    parser = sub.add_parser("judge", help="judge decoding: build data, train and evaluate the judge head")
    judge_sub = parser.add_subparsers(dest="judge_command", required=True)

    build = judge_sub.add_parser("build-data", help="correct / planted-error responses from GSM8K train (offline)")
    build.add_argument("--out", required=True, help="JSONL to write")
    build.add_argument("--count", type=int, default=500,
                       help="problems (each gives a correct response and a wrong one per error kind)")
    build.add_argument("--errors", default="arithmetic,copy",
                       help="planted error kinds: arithmetic (a changed intermediate result), copy (an n-gram drafter's "
                       "wrong continuation)")
    build.add_argument("--val-fraction", type=float, default=0.2)
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--data-dir", default=None)
    build.set_defaults(run=_run_judge_build)

    train = judge_sub.add_parser("train", help="train a linear judge head on the target's hidden states")
    train.add_argument("--target", default=DEFAULT_MODEL)
    _add_model_flags(train)
    train.add_argument("--data", required=True, help="judge JSONL (see `judge build-data`)")
    train.add_argument("--features", choices=["hidden", "hidden+logprob"], default="hidden+logprob")
    train.add_argument("--max-mistake-acceptance", type=float, default=0.1,
                       help="the threshold accepts at most this share of the training split's mistaken tokens")
    train.add_argument("--out", required=True, help="head .safetensors (metadata goes beside it as .json); a killed run's rerun "
                       "resumes from the features it kept beside it")
    train.add_argument("--threshold-from", choices=["train", "val"], default="train",
                       help="split whose mistakes set the threshold; val: the operating point on the validation curve "
                       "(mismatch data: harmless vs harmful draft tokens accepted)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--no-progress", action="store_true")
    train.set_defaults(run=_run_judge_train)

    mismatch = judge_sub.add_parser("build-mismatch-data",
                                    help="judge data from the draft head's own mismatches with the target, labelled "
                                    "harmless when the target continuing from the draft rejoins its own text")
    mismatch.add_argument("--target", default=DEFAULT_MODEL)
    _add_model_flags(mismatch)
    mismatch.add_argument("--out", required=True, help="judge JSONL (a rerun with the same settings resumes after the "
                          "prompts done, kept in a hidden progress file beside it)")
    mismatch.add_argument("--prompts", type=int, default=120, help="training prompts (the draft head's mix; no test set)")
    mismatch.add_argument("--answer-tokens", type=int, default=64)
    mismatch.add_argument("--window", type=int, default=8, help="tokens the target continues after the draft token")
    mismatch.add_argument("--match", type=int, default=3, help="consecutive tokens that count as rejoining")
    mismatch.add_argument("--per-prompt", type=int, default=4)
    mismatch.add_argument("--draft-head", default=None, help="default: the head shipped for the target")
    mismatch.add_argument("--data-dir", default=None)
    mismatch.add_argument("--seed", type=int, default=0)
    mismatch.add_argument("--no-progress", action="store_true")
    mismatch.set_defaults(run=_run_judge_mismatches)

    evaluate = judge_sub.add_parser("eval", help="validation metrics of a trained head")
    evaluate.add_argument("--target", default=DEFAULT_MODEL)
    _add_model_flags(evaluate)
    evaluate.add_argument("--head", required=True)
    evaluate.add_argument("--data", required=True)
    evaluate.add_argument("--threshold", type=float, default=None)
    evaluate.add_argument("--split", choices=["train", "val"], default="val")
    evaluate.add_argument("--no-progress", action="store_true")
    evaluate.set_defaults(run=_run_judge_eval)


def _run_judge_build(args) -> int:
    from pathlib import Path

    from .data import default_data_dir
    from .errors import TierspecError

    _at_least({"--count": args.count})
    if not 0.0 < args.val_fraction < 1.0:  # 1.5 made every example validation, 0 one problem silently
        raise TierspecError(f"--val-fraction must be between 0 and 1 (exclusive), got {args.val_fraction}")
    _output_file(args.out)
    from .training.judge_data import build_gsm8k_judge_data

    root = Path(args.data_dir) if args.data_dir else default_data_dir()
    errors = tuple(e.strip() for e in args.errors.split(",") if e.strip())
    info = build_gsm8k_judge_data(root / "gsm8k" / "train.jsonl", Path(args.out), args.count, args.val_fraction, args.seed,
                                  errors)
    print(json.dumps(info))
    return 0


def _run_judge_train(args) -> int:
    from pathlib import Path

    from .errors import TierspecError
    from .training.judge_train import FeatureStore, features_folder, train_judge

    if not 0.0 <= args.max_mistake_acceptance <= 1.0:  # a negative share indexed the list from its end
        raise TierspecError(f"--max-mistake-acceptance is a share of mistakes, from 0 to 1; got "
                            f"{args.max_mistake_acceptance}")
    _output_file(args.out)
    out = Path(args.out)
    with _holding_file(args.out, "tierspec judge train", "judge head file"):
        target = _load(args, args.target)
        features = features_folder(out)
        head, metrics = train_judge(target, Path(args.data), args.features, not args.no_progress,
                                    args.max_mistake_acceptance, args.seed, args.threshold_from, features)
        head.save(out)
        FeatureStore.discard_folder(features)
    print(json.dumps({"out": args.out, "train_seconds": head.metadata["train_seconds"], **metrics}, indent=2))
    return 0


def _run_judge_mismatches(args) -> int:
    from pathlib import Path

    _at_least({"--prompts": args.prompts, "--per-prompt": args.per_prompt, "--answer-tokens": args.answer_tokens,
               "--window": args.window, "--match": args.match})
    _output_file(args.out)
    out = Path(args.out)
    with _holding_file(args.out, "tierspec judge build-mismatch-data", "judge data file"):
        return _mismatches_into(args, out)


def _mismatches_into(args, out) -> int:
    """The mismatch data into ``out`` (its lock held): the target, the head, the prompts, the build."""
    from pathlib import Path

    from .training.judge_mismatches import MismatchConfig, build_mismatch_data, mismatch_prompts
    from .methods import MethodOptions, draft_head_for

    target = _load(args, args.target)
    options = MethodOptions()
    if args.draft_head:
        from .heads.draft import DraftHead

        options = MethodOptions(draft_head=DraftHead.load(args.draft_head, target))
    head = draft_head_for(target, options)
    config = MismatchConfig(answer_tokens=args.answer_tokens, window=args.window, match=args.match,
                            per_prompt=args.per_prompt, seed=args.seed)
    prompts = mismatch_prompts(args.prompts, Path(args.data_dir) if args.data_dir else None, args.seed)
    info = build_mismatch_data(target, head, prompts, out, config, progress=not args.no_progress)
    print(json.dumps(info))
    return 0


def _run_judge_eval(args) -> int:
    from pathlib import Path

    from .training.judge_data import read_judge_data
    from .heads.judge import JudgeHead
    from .training.judge_train import evaluate_head, extract

    target = _load(args, args.target)
    head = JudgeHead.load(args.head, target.identity)
    if args.threshold is not None:
        head.threshold = args.threshold
    tokens = extract(target, read_judge_data(Path(args.data)), head.kind, not args.no_progress)
    print(json.dumps(evaluate_head(head, tokens, args.split), indent=2))
    return 0


def _add_drafter(sub) -> None:
    parser = sub.add_parser("drafter", help="the trained draft head (EAGLE-style): build its data, train it")
    drafter_sub = parser.add_subparsers(dest="drafter_command", required=True)

    build = drafter_sub.add_parser(
        "build-data",
        help="the target's own answers and features on training prompts (resumable)",
        description="Self-distillation data for the draft head: the target answers training prompts (GSM8K train, "
        "WMT14/CNN-DM items Spec-Bench does not use, XSum articles, synthesised prompts) in batches, and reference "
        "answers are run teacher-forced; the target's features at every position are stored in safetensors shards, "
        "made in this process or shared out to the workers of a Ray cluster (--ray). Rerun the same command to resume.",
    )
    build.add_argument("--target", default=DEFAULT_MODEL)
    _add_model_flags(build)
    build.add_argument("--out", required=True, help="data folder (a rerun resumes)")
    build.add_argument("--own-prompts", type=int, default=2400, help="prompts the target answers itself")
    build.add_argument("--reference-items", type=int, default=1600, help="reference answers run teacher-forced")
    build.add_argument("--max-new-tokens", type=int, default=160)
    build.add_argument("--max-prompt-tokens", type=int, default=448, help="longer prompts are skipped")
    build.add_argument("--batch-size", type=int, default=48)
    build.add_argument("--sampled-fraction", type=float, default=0.25,
                       help="share of own answers sampled at temperature 1 (the rest greedy)")
    build.add_argument("--data-dir", default=None)
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--no-progress", action="store_true", help="one log line per shard instead of a progress bar")
    _add_ray_flags(build, "shard")
    build.set_defaults(run=_run_drafter_build, resume_hint="; rerun the same command to resume")

    train = drafter_sub.add_parser(
        "train",
        help="train the draft head on build-data's output (resumable)",
        description="Trains one decoder layer of the target's architecture to predict the target's next feature "
        "(feature regression + cross-entropy against the target's distribution over the draft vocabulary), unrolled "
        "over several draft steps (training-time test). Prints validation acceptance by draft position per epoch.",
    )
    train.add_argument("--target", default=DEFAULT_MODEL)
    _add_model_flags(train)
    train.add_argument("--data", required=True, help="folder written by `tierspec drafter build-data`")
    train.add_argument("--out", required=True, help="head .safetensors (metadata goes beside it as .json)")
    from .training.draft_train import TrainConfig

    defaults = TrainConfig()
    train.add_argument("--draft-vocab", type=int, default=None,
                       help=f"K: the most frequent answer tokens the head drafts over (default {defaults.draft_vocab_size}; "
                       "a head continued with --init-head keeps its own)")
    train.add_argument("--epochs", type=float, default=defaults.epochs)
    train.add_argument("--batch-tokens", type=int, default=defaults.batch_tokens)
    train.add_argument("--lr", type=float, default=defaults.lr)
    train.add_argument("--ttt-steps", type=int, default=defaults.ttt_steps,
                       help="draft steps unrolled in training (1 = teacher forcing only)")
    train.add_argument("--ce-weight", type=float, default=defaults.ce_weight,
                       help="weight w of the cross-entropy against the target's distribution (feature regression has 1)")
    train.add_argument("--feature-layers", default=None,
                       help="target layers fused into the head's input besides f (EAGLE-3), e.g. 1,15; they must be "
                       "among the layers build-data stored (plan.json: aux_layers); default: all of those; "
                       "'' = f alone")
    train.add_argument("--init-head", default=None,
                       help="continue training this head (a .safetensors file, or 'shipped' for the head tierspec "
                       "ships for the target) on the new data: its weights, draft vocabulary and fused layers; "
                       "validation starts with its acceptance on the new data (epoch 0)")
    train.add_argument("--seed", type=int, default=defaults.seed)
    train.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    train.set_defaults(run=_run_drafter_train, resume_hint="; rerun the same command to resume from the checkpoint")


def _run_drafter_build(args) -> int:
    from pathlib import Path

    from .training.draft_data import DataConfig, build_data
    from .util import exclusive_lock

    config = DataConfig(own_prompts=args.own_prompts, reference_items=args.reference_items,
                        max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                        batch_size=args.batch_size,
                        sampled_fraction=args.sampled_fraction, seed=args.seed)
    # Batched generation with padding: transformers' generate (tierspec's decode loop runs one sequence).
    implementation = "transformers" if args.implementation == "auto" else args.implementation
    data_dir = Path(args.data_dir) if args.data_dir else None
    cluster = _cluster(args)
    out = Path(args.out)
    with exclusive_lock(out / ".build-data.lock", f"the data folder {out}", "tierspec drafter build-data"):
        if cluster is not None:
            from .training.draft_data import build_data_on_cluster

            loading = (args.dtype, args.device, args.kernels, implementation)
            manifest = build_data_on_cluster(args.target, loading, out, cluster, config, data_dir,
                                             progress=not args.no_progress)
        else:
            manifest = build_data(_load(args, args.target, implementation), out, config, data_dir,
                                  progress=not args.no_progress)
    print(json.dumps(manifest, indent=2))
    return 0


def _run_drafter_train(args) -> int:
    from pathlib import Path

    from .errors import TierspecError
    from .training.draft_train import TrainConfig

    if args.init_head is not None and args.draft_vocab is not None:  # it was ignored: the head's own K stood
        raise TierspecError("the head continued from --init-head drafts over its own vocabulary: --draft-vocab would "
                            "change nothing; leave it out")
    _output_file(args.out)
    layers = None if args.feature_layers is None else tuple(int(i) for i in args.feature_layers.split(",") if i.strip())
    vocabulary = {} if args.draft_vocab is None else {"draft_vocab_size": args.draft_vocab}
    config = TrainConfig(**vocabulary, epochs=args.epochs, batch_tokens=args.batch_tokens, lr=args.lr,
                         ttt_steps=args.ttt_steps, ce_weight=args.ce_weight, feature_layers=layers, seed=args.seed)
    out = Path(args.out)
    # One training per output (its checkpoint is out + .checkpoint.pt): a second is refused.
    with _holding_file(args.out, "tierspec drafter train", "head file"):
        return _train_into(args, config, out)


def _train_into(args, config, out) -> int:
    from pathlib import Path

    from .training.draft_train import train_head

    target = _load(args, args.target)
    init_head, continued = _starting_head(args.init_head, target)
    checkpoint = out.with_name(out.name + ".checkpoint.pt")
    head, metrics = train_head(target, Path(args.data), config, checkpoint, progress=not args.no_progress,
                               init_head=init_head)
    manifest_path = Path(args.data) / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    head.save(out, {"training": metrics, "data": str(args.data), "data_manifest": manifest,
                    "data_seconds": manifest.get("seconds_total", manifest.get("seconds_this_run")),
                    **({"continued_from": continued} if continued else {})})
    checkpoint.unlink(missing_ok=True)
    print(json.dumps({"out": str(out), **{k: v for k, v in metrics.items() if k != "history"}}, indent=2))
    return 0


def _starting_head(spec: str | None, target):
    """(the head ``--init-head`` names, what its file says of it) or (None, None)."""
    if spec is None:
        return None, None
    import hashlib
    from pathlib import Path

    from .heads.draft import DraftHead, DraftHeadError
    from .heads.shipped import shipped_head_path

    path = shipped_head_path(target) if spec == "shipped" else Path(spec)
    if path is None:
        raise DraftHeadError(f"tierspec ships no draft head for '{target.identity.name}'; pass a head file to --init-head")
    head = DraftHead.load(path, target)
    earlier = head.metadata.get("training", {})
    # the head as the user named it ("shipped" stays "shipped": the file is replaced when a continued
    # head ships); its digest identifies the exact weights
    continued = {"path": spec, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                 "train_seconds": earlier.get("train_seconds"), "steps": earlier.get("steps"),
                 "train_sequences": earlier.get("train_sequences"), "validation": earlier.get("validation"),
                 "continued_from": head.metadata.get("continued_from")}
    return head, continued


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierspec", description="Speculative decoding for Hugging Face causal LMs.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of every error (or set TIERSPEC_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_route(sub)
    _add_bench(sub)
    _add_judge(sub)
    _add_drafter(sub)
    return parser


SEED_LIMIT = 2**63  # seeds are int64 (torch's generators take no more; a derived seed adds small offsets)


def _check_seed(args) -> None:
    """Every command's --seed is a non-negative int64, refused with one line before any work."""
    seed = getattr(args, "seed", None)
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        from .errors import TierspecError

        raise TierspecError(f"--seed must be an integer from 0 to 2**63 - 1 ({SEED_LIMIT - 1}), got {seed}")


def _end_progress_bars() -> None:
    """Close the progress bars a job left open when it stopped, so the last message starts a line
    of its own (it was printed on the bar's line, after the bar)."""
    tqdm = sys.modules.get("tqdm")
    if tqdm is None:
        return
    for bar in list(getattr(tqdm.tqdm, "_instances", ())):
        try:
            bar.close()
        except Exception:  # a bar half made when the job stopped: the message matters more
            pass


def main(argv: list[str] | None = None) -> int:
    """Run the command line. Validation errors (``TierspecError``) and OS errors (a full disk)
    print as one line and exit 2; a closed stdout pipe ends quietly (141, SIGPIPE's status);
    anything else is a bug and prints its traceback (exit 1). ``--debug`` or
    ``TIERSPEC_DEBUG=1`` shows the traceback of validation errors too."""
    import os

    from .errors import TierspecError

    parser = build_parser()
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get("TIERSPEC_DEBUG", "") not in ("", "0")
    try:
        _check_seed(args)
        return args.run(args)
    except BrokenPipeError:
        # The reader went away (``tierspec generate … | head -c 10``): end quietly as a shell tool
        # does, with SIGPIPE's status; stdout points at /dev/null so the exit's flush finds no pipe.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        _end_progress_bars()
        print(f"tierspec: interrupted{getattr(args, 'resume_hint', '')}", file=sys.stderr)
        return 130
    except TierspecError as error:
        if debug:
            raise
        _end_progress_bars()
        message = " ".join(line.strip() for line in str(error).splitlines())  # one line, whoever wrote it
        print(f"tierspec: error: {message}", file=sys.stderr)
        return 2
    except OSError as error:
        # A full disk or a file that cannot be written, where no writer named it: one line with
        # the file when the error knows it (a bug is not an OSError; --debug shows the traceback).
        if debug:
            raise
        _end_progress_bars()
        where = f" ({error.filename})" if error.filename else ""
        print(f"tierspec: error: {error.strerror or error}{where}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
