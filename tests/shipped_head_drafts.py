"""The shipped draft head's drafts on the real default model, recorded and compared.

``record(target)`` runs the shipped head as a chain drafter (fixed 5-token drafts) and as a tree
drafter (a tree policy on the default cost line, so nothing depends on this machine's clock),
greedy and sampled with a seed, on float32 SmolLM2-135M-Instruct, and returns every cycle's
drafted tokens (and the tree's parents). ``tests/data/shipped_head_drafts.json`` holds what it
returns for the head shipped now (the first head continued on new data, issue 20); the first
head's record, made on the code before the head's layer became ``tierspec.llama``'s decoder layer
(commit ad3fa31), was matched exactly by the new layer before the head was replaced. The sampled (T=1) runs were
re-recorded when sampled drafts moved to keyed noise (``Noise.argmax``, commit f262e6f); the
greedy runs were unchanged by it and kept.
``tests/methods/test_real_model.py`` checks the shipped head still drafts exactly the recorded tokens.

Regenerate only on purpose (a new head or a deliberate change of its drafts):
``python tests/shipped_head_drafts.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

REFERENCE = Path(__file__).parent / "data" / "shipped_head_drafts.json"
PROMPTS = ("Explain in two sentences why the sky is blue.",
           "Write a Python function that returns the n-th Fibonacci number.",
           "What is the capital of France, and what is it famous for?")
MAX_NEW_TOKENS = 40


def record(target) -> dict:
    from tierspec.decode import DecodeConfig, decode
    from tierspec.drafters.eagle import EagleDrafter
    from tierspec.drafters.tree import EagleTreeDrafter
    from tierspec.heads.shipped import shipped_head
    from tierspec.methods import Method
    from tierspec.policies import FixedLength, TreePolicy
    from tierspec.prompting import encode_prompt
    from tierspec.rules.exact import ExactRule
    from tierspec.sampling import SamplingConfig

    head = shipped_head(target)
    runs = {}
    for temperature, seed in ((0.0, None), (1.0, 7)):
        config = DecodeConfig(max_new_tokens=MAX_NEW_TOKENS, sampling=SamplingConfig(temperature=temperature))
        for shape in ("chain", "tree"):
            if shape == "chain":
                method = Method.of("eagle", EagleDrafter(head), ExactRule(), FixedLength(5), "reference")
            else:
                policy = TreePolicy(max_nodes=15, forward_costs=None, draft_fractions={"head": 0.02})
                method = Method.of("eagle-tree", EagleTreeDrafter(head), ExactRule(), policy, "reference")
            for index, prompt in enumerate(PROMPTS):
                drafts: list = []
                emitted = []
                for step in decode(target, method, encode_prompt(target, prompt), config, seed):
                    # both policies verify everything drafted: the step's proposal is the drafter's
                    tree = step.proposal.tree
                    drafts.append(tree.tokens.tolist() if shape == "chain" else [tree.tokens.tolist(), tree.parents.tolist()])
                    emitted += step.new_tokens
                runs[f"{shape}/T={temperature:g}/prompt{index}"] = {"drafts": drafts, "emitted": emitted}
    return runs


if __name__ == "__main__":
    import tierspec

    smollm = tierspec.load_model("smollm2-135m", dtype="float32", kernels="packed")
    REFERENCE.write_text(json.dumps(record(smollm)) + "\n")
    print(f"wrote {REFERENCE}")
