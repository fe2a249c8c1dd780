"""A greedy draft step's choice timed inside real cycles: the default method greedy, 4 Spec-Bench prompts to 128 tokens,
every call of drafters.base.greedy_choice wrapped by the clock; `old` the numpy read of stop 74, `new` the noise extension's
top_choice. python results/zen3/stop75/greedy_choice_in_place.py old|new"""
import collections, importlib, time, sys, statistics, torch, numpy as np
import tierspec
from tierspec import sampling, prompting, data, methods
import tierspec.drafters.base as base
decode = importlib.import_module("tierspec.decode")
mode = sys.argv[1]
def old(row):
    array = row.numpy()
    index = int(array.argmax())
    largest = array[index]
    if not (np.isfinite(largest) and np.isfinite(array.min())):
        return None
    return index, float(1.0 / np.exp(array - largest).sum())
impl = old if mode == "old" else sampling.greedy_choice
times = []
def spy(row):
    t = time.perf_counter(); r = impl(row); times.append(time.perf_counter() - t); return r
base.greedy_choice = spy
target = tierspec.load_model("smollm2-135m", dtype="auto")
method = methods.build_method("hybrid", target)
cfg = decode.DecodeConfig(max_new_tokens=128, sampling=sampling.SamplingConfig(0.0, 0, 1.0), eos_token_ids=prompting.eos_ids(target))
for p in data.select(data.load_prompts("spec_bench"), per_category=1, seed=0)[:4]:
    decode.DecodeRun(target, method, prompting.encode_prompt(target, p.text), cfg, seed=0).finish()
print(mode, len(times), "median us", round(1e6 * statistics.median(times), 1), "mean", round(1e6 * statistics.mean(times), 1))
