"""OpenVINO GenAI as peers of ``tierspec bench``: ``ov-greedy`` (``openvino_genai.LLMPipeline``'s
plain decoding) and ``ov-lookup`` (its prompt-lookup decoding, ``prompt_lookup=True``).

They answer "how fast is the other CPU runtime users pick": the target's own GGUF file, read by
OpenVINO GenAI directly, fed exactly the prompt token ids tierspec's methods get (never text), the
same budget and end-of-sequence ids, the same clock (prompt in to last token out, prefill included;
loading and the warm-up are not counted) and torch's thread count (``INFERENCE_NUM_THREADS``).

What differs, and the report says so: OpenVINO's GGUF reader stores each Q4_1 block's minimum as a
4-bit zero point rounded from −m/d (measured on the default model: weights off by ~9% of their mean
magnitude), so its greedy text may part from `ar`'s early; above temperature 0 it draws with its
own sampler and random stream (``rng_seed``).

The extra ``openvino`` installs openvino-genai; without it, asking for an ``ov-*`` peer is a
one-line error naming the extra.
"""

from __future__ import annotations

import time

import torch

from ..errors import TierspecError
from ..models import LoadedModel
from .llamacpp import gguf_facts, gguf_file
from .outcome import Outcome

OPENVINO_PEERS = ("ov-greedy", "ov-lookup")
OPENVINO_EXTRA = "pip install -e '.[openvino]'"
# The values of OpenVINO GenAI's prompt-lookup sample (prompt_lookup_decoding_lm.py): what its users get.
LOOKUP_DEFAULTS = {"tokens": 5, "ngram": 3}
OPENVINO_PARAMETERS = {"ov-greedy": {}, "ov-lookup": LOOKUP_DEFAULTS}


class OpenVinoPeerError(TierspecError):
    """An ``ov-*`` peer cannot run (package missing, target not a GGUF file, …)."""


def import_openvino_genai(peer: str):
    """The ``openvino_genai`` module, or a one-line error naming the extra that installs it."""
    try:
        import openvino  # noqa: F401
        import openvino_genai
    except ImportError as error:
        raise OpenVinoPeerError(f"{peer} needs openvino-genai ({error}); install the extra: {OPENVINO_EXTRA}") from None
    return openvino_genai


class OpenVinoPeer:
    """One ``ov-*`` peer of a bench run: the pipeline is built once (OpenVINO compiles the model
    for this CPU then) and reused for every prompt; each prompt starts from an empty cache."""

    def __init__(self, name: str, params: dict[str, str], target_spec: str, target: LoadedModel, eos: tuple[int, ...],
                 temperature: float, top_k: int, top_p: float, seed: int):
        self.name = name
        genai = self.genai = import_openvino_genai(name)
        if target.device.type != "cpu":
            raise OpenVinoPeerError(f"{name} runs OpenVINO's CPU plugin beside tierspec's methods: bench with --device cpu")
        known = OPENVINO_PARAMETERS[name]
        unknown = set(params) - set(known)
        if unknown:
            raise OpenVinoPeerError(f"method spec '{name}': unknown parameter(s) {sorted(unknown)}; known: {sorted(known)}")
        try:
            settings = {key: int(params.get(key, default)) for key, default in known.items()}
        except ValueError as error:
            raise OpenVinoPeerError(f"method spec '{name}': {error}") from None
        if any(value < 1 for value in settings.values()):
            raise OpenVinoPeerError(f"method spec '{name}': tokens and ngram must be at least 1")
        self.path = gguf_file(target_spec, name, engine="OpenVINO GenAI")
        self.facts = gguf_facts(self.path)
        self.eos = set(eos)
        self.temperature, self.top_k, self.top_p, self.seed = temperature, top_k, top_p, seed
        self.threads = torch.get_num_threads()
        self.settings = settings
        options = {"INFERENCE_NUM_THREADS": self.threads}
        try:
            self.pipeline = genai.LLMPipeline(str(self.path), "CPU", prompt_lookup=bool(settings), **options)
        except RuntimeError as error:
            raise OpenVinoPeerError(f"{name}: OpenVINO GenAI cannot read {self.path.name}: "
                                    f"{str(error).strip().splitlines()[0]}") from None
        import openvino

        self.record_fields = {
            "engine": f"openvino-genai {genai.__version__} (OpenVINO {openvino.__version__}) on the GGUF, "
                      f"{self.facts.quantization} weights, {self.threads} threads",
            "weights": self.facts.quantization,
        }

    def _config(self, max_new_tokens: int, generator: torch.Generator | None):
        config = self.genai.GenerationConfig()
        config.max_new_tokens = max_new_tokens
        config.stop_token_ids = set(self.eos)
        if self.temperature == 0:
            config.do_sample = False
        else:  # the prompt's seed, drawn as the other peers draw theirs
            config.do_sample = True
            config.temperature = self.temperature
            config.top_k = self.top_k if self.top_k > 0 else 0
            config.top_p = self.top_p
            config.rng_seed = self.seed if generator is None else int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        if self.settings:
            config.num_assistant_tokens = self.settings["tokens"]
            config.max_ngram_size = self.settings["ngram"]
        return config

    def run(self, prompt_ids: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None) -> Outcome:
        """Generate after ``prompt_ids`` [n]: up to ``max_new_tokens`` tokens, the first end-of-
        sequence id included (as tierspec's decode loop does). Returns the bench's ``Outcome``."""
        import numpy as np
        import openvino

        ids = np.asarray([[int(t) for t in prompt_ids]], dtype=np.int64)
        inputs = self.genai.TokenizedInputs(openvino.Tensor(ids), openvino.Tensor(np.ones_like(ids)))
        config = self._config(max_new_tokens, generator)
        started = time.perf_counter()
        result = self.pipeline.generate(inputs, config)
        seconds = time.perf_counter() - started
        tokens = [int(t) for t in result.tokens[0]][:max_new_tokens]
        for i, token in enumerate(tokens):  # OpenVINO includes the stop token, as tierspec does
            if token in self.eos:
                tokens = tokens[: i + 1]
                break
        return Outcome(tokens, seconds, None, dict(self.record_fields))

    def close(self) -> None:
        self.pipeline = None
