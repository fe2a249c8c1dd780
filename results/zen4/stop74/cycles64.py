import sys  # one in-process batch run: python cycles64.py SIZE TEMPERATURE METHOD
# BatchDecoder.run_all over 16 MT-Bench prompts, 64-token replies (the server test's), SIZE generations at a time;
# prints ms a cycle by phase (decode.CycleTimes). Run from the repository root under the CPU lock.
from tierspec import load_model
from tierspec.batch import BatchDecoder
from tierspec.data import load_prompts
from tierspec.decode import DecodeConfig
from tierspec.methods import MethodOptions, build_method
from tierspec.prompting import encode_prompt, eos_ids
from tierspec.sampling import SamplingConfig
size = int(sys.argv[1]); temp = float(sys.argv[2]); method = sys.argv[3]
target = load_model("smollm2-135m", dtype="auto")
texts = [p.text for p in load_prompts("mt_bench")]
prompts = [encode_prompt(target, texts[i % len(texts)]) for i in range(16)]
config = DecodeConfig(max_new_tokens=64, sampling=SamplingConfig(temp, 0, 1.0), eos_token_ids=eos_ids(target))
built = build_method(method, target, None, MethodOptions())
BatchDecoder(target, max_batch=1).run_all(prompts[:1], built, DecodeConfig(max_new_tokens=8, eos_token_ids=eos_ids(target)), seed=0)
batch = BatchDecoder(target, max_batch=size)
batch.run_all(prompts, built, config, seed=0)
c = batch.times.cycles
d = {k: round(v*1000/c, 3) for k, v in batch.times.to_dict().items()}; d["rows"] = round(batch.times.rows / c, 2); d["cycles"] = c; d["outside"] = round(d["draft"] + d["verify"] + d["commit"], 3); print(d, flush=True)
