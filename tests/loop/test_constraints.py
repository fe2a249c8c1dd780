"""Constrained decoding through the cycle (``tierspec.constraints``): a planted token automaton (a
regular language over token ids, with forced runs and an end) stands in for a grammar. Every
lossless method's constrained tokens equal constrained ``ar``'s, greedy and seeded; every token obeys
the automaton; forbidden drafts are cut before the pass; forced tokens are drafted free and always
kept; the state rolls back with the rejected drafts; a batch's constrained generations keep their
solo text."""

from __future__ import annotations

import pytest
import torch
from conftest import as_method, shared_fixture, tiny_llama

from tierspec.constraints import ConstraintError, MaskBuffer, constrain
from tierspec.decode import DecodeConfig, DecodeRun, decode
from tierspec.drafters import Drafter, NgramDrafter
from tierspec.errors import TierspecError
from tierspec.heads.draft import DraftHead
from tierspec.methods import MethodOptionError, MethodOptions, build_method
from tierspec.proposal import Proposal
from tierspec.sampling import SamplingConfig
from tierspec.tree import TokenTree

pytestmark = pytest.mark.usefixtures("pinned_pass_costs")  # tests/conftest.py

VOCAB = 64
PROMPT = torch.tensor([5, 9, 13, 5, 9, 13, 7, 21, 5, 9, 13, 7, 3, 30, 41])


class TokenAutomaton:
    """A deterministic automaton over token ids: ``edges[state]`` maps each allowed token to the
    next state; a state with no edges is final. The ``Constraint`` of these tests."""

    def __init__(self, edges: dict[int, dict[int, int]], start: int = 0):
        self.edges, self.start_state = edges, start

    def start(self) -> "AutomatonState":
        return AutomatonState(self)

    def accepts(self, tokens: list[int]) -> bool:
        state = self.start_state
        for token in tokens:
            if token not in self.edges[state]:
                return False
            state = self.edges[state][token]
        return True


class AutomatonState:
    """``ConstraintState`` of a ``TokenAutomaton``: the states passed through, for rollback."""

    def __init__(self, automaton: TokenAutomaton):
        self.automaton = automaton
        self.path = [automaton.start_state]
        self.calls = {"allowed": 0, "advance": 0, "rollback": 0}

    def allowed(self, out_mask: torch.Tensor) -> None:
        self.calls["allowed"] += 1
        out_mask.fill_(False)
        out_mask[list(self.automaton.edges[self.path[-1]])] = True

    def advance(self, tokens) -> int:
        self.calls["advance"] += 1
        taken = 0
        for token in tokens:
            following = self.automaton.edges[self.path[-1]].get(int(token))
            if following is None:
                break
            self.path.append(following)
            taken += 1
        return taken

    def rollback(self, count: int) -> None:
        self.calls["rollback"] += 1
        if count:
            del self.path[-count:]

    def forced(self) -> list[int]:
        state, out = self.path[-1], []
        while len(self.automaton.edges[state]) == 1 and len(out) < 8:
            (token, state), = self.automaton.edges[state].items()
            out.append(token)
        return out

    def finished(self) -> bool:
        return not self.automaton.edges[self.path[-1]]

    def accepting(self) -> bool:
        return self.finished()


def planted_automaton(length: int = 36) -> TokenAutomaton:
    """``length`` steps: at step t the allowed tokens are a third of the vocabulary (which third
    turns with t), except after token 40, which forces the run 41 42 43; then the end."""
    edges: dict[int, dict[int, int]] = {}
    for step in range(length):
        allowed = [v for v in range(VOCAB) if v % 3 == step % 3 and v not in (41, 42, 43)]
        edges[step] = {v: step + 1 for v in allowed}
        if 40 in edges[step]:
            edges[step][40] = 1000 + step  # 40 forces 41 42 43, then the next step
            edges[1000 + step] = {41: 2000 + step}
            edges[2000 + step] = {42: 3000 + step}
            edges[3000 + step] = {43: step + 1}
    edges[length] = {}
    return TokenAutomaton(edges)


def run(target, method, sampling, seed, automaton, max_new=40) -> tuple[list[int], list]:
    steps = list(decode(target, method, PROMPT, DecodeConfig(max_new_tokens=max_new, sampling=sampling,
                                                              constraint=automaton), seed))
    return [t for step in steps for t in step.new_tokens], steps


LOSSLESS = ["ar", "forced", "sd", "pld", "adaptive-pld", "eagle", "hybrid", "self", "csd", "eagle-tree", "hybrid-tree"]


target = shared_fixture("target", "sampling_target")
own_target = shared_fixture("own_target", "sampling_own_target")


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)], ids=["greedy", "t=1"])
@pytest.mark.parametrize("name", LOSSLESS)
def test_every_lossless_methods_constrained_tokens_are_constrained_ars(name, sampling, target, own_target):
    from tierspec.layerskip.masks import RoutingMask

    model = own_target if name.endswith("-tree") else target
    options = {"draft_head": DraftHead.for_target(model, torch.arange(0, VOCAB, 2), seed=3).eval()} \
        if name in ("eagle", "hybrid", "eagle-tree", "hybrid-tree") else {}
    if name == "self":
        options["mask"] = RoutingMask.from_units(4, "sublayer", [("mlp", 1), ("attn", 2)])
    drafter = tiny_llama(seed=22, layers=1, sharpness=6.0, dtype=torch.float32) if name in ("sd", "csd") else None
    method = build_method(name, model, drafter, MethodOptions(**options))
    automaton = planted_automaton()
    reference, _ = run(model, build_method("ar", model), sampling, 7, automaton, max_new=80)
    tokens, steps = run(model, method, sampling, 7, automaton, max_new=80)
    assert tokens == reference
    # the automaton's end ended the generation: 36 steps, a forced run of 3 more after each 40
    assert automaton.accepts(tokens) and len(tokens) == 36 + 3 * tokens.count(40) < 80 and steps[-1].finished
    unconstrained, _ = run(model, build_method("ar", model), sampling, 7, None, max_new=80)
    assert unconstrained != tokens  # the constraint changed the text


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)], ids=["greedy", "t=1"])
def test_forced_tokens_are_drafted_free_and_always_kept(target, sampling):
    """``forced`` (plain decoding drafting only the constraint's forced tokens) under the automaton:
    wherever 40 was emitted, 41 42 43 were drafted in the same cycle (``Proposal.forced``) at no
    drafter call, and kept; its tokens are constrained ``ar``'s, which takes one token a pass."""
    automaton = planted_automaton()
    tokens, steps = run(target, build_method("forced", target), sampling, 0, automaton, max_new=80)
    forced_cycles = [s for s in steps if s.proposal.forced]
    assert 40 in tokens and forced_cycles
    for step in forced_cycles:
        assert step.proposal.forced == 3 and step.proposal.tokens.tolist() == [41, 42, 43]
        assert step.verdict.accepted == 3 and step.proposal.drafter_calls == 0
    assert len(steps) == len(tokens) - 3 * len(forced_cycles)  # each forced run came with its pass
    plain, plain_steps = run(target, build_method("ar", target), sampling, 0, automaton, max_new=80)
    assert plain == tokens
    assert len(plain_steps) == len(plain) and not any(len(s.proposal) for s in plain_steps)


def test_forced_takes_no_num_draft(target):
    with pytest.raises(MethodOptionError, match="forced tokens"):
        build_method("forced", target, None, MethodOptions(num_draft=3))


class ForbiddenDrafter(Drafter):
    """Drafts tokens the automaton forbids after its first (the first is allowed at step 0)."""

    def propose(self, context, request):
        return Proposal.chain(torch.tensor([0, 1, 2, 4][: request.budget]))


def test_forbidden_drafts_are_cut_before_the_pass(target):
    automaton = planted_automaton()
    reference, _ = run(target, build_method("ar", target), SamplingConfig(), 0, automaton)
    config = DecodeConfig(max_new_tokens=40, constraint=automaton)
    tokens, cut = [], 0
    for step in decode(target, as_method(ForbiddenDrafter(), num_draft=4), PROMPT, config, 0):
        before = step.committed.generated()[: len(step.committed.generated()) - len(step.new_tokens)]
        assert automaton.accepts(before + step.proposal.tokens.tolist())  # every verified node allowed where it stood
        cut += len(step.proposal) < 4 and not step.proposal.forced
        tokens += step.new_tokens
    assert tokens == reference and cut


def test_the_state_rolls_back_with_rejected_drafts(target):
    """After every cycle the state has taken exactly the committed tokens: n-gram drafts are often
    wrong, and each rejection rolls the state back."""
    automaton = planted_automaton()
    seen = []

    def inspect(verifiers, drafter):
        seen.append(len(verifiers.committed.generated()))

    config = DecodeConfig(max_new_tokens=30, constraint=automaton)
    run_ = DecodeRun(target, as_method(NgramDrafter(1), num_draft=4), PROMPT, config, seed=0, inspect=inspect)
    for step in run_:
        state = run_.sequence.constraint
        assert len(state.path) - 1 == len(step.committed.generated())
    assert run_.sequence.constraint.calls["rollback"] > 0 and seen


def test_constrain_masks_each_row_by_the_state_before_it_and_cuts_a_tree():
    edges = {0: {1: 1, 2: 2}, 1: {3: 3}, 2: {4: 4, 5: 4}, 3: {6: 5}, 4: {}, 5: {}}
    automaton = TokenAutomaton(edges)
    state = automaton.start()
    buffer = MaskBuffer(16, 8)
    chain = constrain(state, Proposal.chain(torch.tensor([1, 3, 7])), room=6, buffer=buffer)
    # 7 is forbidden after 1 3: cut; then 6 is forced and joins free
    assert chain.proposal.tokens.tolist() == [1, 3, 6] and chain.proposal.forced == 1
    assert [row.nonzero().flatten().tolist() for row in chain.masks] == [[1, 2], [3], [6], []]
    assert state.path == [0]  # rolled back to the committed tokens
    # a tree: 0 → {1 → {3, 7}, 2 → {5}}: 7 is forbidden after 1
    tree = Proposal(TokenTree(torch.tensor([1, 2, 3, 7, 5]), torch.tensor([-1, -1, 0, 0, 1])))
    cut = constrain(state, tree, room=5, buffer=buffer)
    assert cut.proposal.tokens.tolist() == [1, 2, 3, 5] and cut.proposal.tree.parents.tolist() == [-1, -1, 0, 1]
    assert [row.nonzero().flatten().tolist() for row in cut.masks] == [[1, 2], [3], [4, 5], [6], []]
    assert state.path == [0]
    with pytest.raises(ValueError, match="mask buffer"):
        constrain(state, Proposal.chain(torch.tensor([1])), room=20, buffer=MaskBuffer(3, 8))  # 1 3 6: 4 rows


class LyingState(AutomatonState):
    def advance(self, tokens) -> int:
        return 0 if len(self.path) > 3 else super().advance(tokens)


def test_a_state_that_refuses_what_its_mask_allowed_is_an_error(target):
    automaton = planted_automaton()
    automaton.start = lambda: LyingState(automaton)
    with pytest.raises(ConstraintError, match="refused"):
        run(target, build_method("ar", target), SamplingConfig(), 0, automaton)


def test_rules_that_could_break_the_constraint_refuse_it(target):
    lossy = build_method("lossy", target, None, MethodOptions(drafter_kind="ngram"))
    with pytest.raises(TierspecError, match="cannot decode under a constraint"):
        run(target, lossy, SamplingConfig(), 0, planted_automaton())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_generations_in_a_batch_keep_their_solo_text(target, temperature):
    """Several constrained generations (and an unconstrained one) in one cycle: their masks are filled
    into one buffer, their chains decided together; each text is its solo text."""
    from tierspec.batch import BatchDecoder

    method = build_method("pld", target, None, MethodOptions(num_draft=4))
    prompts = [PROMPT, PROMPT[3:], PROMPT[:9]]
    configs = [DecodeConfig(max_new_tokens=30, sampling=SamplingConfig(temperature), constraint=automaton)
               for automaton in (planted_automaton(), planted_automaton(20), None)]
    alone = [DecodeRun(target, method, p, c, seed=i).finish().token_ids for i, (p, c) in enumerate(zip(prompts, configs))]
    batch = BatchDecoder(target, max_batch=3)
    runs = [batch.add(i, method, p, c, seed=i) for i, (p, c) in enumerate(zip(prompts, configs))]
    while len(batch):
        batch.step()
    assert [run.token_ids for run in runs] == alone
    assert planted_automaton(20).accepts(runs[1].token_ids) and runs[1].finished
