"""What one generation of a benchmarked method gives the bench, whoever ran it: tierspec's decode
loop, transformers' ``generate`` or llama.cpp (``llamacpp``). A module of its own so that the
runner and the peers it drives both import it, neither importing the other."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..decode import GenerationStats


@dataclass
class Outcome:
    token_ids: list[int]
    seconds: float
    stats: GenerationStats | None  # None for peers that report none (transformers', llama.cpp's greedy)
    record_fields: dict = field(default_factory=dict)  # what a peer adds to its records (llama.cpp: its weights)
