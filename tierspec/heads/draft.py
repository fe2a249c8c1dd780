"""The draft head (EAGLE-style, docs/algorithms.md §Draft head): one decoder layer of the target's
own architecture that predicts the target's next feature vector, read out through the target's
frozen LM head restricted to a reduced draft vocabulary.

Notation: f_t is the vector the target's LM head reads at position t (its final hidden state),
x_t the token at t, E the target's embedding, W_lm its LM head. At position t the head reads

    input_t = W_fc [f_t ; E(x_{t+1})]                                  [H]
    h_t     = norm(layer(input_≤t))  ≈ f_{t+1}                         [H]
    logits  = W_lm[V_K] · h_t       over the K draft tokens V_K        [K]

``layer`` is ``tierspec.llama``'s decoder layer (RMSNorm, rotary grouped-query attention, SwiGLU
MLP) with the target's shapes, initialised from the target's last layer; ``norm`` is a copy of the
target's final norm. The same layer runs in training (a batch, ``training.draft_train``) and in drafting
(``HeadRunner``, over a ``llama.KVLayer`` like every target layer's). Drafting feeds f_t from the
target for committed positions and the head's own h for the positions after them. Tokens outside
V_K have draft probability 0; verification stays over the full vocabulary, so the exact rule
stays exact.

The module holds only what it trains: W_fc, the layer and the norm. E and W_lm[V_K] are taken
from the target when the head is attached (``DraftHead.attach``) and never saved; the file
stores the vocabulary map V_K (target ids) and the target's identity, and loading onto another
model is refused. The file names the layer's weights as transformers does (``q_proj.weight`` …,
``input_norm``, ``post_attention_norm``, ``final_norm``: ``FILE_NAMES``), so heads saved before
the layer was ``llama``'s load unchanged.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ..errors import TierspecError
from ..identity import ModelIdentity
from ..kernels import FewRowLinear, few_row_linear
from ..layerskip.masks import decoder_layers
from ..llama import (DecoderLayer, KVLayer, PassLayout, RMSNorm, RotaryTable, ViewOnReadKVLayer, has_projections,
                     projection_weights, slot_mask)
from ..models import LoadedModel, output_vocabulary_size
from ..util import atomic_write, atomic_write_text, one_line

HEAD_FORMAT = "tierspec-draft-head"

#: The module's names of the weights a head file names otherwise (the file keeps the names heads
#: were first saved with; the projections are stored as transformers' seven, q/k/v and gate/up
#: fused only in the module: ``DraftHead.to_file_names`` / ``from_file_names``).
FILE_NAMES = {
    "layer.self_attn.o_proj.weight": "o_proj.weight",
    "layer.mlp.down_proj.weight": "down_proj.weight",
    "layer.input_layernorm.weight": "input_norm",
    "layer.post_attention_layernorm.weight": "post_attention_norm",
    "norm.weight": "final_norm",
}


class DraftHeadError(TierspecError):
    """A head file that cannot be used: damaged, another format, or made for another model."""


@dataclass(frozen=True)
class HeadConfig:
    """The shapes of the head (the target's) and its draft vocabulary size."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's vocabulary (draft ids map back into it)
    draft_vocab_size: int  # K
    feature_layers: tuple[int, ...] = ()  # decoder layers whose outputs are fused into f (EAGLE-3)

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))

    @property
    def feature_width(self) -> int:
        """Width of the target features the head reads per position: f and the fused layers."""
        return self.hidden_size * (1 + len(self.feature_layers))
    @classmethod
    def from_target(cls, model: torch.nn.Module, draft_vocab_size: int, feature_layers: tuple[int, ...] = ()) -> "HeadConfig":
        config = model.config
        needed = ("hidden_size", "intermediate_size", "num_attention_heads", "rms_norm_eps")
        missing = [name for name in needed if getattr(config, name, None) is None]
        layer = decoder_layers(model)[-1]
        if missing or not has_projections(layer) or getattr(config, "hidden_act", "silu") != "silu":
            raise DraftHeadError(
                f"{type(model).__name__} is not a Llama-style model (rotary attention with q/k/v/o projections, "
                "SwiGLU MLP, RMSNorm); the draft head supports Llama, Mistral, Qwen2 and SmolLM-like targets"
            )
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
        if rope_type != "default":
            raise DraftHeadError(f"the draft head implements plain rotary positions, not rope type '{rope_type}'")
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        theta = theta or getattr(config, "rope_theta", None) or 10000.0
        if any(not 0 <= i < len(decoder_layers(model)) for i in feature_layers):
            raise DraftHeadError(f"feature layers {feature_layers} are outside the model's {len(decoder_layers(model))} layers")
        return cls(int(config.hidden_size), int(config.intermediate_size), heads, kv_heads, head_dim,
                   float(config.rms_norm_eps), float(theta), output_vocabulary_size(model),
                   int(draft_vocab_size), tuple(feature_layers))


class DraftHead(torch.nn.Module):
    """W_fc, one decoder layer and a final norm; see the module docstring."""

    def __init__(self, config: HeadConfig, draft_ids: torch.Tensor):
        super().__init__()
        H = config.hidden_size
        self.config = config
        # g_t = f_t + W_aux [outputs of feature_layers at t]: the final feature, corrected with
        # what earlier layers knew (zero-initialised, so a new head starts as f_t alone). Self-fed
        # positions use the head's own h in place of g.
        self.aux_proj = FewRowLinear(H * len(config.feature_layers), H, bias=False) if config.feature_layers else None
        self.fc = FewRowLinear(2 * H, H, bias=True)
        self.layer = DecoderLayer(SimpleNamespace(
            hidden_size=H, intermediate_size=config.intermediate_size, num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps))
        for module in self.layer.modules():  # 1..10 rows (a draft step) through the few-row kernel
            if isinstance(module, torch.nn.Linear):
                module.__class__ = FewRowLinear
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.rotary = RotaryTable(config.head_dim, config.rope_theta)
        self.register_buffer("draft_ids", draft_ids.to(torch.long).clone(), persistent=True)
        # Taken from the target by ``attach`` (frozen, never saved): E and W_lm[V_K].
        self.embedding: torch.nn.Module | None = None
        self.lm_rows: torch.Tensor | None = None
        self.engine = None  # an engine_head.EngineHead once attached to a target on the pass engine
        self.target_identity: ModelIdentity | None = None
        self.metadata: dict = {}

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def for_target(cls, target: LoadedModel, draft_ids: torch.Tensor, seed: int = 0,
                   feature_layers: tuple[int, ...] = ()) -> "DraftHead":
        """A new head for ``target``: the layer and norms copied from the target's last layer and
        final norm, W_fc initialised to pass f_t through (plus a small random part)."""
        config = HeadConfig.from_target(target.model, len(draft_ids), feature_layers)
        head = cls(config, draft_ids)
        layer = decoder_layers(target.model)[-1]
        weights = {f"{name}.weight": weight for name, weight in projection_weights(layer).items()}
        weights |= {"input_norm": layer.input_layernorm.weight, "post_attention_norm": layer.post_attention_layernorm.weight}
        final_norm = getattr(getattr(target.model.get_decoder(), "norm", None), "weight", None)
        if final_norm is not None:  # (else the head's final norm stays ones)
            weights["final_norm"] = final_norm
        with torch.no_grad():
            copied = head.load_state_dict(head.from_file_names(weights), strict=False)
            if copied.unexpected_keys:
                raise DraftHeadError(f"the target's last layer has weights the head does not: {copied.unexpected_keys}")
            generator = torch.Generator().manual_seed(seed)
            H = config.hidden_size
            fc = torch.randn(H, 2 * H, generator=generator) * (0.02 / math.sqrt(2))
            fc[:, :H] += torch.eye(H)  # start from "the feature itself": the layer sees f_t
            head.fc.weight.copy_(fc)
            head.fc.bias.zero_()
            if head.aux_proj is not None:
                head.aux_proj.weight.zero_()
        head.attach(target)
        return head

    def attach(self, target: LoadedModel) -> "DraftHead":
        """Take E and W_lm[V_K] from ``target`` (refused when the head was made for another model)."""
        if self.target_identity is not None and not self.target_identity.matches(target.identity):
            raise DraftHeadError(
                f"this draft head was trained for '{self.target_identity.name}' ({self.target_identity.num_layers} "
                f"layers, vocabulary {self.target_identity.vocab_size}), not for '{target.identity.name}' "
                f"({target.identity.num_layers} layers, vocabulary {target.identity.vocab_size}); train one for it "
                "with `tierspec drafter train`"
            )
        if HeadConfig.from_target(target.model, self.config.draft_vocab_size, self.config.feature_layers) != self.config:
            raise DraftHeadError(f"this draft head's shapes do not fit '{target.identity.name}'")
        self.target_identity = target.identity
        lm_head = target.model.get_output_embeddings()
        quantised = getattr(lm_head, "qweight", None)  # a GGUF head: de-quantise only the K rows
        if quantised is not None:
            rows = quantised.rows(self.draft_ids.cpu())
        else:
            weight = lm_head.weight.detach()
            self.to(weight.device)  # the head runs beside the target (its features and embedding live there)
            rows = weight[self.draft_ids.to(weight.device)]
        # [K, H], a copy of K rows, in the head's own dtype (the target may run in bfloat16)
        self.lm_rows = rows.to(self.fc.weight.dtype).contiguous()
        # the target's embedding module, called for the rows a step needs (a GGUF model's table stays
        # quantised: its ``weight`` would be a de-quantised 113 MB copy)
        self.__dict__["embedding"] = target.model.get_input_embeddings()  # not registered: not the head's module
        from .engine_head import engine_head_for

        self.engine = engine_head_for(self, target.model)  # drafting on the pass engine beside an engine target
        return self

    # -- the computation: one pass of the layer, for training (batches [B, T, ·]) and drafting ([1, n, ·]) --
    def target_input(self, features: torch.Tensor) -> torch.Tensor:
        """g [..., H] from the target's features [..., feature_width] (f, then the fused layers)."""
        H = self.config.hidden_size
        if self.aux_proj is None:
            return features[..., :H]
        return features[..., :H] + self.aux_proj(features[..., H:])

    def forward(self, inputs: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor, cache: KVLayer,
                mask: torch.Tensor, keys: int) -> torch.Tensor:
        """h [B, T, H] for inputs g [B, T, H] (target or self-fed) and x_next [B, T] at rotary
        ``positions`` [T]: W_fc [g ; E(x_next)], then the decoder layer (its keys and values
        appended to ``cache``: drafting's ``KVLayer`` or training's ``training.draft_train.StepKeys``;
        attending over the cache's first ``keys`` slots with ``mask`` [T, keys], all queries in one
        call), then the final norm."""
        with torch.no_grad():
            embedded = self.embedding(next_tokens).to(inputs.dtype)  # frozen: the target's table
        # the residual stream in the head's dtype (float32), also under bfloat16 autocast in training
        x = self.fc(torch.cat((inputs, embedded), dim=-1)).to(self.fc.weight.dtype)
        cos, sin = self.rotary.factors(positions, self.fc.weight.dtype)  # attention in the head's dtype
        layout = PassLayout(cos, sin, mask, cache.length, keys, rows_per_call=int(mask.shape[0]))
        return self.norm(self.layer(x, layout, cache))

    # -- files --------------------------------------------------------------------------------
    def to_file_names(self) -> dict[str, torch.Tensor]:
        """The weights under the file's names (``FILE_NAMES``; q/k/v and gate/up split apart)."""
        state = {FILE_NAMES.get(name, name): tensor for name, tensor in self.state_dict().items()}
        del state["layer.self_attn.qkv_proj.weight"], state["layer.mlp.gate_up_proj.weight"]
        return state | {f"{name}.weight": weight for name, weight in projection_weights(self.layer).items()}

    def from_file_names(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A state dict of this module from tensors under the file's names (q/k/v and gate/up
        fused as the layer holds them); other names pass through (``load_state_dict`` judges them)."""
        tensors = dict(tensors)
        parts = {"layer.self_attn.qkv_proj.weight": ("q_proj", "k_proj", "v_proj"),
                 "layer.mlp.gate_up_proj.weight": ("gate_proj", "up_proj")}
        for fused, names in parts.items():
            if all(f"{name}.weight" in tensors for name in names):
                tensors[fused] = torch.cat([tensors.pop(f"{name}.weight") for name in names])
        module_names = {file_name: name for name, file_name in FILE_NAMES.items()}
        return {module_names.get(name, name): tensor for name, tensor in tensors.items()}

    def save(self, path: str | Path, metadata: dict | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
        """Weights (in ``dtype``: bfloat16 halves the file; loading computes in float32) and the
        vocabulary map to ``path`` (.safetensors), metadata beside it (.json)."""
        from safetensors.torch import save_file

        path = Path(path)
        if self.target_identity is None:
            raise DraftHeadError("attach the head to its target before saving it")
        tensors = {k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous()
                   for k, v in self.to_file_names().items()}
        info = {
            "format": HEAD_FORMAT,
            "version": 1,
            "model": self.target_identity.to_dict(),
            "config": asdict(self.config),
            "draft_vocab_sha256": hashlib.sha256(self.draft_ids.numpy().tobytes()).hexdigest(),
            **(metadata or {}),
        }
        atomic_write(path, lambda staging: save_file(tensors, str(staging),
                                                     metadata={"format": HEAD_FORMAT, "info": json.dumps(info)}))
        atomic_write_text(path.with_suffix(".json"), json.dumps(info, indent=2))

    @classmethod
    def load(cls, path: str | Path, target: LoadedModel) -> "DraftHead":
        """Read a head file and attach it to ``target``; refuses damaged files and other models."""
        from safetensors import safe_open

        path = Path(path)
        if not path.exists():
            raise DraftHeadError(f"draft head {path} does not exist (train one with `tierspec drafter train`)")
        try:
            with safe_open(str(path), "pt") as handle:
                header = handle.metadata() or {}
                tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        except Exception as error:  # safetensors raises several types for a damaged file
            raise DraftHeadError(f"draft head {path} is damaged or not a safetensors file: {one_line(error)}") from None
        if header.get("format") != HEAD_FORMAT:
            raise DraftHeadError(f"{path} is not a tierspec draft head (format '{header.get('format')}')")
        try:
            info = json.loads(header["info"])
            config = HeadConfig(**info["config"])
            identity = ModelIdentity(**info["model"])
        except (KeyError, TypeError, ValueError) as error:
            raise DraftHeadError(f"draft head {path} has malformed metadata: {one_line(error)}") from None
        draft_ids = tensors.get("draft_ids")
        if draft_ids is None or hashlib.sha256(draft_ids.numpy().tobytes()).hexdigest() != info.get("draft_vocab_sha256"):
            raise DraftHeadError(f"draft head {path}: the vocabulary map is missing or does not match its checksum")
        # The checksum is the file's own: a map written wrong (ids past the vocabulary) matches it too
        # and was an IndexError from the engine at the first draft.
        if (draft_ids.dim() != 1 or draft_ids.is_floating_point() or draft_ids.numel() != config.draft_vocab_size
                or draft_ids.numel() == 0 or int(draft_ids.min()) < 0 or int(draft_ids.max()) >= config.vocab_size
                or draft_ids.unique().numel() != draft_ids.numel()):
            raise DraftHeadError(f"draft head {path}: its vocabulary map is not {config.draft_vocab_size} distinct token "
                                 f"ids of the target's 0 .. {config.vocab_size - 1}")
        head = cls(config, draft_ids)
        tensors = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
        try:
            head.load_state_dict(head.from_file_names(tensors), strict=True)
        except RuntimeError as error:
            # torch's message lists missing and unexpected keys on lines of their own
            raise DraftHeadError(f"draft head {path} does not hold the expected weights: {one_line(error)}") from None
        if not all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point()):
            raise DraftHeadError(f"draft head {path} holds non-finite weights")
        head.target_identity = identity
        head.metadata = info
        head.eval()
        head.attach(target)
        if not head.drafts_finitely(target):
            raise DraftHeadError(f"draft head {path} gives non-finite outputs on the target's features (its weights "
                                 "overflow the forward pass); it cannot draft: retrain it or use another head")
        return head

    @torch.no_grad()
    def drafts_finitely(self, target: LoadedModel, probe_length: int = 8, draft_steps: int = 3) -> bool:
        """Whether the head's draft logits are finite on a probe: the target's features of a few
        of the head's own draft tokens, then ``draft_steps`` self-fed steps as in drafting.
        Finite weights can still overflow to inf and NaN in the forward pass; such a head
        would hand the loop no distribution to draft from."""
        from ..cached_model import CachedModel

        tokens = self.draft_ids.cpu().repeat(probe_length + 1)[: probe_length + 1]
        features = CachedModel(target.model).forward(tokens, with_hidden=True,
                                                     hidden_layers=self.config.feature_layers).hidden
        runner = HeadRunner(self)
        h = runner.extend(features[:-1], tokens[1:], from_target=True)[-1:]
        for step in range(draft_steps):
            logits = runner.logits(h)
            if not torch.isfinite(logits).all():
                return False
            h = runner.extend(h, tokens[step : step + 1])
        return True


@dataclass(frozen=True)
class HeadStep:
    """One drafting step a drafter asks of its head (``drafters.eagle.EagleDrafter.drafting``):
    append positions to ``runner``'s cache — ``inputs`` [n, ·] (the target's features when
    ``from_target``, else the head's own outputs h) with the next tokens ``next_tokens`` [n] —
    and score the last of them; with no ``inputs`` (None), score the head output ``last`` [1, H]
    as it is. Several sequences' steps run together (``run_head_steps``)."""

    runner: "HeadRunner"
    inputs: torch.Tensor | None
    next_tokens: torch.Tensor | None = None
    from_target: bool = False
    last: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return 0 if self.inputs is None else int(self.inputs.shape[0])


@dataclass(frozen=True)
class HeadOutput:
    """A step's result: the head's output at its last position ``last`` [1, H] and the draft
    vocabulary's logits after it [K] (float32, CPU)."""

    last: torch.Tensor
    logits: torch.Tensor


def run_head_steps(steps: list[HeadStep]) -> list[HeadOutput]:
    """Every step's ``HeadOutput``, in order. The steps of one head on the pass engine run as one
    engine pass (``EngineHead``'s products over all their rows at once, each sequence's attention
    over its own cache, every row's logits in one product: ``_engine_steps``); a lone step, or a
    head off the engine, runs as its runner's own ``step``."""
    if len(steps) > 1 and all(step.runner.head is steps[0].runner.head for step in steps) \
            and steps[0].runner.head.engine is not None:
        return _engine_steps(steps)
    return [step.runner.step(step) for step in steps]


def _engine_steps(steps: list[HeadStep]) -> list[HeadOutput]:
    """``run_head_steps`` for several steps of one engine head: what each ``HeadRunner.step``
    computes, bitwise (the engine's products are row-independent; each sequence attends over its
    own cache), in three calls for them all: W_fc, the layer, the LM-head rows."""
    from ..cached_model import run_stack_rows
    from ..engine import Segment

    head = steps[0].runner.head
    engine, config = head.engine, head.config
    lasts: dict[int, torch.Tensor] = {i: step.last for i, step in enumerate(steps) if step.inputs is None}
    extending = [(i, step) for i, step in enumerate(steps) if step.inputs is not None]
    if extending:
        inputs = torch.cat([engine.target_input(step.inputs) if step.from_target else step.inputs.float()
                            for _, step in extending])
        x = engine.fused_input(inputs, torch.cat([step.next_tokens.cpu() for _, step in extending]))  # [R, H]
        rows, spans, tables, kept = [], [], [], []
        first = 0
        for _, step in extending:
            cache, n = step.runner.cache, step.rows
            start = cache.length
            table = cache.engine_table(start + n, config.num_kv_heads, config.head_dim, engine.layer.kv_dtype)
            tables.append(table)  # [1, 4]: the head's one layer (held until the call returns)
            rows.append(Segment(first, n, start, table))
            spans.append(head.rotary.span(start, n, torch.float32))
            kept.append((first, n))
            first += n
        cos, sin = (torch.cat(parts) for parts in zip(*spans))  # [R, d] each
        out = run_stack_rows(engine.stack, 0, 1, x.contiguous(), rows, ((cos, sin),), bytes([3]))
        h = engine.norm(out)  # [R, H]
        for (i, step), (row, n) in zip(extending, kept):
            step.runner.cache.advance(n)
            lasts[i] = h[row + n - 1 : row + n]
    logits = engine.logits(torch.cat([lasts[i] for i in range(len(steps))]))  # [B, K]
    return [HeadOutput(lasts[i], logits[i]) for i in range(len(steps))]


class HeadRunner:
    """Runs a ``DraftHead`` incrementally at inference: ``extend`` appends positions (real or
    predicted features) to its cache and returns their outputs h; ``rollback`` drops positions.

    The pass is the head's ``forward`` (what training runs) on a batch of one; the cache is the
    target's position-indexed buffer (``llama.KVLayer``), so a rollback only moves its length.
    """

    def __init__(self, head: DraftHead):
        self.head = head
        self.cache = self._new_cache()

    def reset(self) -> None:
        self.cache = self._new_cache()

    def _new_cache(self) -> KVLayer:
        """An empty cache: on the engine one whose key/value views are made when read, not after
        every step's write and every rollback (two slicing operators each, cold after a target pass)."""
        return ViewOnReadKVLayer() if self.head.engine is not None else KVLayer()

    @property
    def length(self) -> int:
        return self.cache.length

    def rollback(self, length: int) -> None:
        if length > self.cache.length:
            raise ValueError(f"cannot roll the head back to {length}: it holds {self.cache.length} positions")
        self.cache.trim(length)

    def extend(self, inputs: torch.Tensor, next_tokens: torch.Tensor, from_target: bool = False,
               positions: torch.Tensor | None = None, attends: torch.Tensor | None = None) -> torch.Tensor:
        """Process positions ``length .. length+n-1`` with inputs [n, ·] and x_next [n]; the
        inputs are the target's features [n, feature_width] (``from_target``) or the head's own
        outputs h [n, H]. Returns h [n, H] (h[i] ≈ the target's feature at the position after i's).

        A token tree's nodes (drafted several per depth): ``positions`` [n] their rotary positions
        and ``attends`` [n, length + n] bool the cache slots each sees (default: a chain)."""
        head = self.head
        if head.engine is not None:
            if from_target:
                inputs = head.engine.target_input(inputs)
            return head.engine.step(inputs, next_tokens.cpu(), None if positions is None else positions.cpu(), self.cache,
                                    attends)
        device = head.fc.weight.device
        inputs, next_tokens = inputs.to(device, head.fc.weight.dtype), next_tokens.to(device)
        n, start = int(inputs.shape[0]), self.cache.length
        if from_target:
            inputs = head.target_input(inputs)
        if positions is None:
            positions = torch.arange(start, start + n, device=device)
        mask, keys = slot_mask(start, n, inputs.dtype, device, attends, row_multiple=1)
        return head(inputs[None], next_tokens[None], positions.to(device), self.cache, mask, keys)[0]

    def step(self, step: HeadStep) -> HeadOutput:
        """``step`` alone: ``extend`` by its inputs (if any), then the logits after the last output."""
        last = step.last if step.inputs is None else \
            self.extend(step.inputs, step.next_tokens, from_target=step.from_target)[-1:]
        return HeadOutput(last, self.logits(last)[0])

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [n, K] (float32, on the CPU where the loop samples) for head
        outputs h [n, H]."""
        if self.head.engine is not None:
            return self.head.engine.logits(h)
        return few_row_linear(h, self.head.lm_rows, None).float().cpu()
