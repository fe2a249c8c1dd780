"""The draft head's drafting steps on the pass engine, beside a target that runs there.

A drafting step of the float32 head runs W_fc, one decoder layer (~25 torch operators) and the
8,192 LM-head rows it drafts over (19 MB in float32): about a fifth of what a one-token pass of the
GGUF target costs on the engine, so the head would make drafting dearer than it pays. Here the
same step runs as: W_fc (and the feature fusion) as Q8_0 blocks quantised from the head's weights,
its decoder layer as one engine call on Q8_0 copies of its projections (norms in float32), and the
draft vocabulary's rows taken as they are from the target's own LM head (the file's Q8_0 blocks,
``QuantWeight.select``: the same values ``attach`` copied). Q8_0 rounds each weight to 8 bits per
block of 32 (~0.4% of the block's largest): the drafts may differ a little from the float32 head's,
which only moves acceptance (the verification is the target's); training never sees this copy.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ..engine import rms_norm
from ..llama import KVLayer, PassLayout
from ..quant import Q8_0, QuantLinear, QuantWeight, embedded_rows

BLOCK = 32


def engine_head_for(head, target_model: torch.nn.Module) -> "EngineHead | None":
    """An ``EngineHead`` for ``head`` when the target computes on the engine (its LM head a
    ``QuantLinear``) and the head's widths are whole blocks; None otherwise (the float head drafts)."""
    lm_head = target_model.get_output_embeddings()
    if not isinstance(lm_head, QuantLinear) or getattr(target_model.get_decoder(), "engine_stack", None) is None:
        return None
    config = head.config
    widths = (config.hidden_size, 2 * config.hidden_size, config.intermediate_size,
              config.num_heads * config.head_dim)
    if any(width % BLOCK for width in widths) or config.head_dim not in (32, 64, 128):
        return None
    return EngineHead(head, lm_head.qweight)


class EngineHead:
    """The head's inference step on the engine (see the module doc): ``step`` does what
    ``DraftHead.forward`` does for a batch of one, ``logits`` what ``HeadRunner.logits`` does."""

    def __init__(self, head, target_head: QuantWeight):
        from ..gguf_llama import EngineStack, FusedLayer

        numerics = target_head.numerics
        self.head = head
        config = head.config
        self.hidden = config.hidden_size

        def quantised(linear) -> QuantLinear:
            return QuantLinear(QuantWeight.quantize(linear.weight, numerics, Q8_0))

        self.fc = quantised(head.fc)
        self.fc_bias = None if head.fc.bias is None else head.fc.bias.detach().float().clone()
        self.aux = None if head.aux_proj is None else quantised(head.aux_proj)
        layer = head.layer
        # the layer's parts in the shape FusedLayer reads (its norms are the head's own, float32)
        self._parts = SimpleNamespace(
            self_attn=SimpleNamespace(qkv_proj=quantised(layer.self_attn.qkv_proj), o_proj=quantised(layer.self_attn.o_proj)),
            mlp=SimpleNamespace(gate_up_proj=quantised(layer.mlp.gate_up_proj), down_proj=quantised(layer.mlp.down_proj)),
            input_layernorm=SimpleNamespace(weight=layer.input_layernorm.weight.detach().float().contiguous()),
            post_attention_layernorm=SimpleNamespace(weight=layer.post_attention_layernorm.weight.detach().float().contiguous()))
        self.layer = FusedLayer(self._parts, SimpleNamespace(
            num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
            hidden_size=config.hidden_size, intermediate_size=config.intermediate_size, rms_norm_eps=config.rms_norm_eps))
        # the layer as a stack of one: several sequences' steps in one batched call (heads.draft.run_head_steps)
        self.stack = EngineStack([SimpleNamespace(fused=self.layer)]).capsule
        self.rows = target_head.select(head.draft_ids.cpu())
        # The output norm by the engine's norm kernel (one call where torch's composite rms_norm runs
        # five operators, each cold right after a target pass: benchmarks/torch_calls.py).
        self.norm_weight = head.norm.weight.detach().float().contiguous()
        self.norm_eps = float(head.norm.eps)

    def fused_input(self, inputs: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """The layer's input x = W_fc [g, e] (+ bias) [n, H] for inputs g [n, H] and x_next [n]:
        W_fc's product called directly (no module call)."""
        embedded = embedded_rows(self.head.embedding, next_tokens)
        x = self.fc.qweight.multiply(torch.cat((_float_rows(inputs), embedded), dim=-1))
        return x if self.fc_bias is None else x + self.fc_bias

    def norm(self, out: torch.Tensor) -> torch.Tensor:
        """The head's output norm over rows ``out`` [n, H] (float32 contiguous)."""
        return rms_norm(out, self.norm_weight, self.norm_eps)

    @property
    def weights(self) -> list[QuantWeight]:
        """Every engine weight a step or its logits read."""
        parts = (self.fc, self.aux, self._parts.self_attn.qkv_proj, self._parts.self_attn.o_proj,
                 self._parts.mlp.gate_up_proj, self._parts.mlp.down_proj)
        return [part.qweight for part in parts if part is not None] + [self.rows]

    @property
    def step_bytes(self) -> int:
        """Bytes of weights one self-fed step reads (W_fc, the layer, the draft vocabulary's rows: every
        weight but aux_proj, which reads the target's features once per committed position)."""
        aux = None if self.aux is None else self.aux.qweight
        return sum(weight.nbytes for weight in self.weights if weight is not aux)

    def target_input(self, features: torch.Tensor) -> torch.Tensor:
        """g [n, H] from the target's features [n, feature_width] (``DraftHead.target_input``)."""
        features = features.float().contiguous()
        if self.aux is None:
            return features[:, : self.hidden]
        return features[:, : self.hidden] + self.aux(features[:, self.hidden :])

    def step(self, inputs: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor | None, cache: KVLayer,
             attends: torch.Tensor | None) -> torch.Tensor:
        """h [n, H] for inputs g [n, H] and x_next [n] at rotary ``positions`` [n] (None: the chain
        from ``cache.length``); ``attends`` [n, cache.length + n] (bool): the cache slots each new
        position sees (None: a chain)."""
        x = self.fused_input(inputs, next_tokens)
        rotary, n, start = self.head.rotary, int(x.shape[0]), cache.length
        if positions is None:  # a chain: the table's rows as they are, [n, D] (the engine's layout)
            cos, sin = rotary.span(start, n, torch.float32)
        else:
            cos, sin = (factor.reshape(n, -1) for factor in rotary.factors(positions, torch.float32))
        seen = None if attends is None else attends.to("cpu", torch.uint8).contiguous()
        layout = PassLayout(cos, sin, None, start, fused=True, attends=seen, rotary=((cos, sin),))
        out = self.layer.run(x[None].contiguous(), layout, cache, 3 | (4 if seen is not None else 0))
        return self.norm(out[0])

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [n, K] (float32) for head outputs h [n, H]."""
        return self.rows.multiply(_float_rows(h))


def _float_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as float32 contiguous, converted only where they are not (a step's tensors already
    are: each conversion asked of them anyway was a torch operator run cold after a target pass)."""
    return rows if rows.dtype == torch.float32 and rows.is_contiguous() else rows.float().contiguous()
