"""The default method's cycles in process, alone and in a batch of 8, under cProfile: 16 MT-Bench first turns,
64 tokens greedy, seed 0, at most B at a time (``BatchDecoder.run_all``, after a warm batch). Per cycle: the Python
calls made, the cycle's phases (``decode.CycleTimes``, inflated by the profiler), and the 15 functions of the
largest own time (the pass's own Python among them; the engine's C calls left out). cProfile charges each call a
fixed cost, so read the call counts, not the times, as what a sequence adds.

    python results/zen3/stop77/batch_profile.py
"""
import cProfile
import pstats

import torch

import tierspec
from tierspec.batch import BatchDecoder
from tierspec.data import load_prompts
from tierspec.decode import DecodeConfig
from tierspec.methods import MethodOptions, build_method
from tierspec.prompting import encode_prompt, eos_ids
from tierspec.sampling import SamplingConfig

torch.set_num_threads(2)
target = tierspec.load_model("smollm2-135m", dtype="auto")
prompts = [encode_prompt(target, p.text) for p in load_prompts("mt_bench")[:16]]
method = build_method("hybrid", target, None, MethodOptions())
config = DecodeConfig(max_new_tokens=64, sampling=SamplingConfig(0.0), eos_token_ids=eos_ids(target))
for size in (1, 8):
    BatchDecoder(target, max_batch=size).run_all(prompts[:size], method, config, seed=0)
    batch = BatchDecoder(target, max_batch=size)
    profile = cProfile.Profile()
    profile.enable()
    batch.run_all(prompts, method, config, seed=0)
    profile.disable()
    cycles = batch.times.cycles
    stats = pstats.Stats(profile).stats
    calls = sum(entry[1] for entry in stats.values())
    print(f"B={size}: {cycles} cycles, mean batch {batch.times.sequences / cycles:.2f}, {calls / cycles:.0f} Python "
          f"calls a cycle; ms a cycle (profiled) " + ", ".join(f"{k} {1e3 * v / cycles:.3f}"
                                                            for k, v in batch.times.to_dict().items()))
    own = sorted(((entry[2], entry[1], key) for key, entry in stats.items() if "_qengine" not in key[2]), reverse=True)
    for seconds, count, (path, line, name) in own[:15]:
        print(f"    {1e6 * seconds / cycles:7.1f} us {count / cycles:6.2f} calls a cycle  {path.split('tierspec/')[-1]}:{line} {name}")
