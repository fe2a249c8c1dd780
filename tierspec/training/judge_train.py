"""Training and evaluating the judge head (Judge Decoding §4, docs/algorithms.md §Judge decoding).

Hidden states of the target are extracted once per example (batches of labelled tokens, a
progress bar), then a linear head is trained with class-weighted cross-entropy, AdamW
(lr 1e-4, weight decay 0.1, batch 128) and early stopping on the validation split.

Metrics: AUROC over all labelled validation tokens, and the *matched* AUROC — each mistaken
token against the token at the same place in the correct response of the same problem —
since the all-token figure mostly measures token type (numbers after '=' are where the
mistakes are). At the chosen threshold: recall and precision of negatives on the matched set.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..cached_model import HiddenCapture
from ..errors import TierspecError
from ..heads.judge import JudgeHead, judge_features
from ..models import LoadedModel
from ..prompting import encode_prompt
from ..util import atomic_write, atomic_write_text, one_line
from .judge_data import JudgeExample, read_judge_data, token_labels


@dataclass
class LabelledTokens:
    features: torch.Tensor  # [N, F]
    labels: torch.Tensor  # [N] 1 = acceptable, 0 = mistake
    example: list[str]  # example id per token
    offset: list[int]  # character offset in the response per token
    split: list[str]


def _extract_examples(target: LoadedModel, examples: list[JudgeExample], kind: str) -> LabelledTokens:
    """One target pass per example; features of every labelled response token (none: an empty record)."""
    tokenizer = target.tokenizer
    feats, labels, ids, offsets, splits = [], [], [], [], []
    for example in examples:
        prompt_ids = encode_prompt(target, example.prompt)
        encoded = tokenizer(example.response, add_special_tokens=False, return_offsets_mapping=True)
        response_ids = torch.tensor(encoded["input_ids"], dtype=torch.long)
        token_label = token_labels([tuple(o) for o in encoded["offset_mapping"]], example.mistake_offset)
        keep = [i for i, label in enumerate(token_label) if label is not None]
        if not keep:
            continue
        ids_all = torch.cat([prompt_ids, response_ids])[None]
        with HiddenCapture(target.model) as capture, torch.inference_mode():
            logits = target.model(input_ids=ids_all.to(target.device), use_cache=False,
                                  logits_to_keep=len(response_ids) + 1).logits[0].float().cpu()
        # [len(response)+1, H]: the LM head's inputs from the position before the response on
        hidden = capture.features()[-(len(response_ids) + 1):]
        # Row j+1 is response token j's own position; logits row j predicted it.
        index = torch.tensor(keep)
        feats.append(judge_features(hidden[index + 1], logits[index], response_ids[index], kind))
        labels.extend(token_label[i] for i in keep)
        ids.extend([example.id] * len(keep))
        offsets.extend(encoded["offset_mapping"][i][0] for i in keep)
        splits.extend([example.split] * len(keep))
    features = torch.cat(feats) if feats else torch.zeros(0, 0)
    return LabelledTokens(features, torch.tensor(labels, dtype=torch.float32), ids, offsets, splits)


def extract(target: LoadedModel, examples: list[JudgeExample], kind: str, progress: bool = True,
            store: "FeatureStore | None" = None) -> LabelledTokens:
    """One target pass per example; features of every labelled response token. With ``store``, the
    examples go in chunks of ``FeatureStore.CHUNK``, each kept there as it is done and taken from it
    on a rerun (a killed ``judge train`` resumes after its extracted chunks)."""
    from tqdm.auto import tqdm

    parts = []
    bar = tqdm(total=len(examples), desc="judge features", disable=not progress)
    size = FeatureStore.CHUNK if store is not None else max(len(examples), 1)
    for number, start in enumerate(range(0, len(examples), size)):
        chunk = examples[start:start + size]
        part = store.load(number) if store is not None else None
        if part is None:
            started = time.perf_counter()
            part = _extract_examples(target, chunk, kind)
            if store is not None:
                store.save(number, part, time.perf_counter() - started)
        parts.append(part)
        bar.update(len(chunk))
    bar.close()
    parts = [part for part in parts if part.labels.numel()]
    if not parts:
        raise TierspecError("no labelled response token in the judge data")
    return LabelledTokens(torch.cat([part.features for part in parts]), torch.cat([part.labels for part in parts]),
                          [i for part in parts for i in part.example], [o for part in parts for o in part.offset],
                          [s for part in parts for s in part.split])


class FeatureStore:
    """A ``judge train``'s extracted features, kept chunk by chunk in a hidden folder beside its
    ``--out`` until the head is saved (``discard``): extraction is one target pass per example,
    the job's long part, and a rerun with the same data, target and feature kind takes the chunks
    done from here. Its ``plan.json`` names what the chunks were made from; a folder made
    otherwise is said and emptied, a damaged chunk said and made again."""

    FORMAT = "tierspec-judge-features/1"
    #: examples a chunk (a file) holds
    CHUNK = 32

    def __init__(self, folder: Path, data_path: Path, target: LoadedModel, kind: str):
        self.folder = Path(folder)
        digest = hashlib.sha256(Path(data_path).read_bytes()).hexdigest()
        self.plan = {"format": self.FORMAT, "data_sha256": digest, "model": target.identity.to_dict(), "kind": kind,
                     "chunk": self.CHUNK}
        #: the extraction seconds of the chunks taken from the folder (their runs' time)
        self.resumed_seconds = 0.0
        self.resumed_chunks = 0
        plan_path = self.folder / "plan.json"
        if plan_path.exists():
            try:
                previous = json.loads(plan_path.read_text())
                problem = None if previous == self.plan else "its features were extracted from other data, model or kind"
            except (OSError, ValueError) as error:
                problem = f"damaged ({one_line(error)[:120]})"
            if problem is None:
                return
            print(f"tierspec: {self.folder}: {problem}; the extraction starts over", file=sys.stderr)
            shutil.rmtree(self.folder, ignore_errors=True)
        atomic_write_text(plan_path, json.dumps(self.plan, indent=2))

    def _path(self, number: int) -> Path:
        return self.folder / f"chunk-{number:05d}.safetensors"

    def load(self, number: int) -> LabelledTokens | None:
        """Chunk ``number`` as saved (None: not done yet, or damaged — said, and made again)."""
        from safetensors import safe_open

        path = self._path(number)
        if not path.exists():
            return None
        try:
            with safe_open(str(path), "pt") as handle:
                meta = handle.metadata() or {}
                features, labels, offsets = (handle.get_tensor(n) for n in ("features", "labels", "offsets"))
            example, split, seconds = json.loads(meta["example"]), json.loads(meta["split"]), float(meta["seconds"])
            rows = len(labels)
            if features.dim() != 2 or features.shape[0] != rows or len(offsets) != rows or len(example) != rows \
                    or len(split) != rows or not all(isinstance(v, str) for v in example + split):
                raise ValueError("its records disagree in length")
        except Exception as error:  # safetensors raises several types for a damaged file
            print(f"tierspec: {path}: damaged ({one_line(error)[:120]}); its examples are extracted again", file=sys.stderr)
            return None
        self.resumed_seconds += seconds
        self.resumed_chunks += 1
        return LabelledTokens(features, labels, example, offsets.tolist(), split)

    def save(self, number: int, part: LabelledTokens, seconds: float) -> None:
        """Chunk ``number``, atomically."""
        from safetensors.torch import save_file

        tensors = {"features": part.features.contiguous(), "labels": part.labels.contiguous(),
                   "offsets": torch.tensor(part.offset, dtype=torch.long)}
        meta = {"example": json.dumps(part.example), "split": json.dumps(part.split), "seconds": repr(seconds)}
        atomic_write(self._path(number), lambda staging: save_file(tensors, str(staging), metadata=meta))

    @staticmethod
    def discard_folder(folder: Path) -> None:
        """``folder`` removed (the head is saved: nothing left to resume)."""
        shutil.rmtree(folder, ignore_errors=True)


def features_folder(out: Path) -> Path:
    """Where ``judge train --out out`` keeps its extracted features until the head is saved."""
    out = Path(out)
    return out.with_name(f".{out.name}.features")


def class_weights(labels: torch.Tensor) -> torch.Tensor:
    """Per-sample weights making both classes weigh the same in the loss."""
    positives = labels.sum()
    negatives = len(labels) - positives
    if positives == 0 or negatives == 0:
        raise TierspecError("training data needs both correct and mistaken tokens")
    w_pos, w_neg = len(labels) / (2 * positives), len(labels) / (2 * negatives)
    return torch.where(labels > 0.5, w_pos, w_neg)


def train_head(train_x: torch.Tensor, train_y: torch.Tensor, val_x: torch.Tensor, val_y: torch.Tensor, *,
               weighted: bool = True, lr: float = 1e-4, weight_decay: float = 0.1, batch_size: int = 128,
               max_epochs: int = 200, patience: int = 8, seed: int = 0, progress: bool = False):
    """Linear head on standardised features; returns (weight, bias, mean, std, epochs run)."""
    from tqdm.auto import tqdm

    generator = torch.Generator().manual_seed(seed)
    mean = train_x.mean(0)
    std = train_x.std(0).clamp_min(1e-6)
    xs, vs = (train_x - mean) / std, (val_x - mean) / std
    linear = torch.nn.Linear(train_x.shape[1], 1)
    torch.nn.init.zeros_(linear.weight)
    torch.nn.init.zeros_(linear.bias)
    optimiser = torch.optim.AdamW(linear.parameters(), lr=lr, weight_decay=weight_decay)
    weights = class_weights(train_y) if weighted else torch.ones_like(train_y)
    val_weights = class_weights(val_y) if weighted and 0 < val_y.sum() < len(val_y) else torch.ones_like(val_y)
    best, best_state, since, epochs = math.inf, None, 0, 0
    for epoch in tqdm(range(max_epochs), desc="judge training", disable=not progress):
        epochs = epoch + 1
        order = torch.randperm(len(xs), generator=generator)
        for start in range(0, len(xs), batch_size):
            batch = order[start : start + batch_size]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                linear(xs[batch]).squeeze(-1), train_y[batch], weight=weights[batch])
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
        with torch.no_grad():
            val_loss = float(torch.nn.functional.binary_cross_entropy_with_logits(linear(vs).squeeze(-1), val_y, weight=val_weights))
        if val_loss < best - 1e-5:
            best, since = val_loss, 0
            best_state = (linear.weight.detach().clone()[0], float(linear.bias.detach()[0]))
        else:
            since += 1
            if since >= patience:
                break
    return best_state[0], best_state[1], mean, std, epochs


def auroc(labels, scores) -> float | None:
    from sklearn.metrics import roc_auc_score

    labels = np.asarray(labels)
    if labels.min() == labels.max():
        return None
    return float(roc_auc_score(labels, np.asarray(scores)))


def matched_pairs(tokens: LabelledTokens, scores: torch.Tensor, split: str = "val",
                  kind: str | None = None) -> list[tuple[float, float]]:
    """(score of each mistaken token, score of the correct response's token at the same offset).

    Wrong responses are ``<problem>-<kind>`` beside ``<problem>-correct`` (kind ``wrong`` for a
    planted arithmetic error, ``copy`` for a copying drafter's mistake); ``kind`` keeps one."""
    by_key = {}
    for i, (example, offset, s) in enumerate(zip(tokens.example, tokens.offset, tokens.split)):
        if s == split:
            by_key[(example, offset)] = i
    pairs = []
    for i, (example, label, s) in enumerate(zip(tokens.example, tokens.labels.tolist(), tokens.split)):
        base, _, suffix = example.rpartition("-")
        if s != split or label != 0 or suffix == "correct" or (kind is not None and suffix != kind):
            continue
        twin = base + "-correct"
        j = by_key.get((twin, tokens.offset[i]))
        if j is not None:
            pairs.append((float(scores[i]), float(scores[j])))
    return pairs


def evaluate_head(head: JudgeHead, tokens: LabelledTokens, split: str = "val") -> dict:
    mask = torch.tensor([s == split for s in tokens.split])
    scores = head.probability(tokens.features)
    pairs = matched_pairs(tokens, scores, split)
    neg_scores = [p[0] for p in pairs]
    pos_scores = [p[1] for p in pairs]
    rejected_neg = sum(s < head.threshold for s in neg_scores)
    rejected_pos = sum(s < head.threshold for s in pos_scores)
    labels = tokens.labels[mask]
    return {
        "tokens": int(mask.sum()),
        "negatives": int((labels == 0).sum()),
        "auroc_all": auroc(labels.numpy(), scores[mask].numpy()),
        "auroc_matched": auroc([0] * len(pairs) + [1] * len(pairs), neg_scores + pos_scores) if pairs else None,
        "matched_pairs": len(pairs),
        "matched_by_kind": _matched_by_kind(tokens, scores, split, head.threshold),
        "threshold": head.threshold,
        # negatives = mistakes; "recall" = share of mistaken tokens the judge refuses
        "matched_negative_recall": rejected_neg / len(pairs) if pairs else None,
        "matched_negative_precision": rejected_neg / (rejected_neg + rejected_pos) if rejected_neg + rejected_pos else None,
        "matched_mistakes_accepted": 1 - rejected_neg / len(pairs) if pairs else None,
        "all_mistakes_accepted": float((scores[mask][labels == 0] >= head.threshold).float().mean()) if (labels == 0).any() else None,
        "all_correct_accepted": float((scores[mask][labels == 1] >= head.threshold).float().mean()),
    }


def _matched_by_kind(tokens: LabelledTokens, scores: torch.Tensor, split: str, threshold: float) -> dict:
    """Matched AUROC and the share of mistaken tokens accepted at ``threshold``, per error kind."""
    kinds = sorted({e.rpartition("-")[2] for e in tokens.example} - {"correct"})
    result = {}
    for kind in kinds:
        pairs = matched_pairs(tokens, scores, split, kind)
        if pairs:
            negatives, positives = [p[0] for p in pairs], [p[1] for p in pairs]
            result[kind] = {"pairs": len(pairs), "auroc": auroc([0] * len(pairs) + [1] * len(pairs), negatives + positives),
                            "mistakes_accepted": sum(n >= threshold for n in negatives) / len(pairs)}
    return result


def choose_threshold(scores_of_mistakes: list[float], max_mistake_acceptance: float = 0.1) -> float:
    """The lowest threshold that accepts at most ``max_mistake_acceptance`` of mistaken tokens:
    judge-accepting a wrong token changes the answer, so the error rate is what is capped."""
    if not scores_of_mistakes:
        return 0.5
    ranked = sorted(scores_of_mistakes, reverse=True)
    allowed = int(math.floor(max_mistake_acceptance * len(ranked)))
    return float(min(1.0, ranked[allowed] + 1e-6)) if allowed < len(ranked) else 0.0


def train_judge(target: LoadedModel, data_path: Path, kind: str = "hidden+logprob", progress: bool = True,
                max_mistake_acceptance: float = 0.1, seed: int = 0, threshold_from: str = "train",
                features: Path | None = None) -> tuple[JudgeHead, dict]:
    """Train a judge head; its threshold caps the accepted share of mistaken tokens, measured on
    the training split (``threshold_from="train"``) or on the held-out validation split
    (``"val"``: for mismatch data, the operating point on the validation curve of harmless vs
    harmful draft tokens accepted, printed in the metrics). ``features``: a folder that keeps the
    extracted features until the caller has saved the head (``FeatureStore``; a rerun resumes)."""
    if threshold_from not in ("train", "val"):
        raise TierspecError(f"threshold_from must be 'train' or 'val', got '{threshold_from}'")
    started = time.perf_counter()
    examples = read_judge_data(data_path)
    store = FeatureStore(features, data_path, target, kind) if features is not None else None
    tokens = extract(target, examples, kind, progress, store)
    is_val = torch.tensor([s == "val" for s in tokens.split])
    if not is_val.any() or is_val.all():
        raise TierspecError("judge data needs both a 'train' and a 'val' split")
    weight, bias, mean, std, epochs = train_head(tokens.features[~is_val], tokens.labels[~is_val], tokens.features[is_val],
                                                 tokens.labels[is_val], seed=seed, progress=progress)
    head = JudgeHead(weight, bias, mean, std, kind, 0.5, target.identity)
    curve_info = {}
    if threshold_from == "train":
        # Threshold from the *training* split's mistakes (validation stays untouched for the report).
        train_scores = head.probability(tokens.features[~is_val])
        head.threshold = choose_threshold(train_scores[tokens.labels[~is_val] == 0].tolist(), max_mistake_acceptance)
    else:
        from .judge_mismatches import choose_operating_point, draft_token_scores, operating_curve

        scores = head.probability(tokens.features)
        harmless, harmful = draft_token_scores(tokens, scores, "val")
        if harmless and harmful:
            curve = operating_curve(harmless, harmful)
            point = choose_operating_point(curve, max_mistake_acceptance)
            curve_info = {"operating_curve": curve, "operating_point": point,
                          "val_draft_tokens": {"harmless": len(harmless), "harmful": len(harmful)}}
        else:  # planted-error data: cap the validation split's mistaken tokens
            val_scores = scores[is_val]
            point = {"threshold": choose_threshold(val_scores[tokens.labels[is_val] == 0].tolist(), max_mistake_acceptance)}
        head.threshold = point["threshold"]
    metrics = evaluate_head(head, tokens, "val")
    metrics.update(curve_info)
    metrics_train = evaluate_head(head, tokens, "train")
    head.metadata = {
        "data_sha256": hashlib.sha256(Path(data_path).read_bytes()).hexdigest(),
        "epochs": epochs,
        # every run's: the chunks this run took from ``features`` were extracted by earlier ones
        "train_seconds": round(time.perf_counter() - started + (store.resumed_seconds if store else 0.0), 1),
        "validation": metrics,
        "train": {k: metrics_train[k] for k in ("auroc_all", "auroc_matched")},
    }
    return head, metrics
