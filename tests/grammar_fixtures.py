"""A tiny byte-level BPE tokenizer (the default model's kind of tokenizer, 265 ids) and a plain
constrained decoding loop, shared by the grammar tests."""

from __future__ import annotations

import torch

EOS = 0
# A few merges, so that some text has more than one tokenisation (as a real BPE vocabulary has).
MERGES = [("{", '"'), ('"', ":"), ("t", "r"), ("tr", "u"), ("tru", "e"), ("Ġ", '"'), ('"', "}"), ('"', ",")]


class ByteTokenizer:
    """The 256 byte-level symbols, the merges of ``MERGES`` and ``<eos>`` (id 0), with the
    interface tierspec reads: ``backend`` (a ``tokenizers.Tokenizer``), encode, decode, len."""

    def __init__(self):
        from tokenizers import Tokenizer, decoders, pre_tokenizers
        from tokenizers.models import BPE

        vocab = {"<eos>": EOS}
        for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
            vocab[symbol] = len(vocab)
        for left, right in MERGES:
            vocab[left + right] = len(vocab)
        self.backend = Tokenizer(BPE(vocab, list(MERGES)))
        self.backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        self.backend.decoder = decoders.ByteLevel()
        self.backend.add_special_tokens(["<eos>"])
        self.eos_token_id = EOS
        self.size = len(vocab)

    def __len__(self) -> int:
        return self.size

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text).ids

    def __call__(self, text: str) -> dict:
        """``{"input_ids": ...}``, as a transformers tokenizer answers (how tierspec tokenises a prompt)."""
        return {"input_ids": self.encode(text)}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token(self, text: str) -> int:
        """The id of the one token that is ``text``."""
        ids = self.encode(text)
        assert len(ids) == 1, f"{text!r} is {len(ids)} tokens"
        return ids[0]


def allowed_ids(state) -> set[int]:
    return set(torch.nonzero(state.allowed()).flatten().tolist())


@torch.no_grad()
def constrained_ar(model, prompt: list[int], compiled, max_new: int, eos: set[int],
                   generator: torch.Generator | None = None) -> list[int]:
    """Constrained ``ar``, written plainly (no cache, no tierspec loop): at each step the whole
    text is run, the last row masked by the grammar state, and the argmax taken (or a sample
    drawn with ``generator``); the state takes the token."""
    state = compiled.new_state()
    ids = list(prompt)
    out: list[int] = []
    for _ in range(max_new):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        allowed = state.allowed()
        assert allowed.any(), "the grammar allows no token"
        masked = torch.where(allowed, logits, torch.tensor(float("-inf")))
        if generator is None:
            token = int(masked.argmax())
        else:
            token = int(torch.multinomial(torch.softmax(masked, -1), 1, generator=generator))
        assert state.advance([token]) == 1
        out.append(token)
        ids.append(token)
        if token in eos:
            break
    return out


@torch.no_grad()
def constrained_greedy_cached(model, prompt: list[int], compiled, max_new: int, eos: set[int]) -> list[int]:
    """Constrained greedy decoding of a loaded model through ``CachedModel`` (one pass per
    token, its KV cache kept: the real model is too slow to rerun whole): the same plain loop
    as ``constrained_ar``, outside tierspec's decode loop."""
    from tierspec.cached_model import CachedModel

    cached = CachedModel(model)
    state = compiled.new_state()
    out: list[int] = []
    logits = cached.forward(torch.tensor(prompt), logits_for=1).logits[-1]
    for _ in range(max_new):
        token = int(torch.where(state.allowed(), logits, torch.tensor(float("-inf"))).argmax())
        assert state.advance([token]) == 1
        out.append(token)
        if token in eos:
            break
        logits = cached.forward(torch.tensor([token]), logits_for=1).logits[-1]
    return out
