"""Training the draft head (docs/algorithms.md §Draft head) on the data of ``training.draft_data``.

Loss per head output h at position p (the target's features f, its LM head W restricted to the
draft vocabulary V_K):

    L = SmoothL1(h_p, f_{p+1}) + w · CE(softmax(W[V_K] f_{p+1}), softmax(W[V_K] h_p))

Training-time test (EAGLE-3): the head is unrolled ``ttt_steps`` times. Step 1 reads the
target's features; step j reads, at position p, the head's own step-(j−1) output from position
p−1 — exactly what drafting feeds it — and attends to step-1 keys up to the chain's origin
p−j+1 and to the chain's own later keys (one per step), as at inference. Tokens along a chain
are the text's tokens: on the target's greedy text these are the tokens the head drafts when
every earlier draft was accepted, so the loss of step j is the loss of draft position j given
acceptance so far. Step j's loss is weighted ``ttt_decay``^(j−1). Small uniform noise on the
step-1 features imitates the drift of self-fed features.

Validation (the number to optimise, not the loss): on held-apart sequences of the target's own
greedy answers, the head's greedy acceptance by draft position i — P(draft i equals the
target's greedy token | drafts 1..i−1 did) — computed by the same unrolled forward, and the
mean accepted tokens per verification it implies for a fixed draft of ``val_steps``.

Seeded; checkpoints every ``checkpoint_every`` steps (atomically) and resumes from them.

Continued training (``init_head``): the head starts from a trained head's weights and keeps its
draft vocabulary and fused layers (the LM-head rows and the input projection must keep meaning
the same tokens and layers), and the history starts with that head's validation on the new
held-apart answers (epoch 0), so every later epoch is compared with it on the same chains.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import TierspecError
from ..heads.draft import DraftHead
from ..models import LoadedModel
from ..util import atomic_write
from .draft_data import DraftDataError, check_data_model


@dataclass(frozen=True)
class TrainConfig:
    draft_vocab_size: int = 8192  # K
    epochs: float = 2.0
    batch_tokens: int = 4096  # padded positions per optimisation step
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 30
    # w: EAGLE uses 0.1; on this model a 160-step probe (lr 1e-3) reached first-draft acceptance
    # 0.20 with w = 1 against 0.15 with w = 0.1, so the cross-entropy gets the same weight here.
    ce_weight: float = 1.0
    ttt_steps: int = 2  # unrolled draft steps trained (1 = teacher forcing only)
    ttt_decay: float = 0.8
    feature_noise: float = 0.2  # uniform noise amplitude, relative to the features' RMS
    val_fraction: float = 0.04
    val_steps: int = 5  # draft positions measured in validation
    max_val_sequences: int = 120
    checkpoint_every: int = 100
    bf16: bool = True  # matmuls in bfloat16 autocast (fp32 master weights)
    # Target layers fused into the head's input (EAGLE-3); None = every layer the data stores
    # (``training.draft_data.aux_layers``: layer 1 and the middle layer).
    feature_layers: tuple[int, ...] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.draft_vocab_size < 2 or self.ttt_steps < 1 or self.val_steps < 1 or self.batch_tokens < 16:
            raise TierspecError("draft_vocab_size >= 2, ttt_steps >= 1, val_steps >= 1 and batch_tokens >= 16 are required")
        if not 0.0 < self.val_fraction < 0.5:
            raise TierspecError(f"val_fraction must be in (0, 0.5), got {self.val_fraction}")


@dataclass
class Sequence:
    tokens: torch.Tensor  # [n] int64
    features: torch.Tensor  # [n, H] float16
    response_start: int
    kind: str  # own-greedy, own-sampled, reference


def load_sequences(folder: Path, feature_layers: tuple[int, ...] = ()) -> list[Sequence]:
    """Every sequence of every finished shard (damaged shards are refused with their name).
    ``feature_layers``: decoder layers whose stored outputs are appended to f (fused heads)."""
    from safetensors import safe_open

    shards = sorted(Path(folder).glob("shard-*.safetensors"))
    if not shards:
        raise DraftDataError(f"{folder} holds no finished data shard; run `tierspec drafter build-data` first")
    sequences = []
    for path in shards:
        try:
            with safe_open(str(path), "pt") as handle:
                kind = handle.metadata()["kind"]
                tokens = handle.get_tensor("tokens").long()
                features = handle.get_tensor("features")
                if feature_layers:
                    features = torch.cat([features] + [handle.get_tensor(f"aux_{i}") for i in feature_layers], dim=-1)
                offsets = handle.get_tensor("offsets").tolist()
                starts = handle.get_tensor("response_start").tolist()
        except Exception as error:
            raise DraftDataError(f"data shard {path} is damaged ({error}); delete it and rerun build-data") from None
        if offsets[-1] != len(tokens) or len(features) != len(tokens):
            raise DraftDataError(f"data shard {path} is inconsistent (offsets vs tokens); delete it and rerun build-data")
        for i, start in enumerate(starts):
            a, b = offsets[i], offsets[i + 1]
            if b - a >= 3:
                sequences.append(Sequence(tokens[a:b], features[a:b], int(start), kind))
    return sequences


def draft_vocabulary(sequences: list[Sequence], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent answer tokens (ids in the target's vocabulary), sorted by id."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for sequence in sequences:
        counts += torch.bincount(sequence.tokens[sequence.response_start :], minlength=vocab_size)[:vocab_size]
    size = min(size, vocab_size)
    top = torch.topk(counts, size).indices
    return torch.sort(top).values


def vocabulary_coverage(sequences: list[Sequence], draft_ids: torch.Tensor, vocab_size: int) -> float:
    """Share of answer tokens of ``sequences`` that lie in the draft vocabulary."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[draft_ids] = True
    total = hit = 0
    for sequence in sequences:
        answer = sequence.tokens[sequence.response_start :]
        total += len(answer)
        hit += int(inside[answer].sum())
    return hit / max(total, 1)


def split_sequences(sequences: list[Sequence], fraction: float, seed: int) -> tuple[list[Sequence], list[Sequence]]:
    """(train, validation): validation is a seeded share of the target's greedy answers only."""
    rng = random.Random(seed)
    order = list(range(len(sequences)))
    rng.shuffle(order)
    greedy = [i for i in order if sequences[i].kind == "own-greedy"]
    held = set(greedy[: max(1, int(fraction * len(sequences)))]) if greedy else set()
    return [sequences[i] for i in order if i not in held], [sequences[i] for i in order if i in held]


def batches(sequences: list[Sequence], batch_tokens: int, rng: random.Random) -> list[list[Sequence]]:
    """Length-bucketed batches of at most ``batch_tokens`` padded positions, in random order."""
    order = sorted(range(len(sequences)), key=lambda i: (len(sequences[i].tokens), rng.random()))
    result, batch, width = [], [], 0
    for i in order:
        length = len(sequences[i].tokens)
        if batch and max(width, length) * (len(batch) + 1) > batch_tokens:
            result.append(batch)
            batch, width = [], 0
        batch.append(sequences[i])
        width = max(width, length)
    if batch:
        result.append(batch)
    rng.shuffle(result)
    return result


def collate(batch: list[Sequence]) -> dict[str, torch.Tensor]:
    """Padded tensors: features f [B, T, H], tokens [B, T], lengths [B], response starts [B]."""
    width = max(len(s.tokens) for s in batch)
    features = torch.zeros(len(batch), width, batch[0].features.shape[-1], dtype=torch.float32)
    tokens = torch.zeros(len(batch), width, dtype=torch.long)
    for row, sequence in enumerate(batch):
        n = len(sequence.tokens)
        features[row, :n] = sequence.features.float()
        tokens[row, :n] = sequence.tokens
    lengths = torch.tensor([len(s.tokens) for s in batch])
    starts = torch.tensor([s.response_start for s in batch])
    return {"features": features, "tokens": tokens, "lengths": lengths, "starts": starts}


def chain_mask(width: int, step: int) -> torch.Tensor:
    """Attention mask [T, step·T] for the queries of unrolled step ``step`` (1-based) over the
    keys of steps 1..step laid side by side: a query at position p sees step-1 keys at
    positions ≤ p − step + 1 (the chain's origin and before) and, for each later step s, only
    the step-s key at position p − step + s (its own chain)."""
    p = torch.arange(width)[:, None]
    key = torch.arange(width)[None, :]
    blocks = [key <= p - step + 1]
    for s in range(2, step + 1):
        blocks.append(key == p - step + s)
    return torch.cat(blocks, dim=1)


class StepKeys:
    """The keys and values of the unrolled steps so far [B, kv_heads, T·steps, D], read by the next
    step's attention as a ``llama.KVLayer`` is read in drafting (same ``length`` / ``update`` /
    ``window``). Concatenated, not written into a buffer: autograd needs every step's keys
    unchanged until the backward pass, and an in-place write would change them."""

    def __init__(self):
        self.length = 0
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._keys.append(keys)
        self._values.append(values)
        self.length += int(keys.shape[-2])

    def window(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self._keys, dim=-2), torch.cat(self._values, dim=-2)


def unrolled_forward(head: DraftHead, batch: dict[str, torch.Tensor], steps: int, noise: float = 0.0,
                     generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Head outputs h_j [B, T, H] for unrolled steps j = 1..steps (see the module docstring), each
    step one pass of the head's ``forward`` (what drafting runs) over the keys of the steps before.

    Step j at position p reads (h_{j−1} at p−1, x_{p+1}) and predicts f_{p+1}; step 1 reads
    (f_p, x_{p+1}). Positions p < j−1 have no chain; their outputs are garbage and never scored.
    """
    features, tokens = batch["features"], batch["tokens"]
    B, T, _ = features.shape
    next_tokens = torch.cat((tokens[:, 1:], tokens[:, :1] * 0), dim=1)
    H = head.config.hidden_size
    inputs = head.target_input(features)
    if noise > 0:
        rms = features[..., :H].pow(2).mean().sqrt()
        inputs = inputs + (torch.rand(inputs.shape, generator=generator) - 0.5) * (noise * rms)
    positions, keys = torch.arange(T), StepKeys()
    outputs = []
    for step in range(1, steps + 1):
        if step > 1:
            previous = outputs[-1]
            inputs = torch.cat((torch.zeros_like(previous[:, :1]), previous[:, :-1]), dim=1)
        outputs.append(head(inputs, next_tokens, positions, keys, chain_mask(T, step), step * T))
    return outputs


def scored_positions(batch: dict[str, torch.Tensor], step: int) -> torch.Tensor:
    """Bool [B, T]: step-``step`` outputs that are trained/scored: the chain exists (p ≥ step−1),
    its target f_{p+1} exists (p + 1 < n), and it predicts an answer token (p + 2 ≥ start)."""
    B, T = batch["tokens"].shape
    p = torch.arange(T)[None, :]
    lengths, starts = batch["lengths"][:, None], batch["starts"][:, None]
    return (p >= step - 1) & (p + 1 < lengths) & (p + 2 >= starts)


def head_loss(head: DraftHead, batch: dict[str, torch.Tensor], config: TrainConfig,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    outputs = unrolled_forward(head, batch, config.ttt_steps, config.feature_noise, generator)
    features = batch["features"][..., : head.config.hidden_size]
    targets = torch.cat((features[:, 1:], torch.zeros_like(features[:, :1])), dim=1)  # f_{p+1}
    lm = head.lm_rows
    total = torch.zeros(())
    stats = {}
    mask1 = scored_positions(batch, 1)
    with torch.no_grad():
        teacher = F.softmax((targets[mask1] @ lm.t()).float(), dim=-1)  # [N, K]
    index = torch.cumsum(mask1.flatten(), 0).view_as(mask1) - 1  # row of each position in ``teacher``
    for step, h in enumerate(outputs, start=1):
        mask = scored_positions(batch, step)
        if not mask.any():
            continue
        predicted = h[mask]
        regression = F.smooth_l1_loss(predicted.float(), targets[mask], reduction="mean")
        log_student = F.log_softmax((predicted @ lm.t().to(predicted.dtype)).float(), dim=-1)
        soft = teacher[index[mask]]
        cross_entropy = -(soft * log_student).sum(-1).mean()
        total = total + config.ttt_decay ** (step - 1) * (regression + config.ce_weight * cross_entropy)
        with torch.no_grad():
            stats[f"top1_{step}"] = float((log_student.argmax(-1) == soft.argmax(-1)).float().mean())
    return total, stats


@torch.no_grad()
def validate(head: DraftHead, sequences: list[Sequence], steps: int, batch_tokens: int = 4096) -> dict:
    """Greedy acceptance by draft position on the target's own greedy answers, and the mean
    accepted tokens per verification (τ) of a fixed ``steps``-token draft it implies."""
    head.eval()
    reached = torch.zeros(steps + 1)  # chains whose drafts 1..i were all accepted (reached[0] = all chains)
    for batch_list in batches(sequences, batch_tokens, random.Random(0)):
        batch = collate(batch_list)
        outputs = unrolled_forward(head, batch, steps)
        tokens, lengths, starts = batch["tokens"], batch["lengths"], batch["starts"]
        B, T = tokens.shape
        # correct[j][b, o]: the step-j draft of the chain starting at origin o equals x_{o+j+1}.
        correct = []
        for j, h in enumerate(outputs, start=1):
            drafted = head.draft_ids[(h @ head.lm_rows.t()).argmax(-1)]  # [B, T] at positions p
            truth = torch.cat((tokens[:, 2:], tokens[:, :2] * 0 - 1), dim=1)  # x_{p+2}
            ok = drafted == truth  # indexed by p = o + j − 1
            correct.append(torch.cat((ok[:, j - 1 :], torch.zeros(B, j - 1, dtype=torch.bool)), dim=1))
        o = torch.arange(T)[None, :]
        # Chains start in the answer (o + 2 ≥ start) and have all ``steps`` targets in the sequence.
        valid = (o + 2 >= starts[:, None]) & (o + steps + 1 < lengths[:, None])
        alive = valid.clone()
        reached[0] += alive.sum()
        for j in range(steps):
            alive = alive & correct[j]
            reached[j + 1] += alive.sum()
    acceptance = [float(reached[i + 1] / reached[i]) if reached[i] > 0 else 0.0 for i in range(steps)]
    expected = 1.0 + sum(float(reached[i + 1] / reached[0]) for i in range(steps)) if reached[0] > 0 else 1.0
    return {"acceptance_by_position": [round(a, 4) for a in acceptance], "tau_fixed_draft": round(expected, 4),
            "chains": int(reached[0])}


def _lr(step: int, total: int, config: TrainConfig) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, total - config.warmup_steps)
    return config.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def train_head(target: LoadedModel, data: Path, config: TrainConfig = TrainConfig(), checkpoint: Path | None = None,
               progress: bool = True, log=None, init_head: DraftHead | None = None) -> tuple[DraftHead, dict]:
    """Train a head on the data in ``data`` for ``target``; resumes from ``checkpoint`` if it
    exists (same settings and data); continues ``init_head`` when given. Returns the head and its
    metrics."""
    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    plan = check_data_model(data, target.identity)
    if init_head is not None:
        config = _continued_config(config, init_head)
    if config.feature_layers is None:
        config = replace(config, feature_layers=tuple(plan.get("aux_layers", [])))
    missing = set(config.feature_layers) - set(plan.get("aux_layers", []))
    if missing:
        raise DraftDataError(f"the data in {data} stores layers {plan.get('aux_layers')}, not {sorted(missing)}")
    started = time.perf_counter()
    sequences = load_sequences(data, config.feature_layers)
    log(f"data: {len(sequences)} sequences loaded from {data} in {time.perf_counter() - started:.1f} s")
    return fit_head(target, sequences, config, checkpoint, progress, log, init_head)


def _continued_config(config: TrainConfig, init_head: DraftHead) -> TrainConfig:
    """``config`` with the starting head's draft vocabulary size and fused layers (refused when
    the settings ask for other layers: the head's input projection reads exactly its own)."""
    layers = tuple(init_head.config.feature_layers)
    if config.feature_layers is not None and tuple(config.feature_layers) != layers:
        raise TierspecError(f"the starting head fuses target layers {list(layers)}, not {list(config.feature_layers)}; "
                            "leave --feature-layers out to continue it")
    return replace(config, draft_vocab_size=int(len(init_head.draft_ids)), feature_layers=layers)


def fit_head(target: LoadedModel, sequences: list[Sequence], config: TrainConfig = TrainConfig(),
             checkpoint: Path | None = None, progress: bool = True, log=None,
             init_head: DraftHead | None = None) -> tuple[DraftHead, dict]:
    """Train a head on ``sequences`` (split into train / validation here); a new one, or
    ``init_head`` continued (its weights and draft vocabulary; it is not modified)."""
    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    if init_head is not None:
        config = _continued_config(config, init_head)
        if init_head.target_identity is None or not init_head.target_identity.matches(target.identity):
            raise TierspecError("the starting head was trained for another model")
    if config.feature_layers is None:
        config = replace(config, feature_layers=())
    started = time.perf_counter()
    train, val = split_sequences(sequences, config.val_fraction, config.seed)
    if not val:
        raise DraftDataError("the data holds no greedy answers of the target to validate on; build more data")
    val = val[: config.max_val_sequences]
    vocab = target.identity.vocab_size
    draft_ids = draft_vocabulary(train, config.draft_vocab_size, vocab) if init_head is None else init_head.draft_ids
    coverage = vocabulary_coverage(val, draft_ids, vocab)
    log(f"data: {len(train)} train / {len(val)} validation sequences, "
        f"{sum(len(s.tokens) - s.response_start for s in train)} train answer tokens; draft vocabulary "
        f"K={len(draft_ids)} covers {coverage:.4f} of validation answer tokens")
    torch.manual_seed(config.seed)
    head = DraftHead.for_target(target, draft_ids, config.seed, config.feature_layers)
    if init_head is not None:
        head.load_state_dict(init_head.state_dict())
    parameters = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay)
    epoch_batches = _epoch_order(train, config, 0)
    total_steps = max(1, int(config.epochs * len(epoch_batches)))
    step = 0
    history: list[dict] = []
    fingerprint = {"config": asdict(config), "sequences": len(sequences), "model": target.identity.to_dict(),
                   "init_head": None if init_head is None else _weights_digest(init_head)}
    # The noise generator: its state is part of the checkpoint (a resumed run draws what an
    # uninterrupted one would have).
    generator = torch.Generator().manual_seed(config.seed)
    window: list[float] = []  # losses since the last history entry
    if checkpoint is not None and checkpoint.exists():
        state = _read_checkpoint(checkpoint, fingerprint, total_steps)
        try:
            head.load_state_dict(state["head"])
            optimizer.load_state_dict(state["optimizer"])
            generator.set_state(state["noise_generator"])
        except (RuntimeError, ValueError, KeyError, TypeError) as error:
            raise DraftDataError(f"checkpoint {checkpoint} does not fit this head ({error}); delete it to start "
                                 "over") from None
        step, history, window = state["step"], state["history"], state["window"]
        # the earlier runs' seconds up to the checkpoint (a checkpoint of the version before holds none)
        earlier = state.get("seconds")
        started -= float(earlier) if isinstance(earlier, (int, float)) and 0 <= earlier < math.inf else 0.0
        log(f"resumed from {checkpoint} at step {step}/{total_steps}")
    elif init_head is not None:  # epoch 0: the starting head on the same validation chains
        entry = {"step": 0, "epoch": 0.0, "train_loss": None, "val_loss": round(validation_loss(head, val, config), 4),
                 "seconds": round(time.perf_counter() - started, 1), **validate(head, val, config.val_steps)}
        history.append(entry)
        log("validation (starting head) " + json.dumps(entry))
    from tqdm.auto import tqdm

    bar = tqdm(total=total_steps, initial=step, desc="train head", disable=not progress)
    epoch = step // len(epoch_batches)
    if epoch:
        epoch_batches = _epoch_order(train, config, epoch)
    head.train()
    while step < total_steps:
        epoch, offset = divmod(step, len(epoch_batches))
        if offset == 0 and step:
            epoch_batches = _epoch_order(train, config, epoch)
        batch = collate(epoch_batches[offset])
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, total_steps, config)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16):
            loss, stats = head_loss(head, batch, config, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        step += 1
        window.append(float(loss.detach()))
        bar.update(1)
        bar.set_postfix_str(f"loss {sum(window[-20:]) / len(window[-20:]):.3f} top1 {stats.get('top1_1', 0):.3f}")
        if not progress and step % 50 == 0:
            log(f"step {step}/{total_steps} loss {sum(window[-50:]) / len(window[-50:]):.4f} "
                f"top1 {stats.get('top1_1', 0):.3f} ({time.perf_counter() - started:.0f} s)")
        end_of_epoch = step % len(epoch_batches) == 0 or step == total_steps
        if end_of_epoch or (checkpoint is not None and step % config.checkpoint_every == 0):
            if end_of_epoch:
                metrics = validate(head, val, config.val_steps)
                entry = {"step": step, "epoch": round(step / len(epoch_batches), 2),
                         "train_loss": round(sum(window) / max(len(window), 1), 4),
                         "val_loss": round(validation_loss(head, val, config), 4),
                         "seconds": round(time.perf_counter() - started, 1), **metrics}
                history.append(entry)
                window = []
                log("validation " + json.dumps(entry))
                head.train()
            if checkpoint is not None:
                _save_checkpoint(checkpoint, {"fingerprint": fingerprint, "head": head.state_dict(),
                                              "optimizer": optimizer.state_dict(), "step": step, "history": history,
                                              "window": window, "noise_generator": generator.get_state(),
                                              "seconds": time.perf_counter() - started})
    bar.close()
    head.eval()
    final = history[-1] if history and history[-1]["step"] == step else validate(head, val, config.val_steps)
    metrics = {"train_seconds": round(time.perf_counter() - started, 1), "steps": step,
               "train_sequences": len(train), "validation_sequences": len(val),
               "draft_vocab_size": len(draft_ids), "validation_vocab_coverage": round(coverage, 4),
               "validation": final, "history": history, "train_config": asdict(config)}
    return head, metrics


@torch.no_grad()
def validation_loss(head: DraftHead, sequences: list[Sequence], config: TrainConfig) -> float:
    """The training loss (no noise) averaged over validation batches."""
    was_training = head.training
    head.eval()
    total, count = 0.0, 0
    for batch_list in batches(sequences, config.batch_tokens, random.Random(0)):
        loss, _ = head_loss(head, collate(batch_list), replace(config, feature_noise=0.0))
        total += float(loss)
        count += 1
    head.train(was_training)
    return total / max(count, 1)


def _weights_digest(head: DraftHead) -> str:
    """SHA-256 over a head's weights (names, shapes, bytes): identifies the starting head in a
    checkpoint's fingerprint, so a resume cannot continue from another one."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(head.state_dict().items()):
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _epoch_order(train: list[Sequence], config: TrainConfig, epoch: int) -> list[list[Sequence]]:
    return batches(train, config.batch_tokens, random.Random(config.seed * 1000 + epoch))


def _save_checkpoint(path: Path, state: dict) -> None:
    atomic_write(path, lambda staging: torch.save(state, staging))


def _read_checkpoint(path: Path, fingerprint: dict, total_steps: int) -> dict:
    """The training state in ``path``, checked before any of it is used. Read with
    ``weights_only``: tensors and plain containers only, so a planted pickle runs no code."""
    import pickle

    try:
        state = torch.load(path, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError, AttributeError) as error:
        raise DraftDataError(f"checkpoint {path} is not a training checkpoint tierspec can read "
                             f"({str(error).splitlines()[0] if str(error) else type(error).__name__}); delete it to "
                             "start over") from None
    shapes = {"head": dict, "optimizer": dict, "step": int, "history": list, "window": list,
              "noise_generator": torch.Tensor}
    if (not isinstance(state, dict) or state.get("fingerprint") != fingerprint
            or any(not isinstance(state.get(key), kind) for key, kind in shapes.items())
            or not 0 <= state["step"] <= total_steps):
        raise DraftDataError(f"checkpoint {path} was made with other settings or data; delete it to start over")
    return state
