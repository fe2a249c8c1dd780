"""At temperature 1: would the draft head's drafts be kept more often were its logits scaled by alpha before the keyed
draw (draft = argmax(alpha * z + g) over its 8,192 tokens, g the position's Gumbel noise, the target keeping it when
its own keyed draw is the same token)? Records every sampled head step of `eagle` (its logits, its tokens' noise, the
token the target emitted there) on 4 prompts each of six evaluation sets other than Spec-Bench, 128 tokens, seed 0;
then counts, over the steps whose block's earlier drafts were all the target's tokens (the head read the true
prefix), how often the scaled draw is the target's token. Drafts never change a lossless method's text: only
acceptance moves.  python results/zen3/stop76/head_scale_t1.py"""
import importlib, sys
import numpy as np
import torch
import tierspec
from tierspec import data, prompting, methods, sampling as S
decode = importlib.import_module("tierspec.decode"); base = importlib.import_module("tierspec.drafters.base")
target = tierspec.load_model("smollm2-135m", dtype="auto")
method = methods.build_method("eagle", target)
records, pending = [], {}
orig_argmax, orig_ltp = S.Noise.argmax, base.logits_to_probs
def ltp(logits, config):
    pending["logits"] = logits.detach().clone()
    return orig_ltp(logits, config)
def argmax(self, scores, position, purpose=S.TOKEN):
    token = orig_argmax(self, scores, position, purpose)
    if purpose == S.TOKEN and "logits" in pending and int(torch.isfinite(scores).sum()) == pending["logits"].numel():
        ids = torch.nonzero(torch.isfinite(scores)).flatten()
        records.append((position, pending.pop("logits"), ids, token, self))
    return token
base.logits_to_probs, S.Noise.argmax = ltp, argmax
prompts = []
for name in "mt_bench,gsm8k,cnn_dailymail,humaneval,xsum,wmt14".split(","):
    prompts += data.select(data.load_prompts(name), limit=4, seed=1)
rows = []
for p in prompts:
    ids = prompting.encode_prompt(target, p.text)
    config = decode.DecodeConfig(max_new_tokens=128, sampling=S.SamplingConfig(1.0, 0, 1.0), eos_token_ids=prompting.eos_ids(target))
    records.clear()
    run = decode.DecodeRun(target, method, ids, config, seed=0)
    run.finish()
    text = ids.tolist() + list(run.token_ids)
    for position, logits, vocab, token, noise in records:
        if position < len(text):
            rows.append((text[position], vocab.numpy(), logits.float().numpy(), noise.gumbel_at(position, vocab).numpy(), position, token))
valid, previous, previous_ok = [], None, True  # a step right after its block's previous one reads that draft
for y, vocab, z, g, position, token in rows:
    ok = previous is None or position != previous + 1 or previous_ok
    valid.append(ok)
    previous, previous_ok = position, ok and token == y
kept = [r for r, ok in zip(rows, valid) if ok]
print(f"{len(rows)} sampled head steps, {len(kept)} with the true prefix; alpha = 1 reproduces every recorded draft:",
      all(vocab[np.argmax(z + g)] == token for _, vocab, z, g, _, token in rows))
for alpha in (0.5, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 100.0):
    print(f"alpha {alpha:6.2f}: kept {np.mean([vocab[np.argmax(alpha * z + g)] == y for y, vocab, z, g, _, _ in kept]):.3f}")
print("the target's token among the head's 8,192:", round(float(np.mean([y in set(v.tolist()) for y, v, *_ in kept])), 3),
      "; the head's argmax the target's token:", round(float(np.mean([v[np.argmax(z)] == y for y, v, z, *_ in kept])), 3))
