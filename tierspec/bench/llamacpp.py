"""llama.cpp as peers of ``tierspec bench``: ``llamacpp-greedy`` (llama.cpp's plain decoding) and
``llamacpp-lookup`` (llama-cpp-python's prompt-lookup decoding, ``LlamaPromptLookupDecoding``).

They answer "how fast is the fastest CPU runtime on the same job": the target's own GGUF file,
exactly the prompt token ids tierspec's methods get (tierspec's chat template; llama.cpp is fed
ids, never text, so both tokenise nothing twice), the same budget and end-of-sequence ids, and
the same clock (prompt in to last token out, prefill included; loading and the warm-up are not
counted). Every prompt is prefilled in full: the cache is reset first, so the chat template's
system prompt shared by all prompts is not served from the previous prompt's cache.

What differs, and the report says so: llama.cpp computes with the GGUF's quantised weights (the
default model's are Q4_1) where tierspec de-quantises them, so greedy texts may part from
`ar`'s; above temperature 0 llama.cpp draws with its own sampler chain (top-k, top-p, then
temperature; tierspec applies the temperature first) and random stream.

The extra ``llamacpp`` installs llama-cpp-python (it compiles llama.cpp, minutes); without it
asking for a ``llamacpp-*`` peer is a one-line error naming the extra.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..decode import CycleStats, GenerationStats
from ..errors import TierspecError
from ..gguf_check import check_gguf
from ..model_files import KNOWN_MODELS, known_model_file
from ..models import DEFAULT_MODEL, default_model_file
from .outcome import Outcome

LLAMACPP_PEERS = ("llamacpp-greedy", "llamacpp-lookup")
LLAMACPP_EXTRA = "pip install -e '.[llamacpp]'"
# llama-cpp-python's own defaults for LlamaPromptLookupDecoding: what its users get.
LOOKUP_DEFAULTS = {"tokens": 10, "ngram": 2}
# Each peer's method-spec parameters (integers) and their defaults.
LLAMACPP_PARAMETERS = {"llamacpp-greedy": {}, "llamacpp-lookup": LOOKUP_DEFAULTS}


class LlamaCppPeerError(TierspecError):
    """A ``llamacpp-*`` peer cannot run (package missing, target not a GGUF file, …)."""


def import_llama_cpp(peer: str):
    """The ``llama_cpp`` module, or a one-line error naming the extra that installs it."""
    try:
        import llama_cpp
        import llama_cpp.llama_speculative  # noqa: F401  (the prompt-lookup drafter)
    except ImportError as error:
        raise LlamaCppPeerError(f"{peer} needs llama-cpp-python ({error}); install the extra: {LLAMACPP_EXTRA}") from None
    return llama_cpp


def gguf_file(target_spec: str, peer: str, engine: str = "llama.cpp") -> Path:
    """The GGUF file the target was loaded from: a known model's (``model_files``), or a ``.gguf`` path."""
    if str(target_spec) == DEFAULT_MODEL:
        return default_model_file()
    if str(target_spec) in KNOWN_MODELS:
        return known_model_file(str(target_spec))
    path = Path(str(target_spec)).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise LlamaCppPeerError(f"{peer} runs {engine} on the target's GGUF file: the target must be a known model "
                            f"({', '.join(KNOWN_MODELS)}) or a .gguf file, not '{target_spec}'")


@dataclass(frozen=True)
class GgufFacts:
    """What a GGUF file's header says that the report needs."""

    quantization: str  # the file type, e.g. "Q4_1" (most tensors; norms stay F32)
    context_length: int | None  # positions the model was trained for


@lru_cache(maxsize=8)
def gguf_facts(path: Path) -> GgufFacts:
    """Read from the checked header (``gguf_check``: a damaged file is refused here, before the
    peer's runtime reads it); no tensor data."""
    import gguf

    header = check_gguf(path)
    file_type = header.fields.get("general.file_type")
    try:
        quantization = gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):  # no or an unknown file type: name the commonest tensor type
        quantization = Counter(t.type_name for t in header.tensors.values()).most_common(1)[0][0]
    length = header.fields.get(f"{header.architecture}.context_length")
    return GgufFacts(quantization, int(length) if isinstance(length, int) else None)


class _RecordingLookup:
    """llama-cpp-python's prompt-lookup drafter, unchanged, with each proposal recorded: llama.cpp
    reports no draft statistics, but every call is followed by exactly one verification pass
    (``Llama.generate``), so the proposals and the tokens emitted give τ and acceptance."""

    def __init__(self, lookup):
        self.lookup = lookup
        self.proposals: list[list[int]] = []
        self.seconds: list[float] = []

    def clear(self) -> None:
        self.proposals, self.seconds = [], []

    def __call__(self, input_ids, /, **kwargs):
        started = time.perf_counter()
        drafts = self.lookup(input_ids, **kwargs)
        self.seconds.append(time.perf_counter() - started)
        self.proposals.append([int(t) for t in drafts])
        return drafts


def lookup_stats(tokens: list[int], cycle_of: list[int], proposals: list[list[int]], draft_seconds: list[float],
                 wall_seconds: float) -> GenerationStats:
    """Statistics of a prompt-lookup generation, in the decode loop's terms (docs/metrics.md §Generation statistics).

    Cycle 0 is the prompt's pass (no draft); cycle c ≥ 1 is the pass over the last token and
    ``proposals[c - 1]``. ``cycle_of[i]`` is the cycle that emitted ``tokens[i]``. A drafted token
    counts as accepted when it was emitted in its place; tokens llama.cpp never sampled because the
    budget or an end-of-sequence id stopped the generation first count as not evaluated."""
    stats = GenerationStats()
    for cycle in range(len(proposals) + 1):
        emitted = [t for t, c in zip(tokens, cycle_of) if c == cycle]
        drafts = proposals[cycle - 1] if cycle else []
        accepted = 0
        while accepted < min(len(drafts), len(emitted)) and emitted[accepted] == drafts[accepted]:
            accepted += 1
        rejected = accepted < len(drafts) and accepted < len(emitted)
        stats.add(CycleStats(drafted=len(drafts), evaluated=accepted + int(rejected), accepted=accepted,
                             emitted=len(emitted), target_calls=1, slim_calls=0, drafter_calls=0, seconds=0.0,
                             draft_seconds=draft_seconds[cycle - 1] if cycle else 0.0))
    stats.wall_seconds = wall_seconds
    return stats


def peer_settings(name: str, params: dict[str, str], known: dict[str, int], error) -> dict[str, int]:
    """A peer spec's integer parameters (``known``: their defaults), refused in one line."""
    unknown = set(params) - set(known)
    if unknown:
        raise error(f"method spec '{name}': unknown parameter(s) {sorted(unknown)}; known: {sorted(known)}")
    try:
        settings = {key: int(params.get(key, default)) for key, default in known.items()}
    except ValueError as err:
        raise error(f"method spec '{name}': {err}") from None
    if any(value < 1 for value in settings.values()):
        raise error(f"method spec '{name}': {' and '.join(sorted(settings))} must be at least 1")
    return settings


class LlamaCppPeer:
    """One ``llamacpp-*`` peer of a bench run: the model is loaded once and reused for every prompt.
    It runs in a worker process of its own (``peer_process.PeerProcess``): a crash of llama.cpp
    is that peer's failure, not the run's.

    On a constrained set (``takes_json_schema``) each text follows its task's JSON schema through
    llama.cpp's own grammar (``LlamaGrammar.from_json_schema``, converted once per schema outside the
    clock, as tierspec compiles its own): what a user of llama.cpp would run instead. Its grammar is
    not tierspec's (it allows free whitespace, for one), so its texts are compared by validity.

    The context is sized to what the prompts need (grown, outside the clock, when a longer prompt
    comes): llama-cpp-python keeps logits for every position of its context when drafting, so a
    context of the model's full trained length would cost gigabytes for nothing.
    """

    takes_json_schema = True

    @staticmethod
    def check(name: str, params: dict[str, str], target_spec: str, device: str) -> None:
        """What can be refused before a worker starts: the package, the parameters, the device,
        the target's GGUF file (checked: ``gguf_check``)."""
        import_llama_cpp(name)
        peer_settings(name, params, LLAMACPP_PARAMETERS[name], LlamaCppPeerError)
        if device != "cpu":
            raise LlamaCppPeerError(f"{name} runs llama.cpp's CPU build beside tierspec's methods: bench with --device cpu")
        gguf_facts(gguf_file(target_spec, name))

    def __init__(self, name: str, params: dict[str, str], target_spec: str, vocab_size: int, eos: tuple[int, ...],
                 temperature: float, top_k: int, top_p: float, threads: int):
        self.name = name
        self.llama_cpp = import_llama_cpp(name)
        settings = peer_settings(name, params, LLAMACPP_PARAMETERS[name], LlamaCppPeerError)
        self.path = gguf_file(target_spec, name)
        self.facts = gguf_facts(self.path)
        self.eos = set(eos)
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.threads = threads  # tierspec's methods compute with torch's threads: the caller passes their count
        self.lookup = None
        if settings:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            self.lookup = _RecordingLookup(LlamaPromptLookupDecoding(max_ngram_size=settings["ngram"],
                                                                     num_pred_tokens=settings["tokens"]))
        self.draft_tokens = settings.get("tokens", 0)
        self.llama = None
        self.context = 0
        self._grammars: dict[str, object] = {}  # llama.cpp's grammars, by their schema's JSON text
        self._load(1024)
        if self.llama.n_vocab() != vocab_size:
            raise LlamaCppPeerError(f"{name}: llama.cpp reads {self.llama.n_vocab()} tokens from {self.path.name}, "
                                    f"the target has {vocab_size}; is the target loaded from another file?")
        self.record_fields = {
            "engine": f"llama-cpp-python {self.llama_cpp.__version__}, {self.facts.quantization} weights, "
                      f"{self.threads} threads",
            "weights": self.facts.quantization,
        }

    def _load(self, context: int) -> None:
        """(Re)load the model with a context of ``context`` positions."""
        if self.llama is not None:
            self.llama.close()
        # logits_all: the prompt-lookup drafter needs every drafted position's logits (and
        # llama-cpp-python forces it with a draft model); plain decoding needs the last only.
        self.llama = self.llama_cpp.Llama(
            str(self.path), n_ctx=context, n_threads=self.threads, n_threads_batch=self.threads,
            logits_all=self.lookup is not None, draft_model=self.lookup, verbose=False,
        )
        self.context = context

    def _fit(self, prompt_length: int, max_new_tokens: int) -> None:
        """Make the context hold the prompt, the budget and a last draft block."""
        limit = self.facts.context_length
        if limit is not None and prompt_length + max_new_tokens > limit:
            raise LlamaCppPeerError(f"{self.name}: a prompt of {prompt_length} tokens + {max_new_tokens} new ones exceed "
                                    f"the model's context of {limit}")
        positions = prompt_length + max_new_tokens + self.draft_tokens + 1
        if positions > self.context:
            self._load(max(positions, 2 * self.context))

    def _grammar(self, schema: str):
        """llama.cpp's grammar for the JSON schema ``schema`` (its text), converted once."""
        if schema not in self._grammars:
            try:
                self._grammars[schema] = self.llama_cpp.LlamaGrammar.from_json_schema(schema, verbose=False)
            except Exception as error:  # noqa: BLE001 - llama.cpp's converter raises what it likes
                raise LlamaCppPeerError(f"{self.name}: llama.cpp cannot convert the JSON schema to its grammar: "
                                        f"{type(error).__name__}: {error}") from None
        return self._grammars[schema]

    def run(self, prompt_ids: list[int], max_new_tokens: int, seed: int | None, schema: str | None = None) -> Outcome:
        """Generate after ``prompt_ids``: up to ``max_new_tokens`` tokens, the first end-of-sequence
        id included (as tierspec's decode loop does), sampling with the prompt's ``seed`` (None:
        greedy; ``peer_process.prompt_seed``), following the JSON schema ``schema`` (its text; None:
        free text). Returns the bench's ``Outcome``."""
        ids = [int(t) for t in prompt_ids]
        grammar = None if schema is None else self._grammar(schema)
        self._fit(len(ids), max_new_tokens)
        llama = self.llama
        greedy = self.temperature == 0
        if not greedy:
            llama.set_seed(int(seed))
        if self.lookup is not None:
            self.lookup.clear()
        sampler = dict(temp=0.0) if greedy else dict(temp=self.temperature, top_k=self.top_k, top_p=self.top_p)
        tokens: list[int] = []
        cycle_of: list[int] = []
        started = time.perf_counter()
        llama.reset()  # forget the previous prompt: no prefix of it is reused
        stream = llama.generate(ids, reset=True, min_p=0.0, typical_p=1.0, repeat_penalty=1.0, grammar=grammar,
                                **sampler)
        try:
            for token in stream:
                tokens.append(int(token))
                cycle_of.append(len(self.lookup.proposals) if self.lookup is not None else 0)
                if tokens[-1] in self.eos or len(tokens) >= max_new_tokens:
                    break
            seconds = time.perf_counter() - started
        finally:
            stream.close()
        stats = None
        if self.lookup is not None:
            stats = lookup_stats(tokens, cycle_of, self.lookup.proposals, self.lookup.seconds, seconds)
        return Outcome(tokens, seconds, stats, dict(self.record_fields))

    def close(self) -> None:
        if self.llama is not None:
            self.llama.close()
            self.llama = None
