"""Calibration text for the DIMR mask search (docs/algorithms.md §DIMR mask search): prompts
continued greedily by the target, teacher-forced rows the search scores masks on. A data-building
job, above the runtime: it runs the decode loop, while ``layerskip.search`` only scores masks on
the rows it is given."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..decode import DecodeConfig, DecodeRun
from ..errors import TierspecError
from ..layerskip.search import Calibration, with_target_scores
from ..methods import build_method
from ..models import LoadedModel
from ..prompting import encode_prompt, eos_ids
from ..seq2seq import decoder_start, is_encoder_decoder


def build_calibration(
    target: LoadedModel,
    prompts: list[str],
    context_tokens: int = 32,
    window: int = 32,
    progress: bool = True,
) -> Calibration:
    """Greedy-continue each prompt by ``window`` tokens with the target (the lossless ``pld``
    method, so exactly the target's greedy text); keep the last ``context_tokens`` prompt
    tokens + the continuation. Prompts whose continuation ends early are skipped.

    An encoder–decoder target (``seq2seq``): each prompt is a source for the encoder, and its
    row is the decoder start token + the target's greedy continuation (the routed units are the
    decoder's)."""
    seq2seq = is_encoder_decoder(target.model)
    greedy = build_method("pld", target)
    rows, sources = [], []
    for text in tqdm(prompts, desc="calibration text", disable=not progress):
        prompt_ids = encode_prompt(target, text)
        continuation = DecodeRun(target, greedy, prompt_ids, DecodeConfig(max_new_tokens=window,
                                                                           eos_token_ids=eos_ids(target))).finish().token_ids
        if len(continuation) < window:
            continue
        if seq2seq:
            sources.append(prompt_ids)
            rows.append(decoder_start(target.model).tolist() + continuation[:window])
        elif len(prompt_ids) >= context_tokens:
            rows.append(prompt_ids.tolist()[-context_tokens:] + continuation[:window])
    if not rows:
        raise TierspecError("no calibration sequence could be built: every prompt ended before the window filled")
    calibration = Calibration(torch.tensor(rows), window, sources=sources if seq2seq else None)
    return with_target_scores(target.model, calibration)
