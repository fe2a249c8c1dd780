"""CLaSP's layer selection (Chen et al. 2025, "CLaSp: In-Context Layer Skip for Self-Speculative
Decoding"; docs/algorithms.md §CLaSP): which residual units a self-drafter bypasses, chosen from
the context itself, with no offline search.

The target is a chain of residual units u = 1..U (whole decoder layers, or each layer's attention
and MLP blocks separately: ``RoutingMask`` units), each h ← h + f_u(h). For one token whose full
model states h_u (after unit u) are known, a dynamic programme keeps, for every skip count j, one
candidate state g[u][j] reachable with exactly j of the first u units bypassed:

    g[u][j] = the one of { f_u(g[u−1][j]) (unit kept),  g[u−1][j−1] (unit bypassed) }
              closer in cosine to h_u

and returns the skip set behind g[U][M] for the skip budget M. Row j = 0 never skips, so it *is*
the full model's state h_u: the reference costs no extra pass. The programme is approximate (a
greedy choice per cell, as in the paper): the best state at u need not lead to the best at U.

On the model (``select_in_context``) the token is the last one the full target verified: every
candidate row of a unit runs at that token's position, attending to the full model's cached keys
and values of the positions before it and to its own (the paper's approximation: the prefix's KV
is the full model's, not the skipped model's): one cached pass of the candidate rows whose mask
lets row i see the prefix and its own key only. The cache is set aside and restored around it
(``CachedModel.set_aside``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import TierspecError
from ..llama import slot_mask
from .masks import RoutingMask, decoder_layers, model_lock

#: apply(u, states [R, H]) → states [R, H] after unit u (every row on its own).
ApplyUnit = Callable[[int, torch.Tensor], torch.Tensor]


def select_skips(apply: ApplyUnit, first_input: torch.Tensor, num_units: int, skippable: set[int],
                 budget: int) -> tuple[list[int], float]:
    """CLaSP's dynamic programme over ``num_units`` units in forward order (module docstring).

    ``first_input`` [H]: the state entering unit 0. ``skippable``: the units that may be bypassed.
    Returns (the ``budget`` bypassed units, ascending; the cosine of the selected path's final
    state with the full model's). Ties go to bypassing (an exact identity unit is skipped)."""
    if not 0 <= budget <= len(skippable):
        raise TierspecError(f"cannot bypass {budget} units: {len(skippable)} may be bypassed")
    rows = first_input.unsqueeze(0)  # [R, H]: row r holds a state with counts[r] units bypassed
    counts = [0]
    paths: list[tuple[int, ...]] = [()]
    left = len(skippable)  # skippable units from u on
    for u in range(num_units):
        kept = apply(u, rows)  # [R, H]; row 0 (no skips) is the full model's state after u
        if u not in skippable:
            rows = kept
            continue
        left -= 1
        reference = kept[0]
        keep_score = F.cosine_similarity(kept, reference.unsqueeze(0), dim=-1)  # [R]
        skip_score = F.cosine_similarity(rows, reference.unsqueeze(0), dim=-1)
        by_count = {count: r for r, count in enumerate(counts)}
        new_rows, new_counts, new_paths = [], [], []
        for j in range(0, min(counts[-1] + 1, budget) + 1):
            # a state with j skips that can still reach the budget (row 0 is kept as the reference)
            if j and j + left < budget:
                continue
            keep, skip = by_count.get(j), by_count.get(j - 1)
            if skip is not None and (keep is None or skip_score[skip] >= keep_score[keep]):
                new_rows.append(rows[skip])
                new_paths.append(paths[skip] + (u,))
            elif keep is not None:
                new_rows.append(kept[keep])
                new_paths.append(paths[keep])
            else:
                continue
            new_counts.append(j)
        rows, counts, paths = torch.stack(new_rows), new_counts, new_paths
    final = counts.index(budget)
    reference = rows[0] if counts[0] == 0 else None
    score = float(F.cosine_similarity(rows[final], reference, dim=0)) if reference is not None else float("nan")
    return sorted(paths[final]), score


def unit_order(num_layers: int, unit: str) -> list[tuple[str, int]]:
    """Every residual unit of the model in forward order: ('layer', i), or ('attn', i), ('mlp', i)."""
    if unit == "layer":
        return [("layer", i) for i in range(num_layers)]
    return [(kind, i) for i in range(num_layers) for kind in ("attn", "mlp")]


def select_in_context(runner, position: int, token: int, unit: str, budget: int) -> tuple[RoutingMask, float]:
    """The mask CLaSP picks at ``position`` (< ``runner.length``, a token the full model has
    processed: ``token``), bypassing ``budget`` units of kind ``unit``; and the selected path's
    cosine with the full model's final state. ``runner`` is the target's ``CachedModel``, whose
    cache is exactly as before afterwards. tierspec's own Llama forward only."""
    model = runner.model
    if not hasattr(model, "new_kv_cache"):
        raise TierspecError(f"CLaSP runs the target one unit at a time on tierspec's own Llama forward, not on "
                            f"{type(model).__name__} (load the model with implementation='tierspec')")
    layers = decoder_layers(model)
    units = unit_order(len(layers), unit)
    eligible = set(RoutingMask.eligible_units(len(layers), unit))
    skippable = {u for u, name in enumerate(units) if name in eligible}
    decoder = model.get_decoder()
    layouts: dict[int, object] = {}

    def layout(rows: int):
        # ``rows`` siblings at one position, each seeing the cached prefix and its own key (slot
        # position + i): a cached pass's layout with the causal mask swapped for that one
        if rows not in layouts:
            device = decoder.rotary.inv_freq.device
            causal = decoder.layout(torch.full((rows,), position, device=device), position, cached=True)
            keys = getattr(decoder, "layout_keys", [(None, None)])  # an ArchDecoder's (rotary kind, window) pairs
            if len(keys) > 1 or keys[0][1] is not None:  # the siblings' mask below has no window and one table
                raise TierspecError(f"CLaSP's selection runs on models whose layers share one attention layout; "
                                    f"this {model.config.model_type} model's layers have sliding windows or rotary "
                                    "tables of their own")
            if causal.fused:  # the engine takes who-sees-whom among the new rows directly
                layouts[rows] = dataclasses.replace(causal, attends=torch.eye(rows, dtype=torch.uint8))
                return layouts[rows]
            sees = torch.zeros(rows, position + rows, dtype=torch.bool)
            sees[:, :position] = True
            sees[:, position:] = torch.eye(rows, dtype=torch.bool)
            mask, _ = slot_mask(position, rows, causal.mask.dtype, device, sees)  # [rows rounded up to ATTENTION_ROWS, keys]
            layouts[rows] = dataclasses.replace(causal, mask=mask)
        return layouts[rows]

    def apply(u: int, states: torch.Tensor) -> torch.Tensor:
        kind, index = units[u]
        layer, hidden = layers[index], states.unsqueeze(0)  # [1, R, H]
        if kind in ("layer", "attn"):
            cache = runner.cache.layers[index]
            hidden = layer.attention_block(hidden, layout(states.shape[0]), cache)
            cache.trim(position)  # the candidates' keys are scratch: the next call starts at `position` again
        if kind in ("layer", "mlp"):
            hidden = layer.mlp_block(hidden, layout(states.shape[0]))
        return hidden[0]

    with model_lock(model), runner.set_aside(position):
        embedded = decoder.embed_tokens(torch.tensor([token], device=decoder.rotary.inv_freq.device))[0].to(decoder.residual_dtype)
        skipped, score = select_skips(apply, embedded, len(units), skippable, budget)
    mask = RoutingMask.from_units(len(layers), unit, [units[u] for u in skipped], info={"cosine": round(score, 6)})
    return mask, score
