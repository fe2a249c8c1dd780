"""Quality metrics: task metrics (GSM8K exact match, HumanEval pass@1, ROUGE-L, BLEU, the
JSON-extraction set's validity) and fidelity to the target (exact match and ROUGE-L against its
greedy output, target NLL)."""

from __future__ import annotations

import re

import torch

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The answer a solution ends on: the number after '####' when present, else the last
    number in the text; commas and a trailing '.0' are normalised away."""
    if "####" in text:
        text = text.split("####")[-1]
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    value = numbers[-1].replace(",", "").rstrip(".")
    if "." in value:
        value = value.rstrip("0").rstrip(".")
    return value


def json_extract_scores(schema: dict, text: str, reference: str | None, cut: bool = False) -> dict:
    """The JSON-extraction set's columns for one text (``json_extract.check_output``):
    ``json_valid`` 1.0 when it parses and validates against ``schema`` (else 0.0, with
    ``json_error`` saying why); ``json_cut`` 1.0 when it is not valid and the token budget ended it
    (``cut``: the budget's last token was not an end token), so that no grammar could have
    completed it; and where the task has a gold answer (``reference``, JSON text of the gold
    fields: GSM8K's ``answer``) ``json_answer_match``, 1.0 when a valid text's answer equals it."""
    import json

    from .json_extract import check_output

    validity = check_output(schema, text)
    scores: dict = {"json_valid": float(validity.valid), "json_cut": float(cut and not validity.valid)}
    if not validity.valid:
        scores["json_error"] = validity.error
    gold = json.loads(reference) if reference else {}
    if "answer" in gold:
        scores["json_answer_match"] = float(validity.valid and validity.value.get("answer") == gold["answer"])
    return scores


def gsm8k_exact_match(generated: str, reference: str) -> float:
    predicted, gold = final_number(generated), final_number(reference)
    return float(predicted is not None and predicted == gold)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 (rouge-score, with stemming)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return float(scorer.score(reference, prediction)["rougeL"].fmeasure)


def corpus_bleu(predictions: list[str], references: list[str]) -> float:
    """Corpus BLEU (sacrebleu, default 13a tokenisation)."""
    import sacrebleu

    return float(sacrebleu.corpus_bleu(predictions, [references]).score)


def extract_code(generated: str, prompt: str, entry_point: str) -> str:
    """The program to test: the first fenced code block that defines the entry point (or the
    first fenced block, or the raw text); if it does not define the function, the completion
    is appended to the HumanEval prompt."""
    blocks = re.findall(r"```(?:python|py)?\s*\n(.*?)```", generated, flags=re.S)
    if not blocks and "```" in generated:  # unterminated block (generation cut off)
        blocks = [generated.split("```", 1)[1].split("\n", 1)[-1]]
    chosen = next((b for b in blocks if f"def {entry_point}" in b), blocks[0] if blocks else generated)
    if f"def {entry_point}" in chosen:
        # keep the prompt's imports, which the reply often omits
        imports = "\n".join(line for line in prompt.splitlines() if line.startswith(("import ", "from ")))
        return f"{imports}\n{chosen}"
    return prompt + chosen


def humaneval_pass(program: str, test: str, entry_point: str, timeout: float = 10.0, sandbox: bool = True) -> bool:
    """Run ``program`` + HumanEval ``test`` + ``check(entry_point)`` in the sandbox
    (``bench.sandbox.run_sandboxed``: its own PID, mount and network namespaces, a read-only view of
    the system, time, memory, file-size and process limits, a scratch folder; ``sandbox=False``:
    the user's opt-out, limits only); the caller has checked that the user allows it."""
    from .sandbox import Limits, run_sandboxed

    source = f"{program}\n\n{test}\n\ncheck({entry_point})\n"
    return run_sandboxed(source, Limits(wall_seconds=timeout, cpu_seconds=max(1, int(timeout))), sandbox).passed


def target_nll(model: torch.nn.Module, prompt_ids: torch.Tensor, generated_ids: list[int]) -> float:
    """Mean negative log-likelihood (nats, temperature 1) the target assigns to the generated tokens."""
    if not generated_ids:
        return float("nan")
    if getattr(model.config, "is_encoder_decoder", False):  # the prompt is the source; score the decoder's tokens
        from ..seq2seq import decoder_logits

        logprobs = decoder_logits(model, prompt_ids, generated_ids)[:-1].log_softmax(-1)
        return float(-logprobs[torch.arange(len(generated_ids)), torch.tensor(generated_ids)].mean())
    ids = torch.cat([prompt_ids, torch.tensor(generated_ids, dtype=torch.long)])[None]
    n = len(generated_ids)
    with torch.inference_mode():
        device = next(model.parameters()).device
        logits = model(input_ids=ids.to(device), use_cache=False, logits_to_keep=n + 1).logits[0, :-1].float().cpu()
    logprobs = logits.log_softmax(-1)
    return float(-logprobs[torch.arange(n), torch.tensor(generated_ids)].mean())
