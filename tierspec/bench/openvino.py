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

from ..errors import TierspecError
from .llamacpp import peer_settings, gguf_facts, gguf_file
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
    for this CPU then) and reused for every prompt; each prompt starts from an empty cache. It runs
    in a worker process of its own (``peer_process.PeerProcess``): a crash of OpenVINO is that
    peer's failure, not the run's."""

    @staticmethod
    def check(name: str, params: dict[str, str], target_spec: str, device: str) -> None:
        """What can be refused before a worker starts: the package, the parameters, the device,
        the target's GGUF file (checked: ``gguf_check``)."""
        import_openvino_genai(name)
        peer_settings(name, params, OPENVINO_PARAMETERS[name], OpenVinoPeerError)
        if device != "cpu":
            raise OpenVinoPeerError(f"{name} runs OpenVINO's CPU plugin beside tierspec's methods: bench with --device cpu")
        gguf_facts(gguf_file(target_spec, name, engine="OpenVINO GenAI"))

    def __init__(self, name: str, params: dict[str, str], target_spec: str, vocab_size: int, eos: tuple[int, ...],
                 temperature: float, top_k: int, top_p: float, threads: int):
        self.name = name
        genai = self.genai = import_openvino_genai(name)
        settings = peer_settings(name, params, OPENVINO_PARAMETERS[name], OpenVinoPeerError)
        self.path = gguf_file(target_spec, name, engine="OpenVINO GenAI")
        self.facts = gguf_facts(self.path)
        self.eos = set(eos)
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.threads = threads
        self.settings = settings
        options = {"INFERENCE_NUM_THREADS": self.threads}
        # No prefix caching: LLMPipeline keeps one by default on the CPU (a 1,024-token prompt given
        # again took 0.014 s instead of 0.70), which gave it the warm-up's prompt — the first prompt
        # measured — prefilled already, and every prompt the chat template's prefix; each prompt is
        # prefilled in full, as tierspec's methods and llama.cpp's peers prefill theirs.
        scheduler = genai.SchedulerConfig()
        scheduler.enable_prefix_caching = False
        try:
            self.pipeline = genai.LLMPipeline(str(self.path), "CPU", prompt_lookup=bool(settings), scheduler_config=scheduler,
                                              **options)
        except RuntimeError as error:
            raise OpenVinoPeerError(f"{name}: OpenVINO GenAI cannot read {self.path.name}: "
                                    f"{str(error).strip().splitlines()[0]}") from None
        import openvino

        self.record_fields = {
            "engine": f"openvino-genai {genai.__version__} (OpenVINO {openvino.__version__}) on the GGUF, "
                      f"{self.facts.quantization} weights, {self.threads} threads",
            "weights": self.facts.quantization,
        }

    def _config(self, max_new_tokens: int, seed: int | None):
        config = self.genai.GenerationConfig()
        config.max_new_tokens = max_new_tokens
        config.stop_token_ids = set(self.eos)
        if self.temperature == 0:
            config.do_sample = False
        else:  # the prompt's seed (peer_process.prompt_seed)
            config.do_sample = True
            config.temperature = self.temperature
            config.top_k = self.top_k if self.top_k > 0 else 0
            config.top_p = self.top_p
            config.rng_seed = int(seed)
        if self.settings:
            config.num_assistant_tokens = self.settings["tokens"]
            config.max_ngram_size = self.settings["ngram"]
        return config

    def run(self, prompt_ids: list[int], max_new_tokens: int, seed: int | None) -> Outcome:
        """Generate after ``prompt_ids``: up to ``max_new_tokens`` tokens, the first end-of-sequence
        id included (as tierspec's decode loop does), sampling with the prompt's ``seed`` (None:
        greedy). Returns the bench's ``Outcome``."""
        import numpy as np
        import openvino

        ids = np.asarray([[int(t) for t in prompt_ids]], dtype=np.int64)
        inputs = self.genai.TokenizedInputs(openvino.Tensor(ids), openvino.Tensor(np.ones_like(ids)))
        config = self._config(max_new_tokens, seed)
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
