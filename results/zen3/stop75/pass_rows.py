"""Each target pass of real generations timed by its rows: 12 Spec-Bench prompts (2 a category) to 128 tokens, the methods
interleaved prompt by prompt; keyed by (method, rows, whether the pass copied features for the head, whether a head step came
before it in the cycle). python results/zen3/stop75/pass_rows.py TEMPERATURE METHODS"""
import collections, importlib, time, sys, statistics, torch
import tierspec
from tierspec import sampling, prompting, data, methods, passes
decode = importlib.import_module("tierspec.decode")
temperature = float(sys.argv[1]); names = sys.argv[2].split(",")
by = collections.defaultdict(list)
orig = passes.EnginePasses.run
def run(self, requests):
    t = time.perf_counter(); r = orig(self, requests); dt = time.perf_counter() - t
    rows = sum(q.rows for q in requests)
    feats = any(q.hidden_layers is not None for q in requests)
    by[(NAME[0], rows, feats, HEAD[0])].append(dt)
    HEAD[0] = False
    return r
passes.EnginePasses.run = run
from tierspec.heads import draft as headmod
HEAD = [False]
ostep = headmod.HeadRunner.step
def hstep(self, step):
    HEAD[0] = True
    return ostep(self, step)
headmod.HeadRunner.step = hstep
NAME = [None]
target = tierspec.load_model("smollm2-135m", dtype="auto")
cfg = decode.DecodeConfig(max_new_tokens=128, sampling=sampling.SamplingConfig(temperature, 0, 1.0), eos_token_ids=prompting.eos_ids(target))
prompts = data.select(data.load_prompts("spec_bench"), per_category=2, seed=0)
built = {n: methods.build_method(n, target) for n in names}
for p in prompts:
    ids = prompting.encode_prompt(target, p.text)
    for n in names:
        NAME[0] = n
        decode.DecodeRun(target, built[n], ids, cfg, seed=0).finish()
for key in sorted(by, key=str):
    v = by[key]
    if len(v) >= 5 and key[1] <= 12:
        print(key, len(v), "median ms", round(1000 * statistics.median(v), 3), "mean", round(1000 * statistics.mean(v), 3))
