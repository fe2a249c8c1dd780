import sys  # one batch run: python cycles.py SIZE TEMPERATURE METHOD REPEATS [TOKENS] [gc]
# BatchDecoder.run_all over 16 MT-Bench prompts, TOKENS-token replies (default 128; the server test's: 64), SIZE
# generations at a time, REPEATS times; prints ms a cycle by phase (decode.CycleTimes) each time; with `gc`, also
# every garbage collection during the runs (its generation, count and time: gc.callbacks). Run from the
# repository root under the CPU lock.
import collections
import gc
import time

from tierspec import load_model
from tierspec.batch import BatchDecoder
from tierspec.data import load_prompts
from tierspec.decode import DecodeConfig
from tierspec.methods import MethodOptions, build_method
from tierspec.prompting import encode_prompt, eos_ids
from tierspec.sampling import SamplingConfig
size = int(sys.argv[1]); temp = float(sys.argv[2]); method = sys.argv[3]; reps = int(sys.argv[4])
tokens = int(sys.argv[5]) if len(sys.argv) > 5 else 128; collections_too = sys.argv[6:] == ["gc"]
target = load_model("smollm2-135m", dtype="auto")
texts = [p.text for p in load_prompts("mt_bench")]
prompts = [encode_prompt(target, texts[i % len(texts)]) for i in range(16)]
config = DecodeConfig(max_new_tokens=tokens, sampling=SamplingConfig(temp, 0, 1.0), eos_token_ids=eos_ids(target))
built = build_method(method, target, None, MethodOptions())
BatchDecoder(target, max_batch=1).run_all(prompts[:1], built, DecodeConfig(max_new_tokens=8, eos_token_ids=eos_ids(target)), seed=0)
for r in range(reps):
    stats = collections.defaultdict(lambda: [0, 0.0]); began = [0.0]
    def count(phase, info):
        if phase == "start": began[0] = time.perf_counter()
        else: stats[info["generation"]][0] += 1; stats[info["generation"]][1] += time.perf_counter() - began[0]
    if collections_too:
        gc.callbacks.append(count)
    batch = BatchDecoder(target, max_batch=size)
    batch.run_all(prompts, built, config, seed=0)
    if collections_too:
        gc.callbacks.remove(count)
    c = batch.times.cycles
    d = {k: round(v*1000/c, 3) for k, v in batch.times.to_dict().items()}; d["rows"] = round(batch.times.rows / c, 2); d["cycles"] = c; d["outside"] = round(d["draft"] + d["verify"] + d["commit"], 3)
    print(d, *(f"gen{g}: {n} ({s*1e3:.2f} ms, {s*1e6/c:.1f} us a cycle)" for g, (n, s) in sorted(stats.items())), flush=True)
