"""Greedy: the draft head's confidence (the policy's prior for its key: the bin's middle) against how often its drafts were
accepted, by block position (first or later) and confidence bin (policies.CONFIDENCE_BINS); 4 prompts each of six
evaluation sets other than Spec-Bench, 128 tokens. python results/zen3/stop76/head_confidence.py eagle mt_bench,gsm8k,cnn_dailymail,humaneval,xsum,wmt14 4"""
import sys, importlib, collections, torch
import tierspec
from tierspec import data, prompting, methods, sampling as S, policies as P
decode = importlib.import_module("tierspec.decode")
name = sys.argv[1]; datasets = sys.argv[2].split(","); per = int(sys.argv[3])
target = tierspec.load_model("smollm2-135m", dtype="auto")
method = methods.build_method(name, target)
log = []
orig = P.CostAware.observe
def observe(self, outcome):
    d, verdict = outcome.drafted, outcome.verdict
    k = len(outcome.verified)
    if d.confidence is not None and k:
        log.append((list(d.confidence[:k]), verdict.accepted, k, d.source))
    return orig(self, outcome)
P.CostAware.observe = observe
prompts = []
for ds in datasets: prompts += data.select(data.load_prompts(ds), limit=per, seed=1)
for p in prompts:
    ids = prompting.encode_prompt(target, p.text)
    config = decode.DecodeConfig(max_new_tokens=128, sampling=S.SamplingConfig(0.0, 0, 1.0), eos_token_ids=prompting.eos_ids(target))
    decode.DecodeRun(target, method, ids, config, seed=0).finish()
bins = collections.defaultdict(lambda: [0, 0, 0.0])
for conf, accepted, k, src in log:
    for i, c in enumerate(conf[: accepted + 1]):
        b = bins[(src, i == 0, P.confidence_bin(c))]
        b[0] += 1; b[1] += i < accepted; b[2] += c
print("blocks", len(log), "sources", collections.Counter(s for *_, s in log))
print("source first bin: n, mean confidence, acceptance")
for key in sorted(bins):
    n, a, c = bins[key]
    if n >= 10: print(key, n, f"{c/n:.3f}", f"{a/n:.3f}")
