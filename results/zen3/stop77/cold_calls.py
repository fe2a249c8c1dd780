"""What an engine call costs when its weights have not been touched for a while: the draft head's qkv product
(576 -> 960 outputs, Q8_0, 0.59 MB) timed right after each of: nothing (a tight loop), filling 64 MB / 1 MB
of other memory, sleeping 9 ms, and 9 ms of Python busy on the calling thread; then products of 32 / 256 / 1,024
random Q8_0 rows (576 inputs) right after a one-token target pass and again at once; then each part of the
head's step right after a target pass (cold) and at once again. Medians of 40-60 (15 after passes).

    python results/zen3/stop77/cold_calls.py [THREADS]
"""
import statistics
import sys
import time

import torch

import tierspec
from tierspec.costs import measuring_runner
from tierspec.engine import engine_threads, threads_for
from tierspec.heads.draft import HeadRunner
from tierspec.methods import MethodOptions, draft_head_for
from tierspec.quant import Q8_0, QuantWeight

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
target = tierspec.load_model("smollm2-135m", dtype="auto")
head = draft_head_for(target, MethodOptions())
engine_head = head.engine
qkv = engine_head._parts.self_attn.qkv_proj.qweight
x576 = torch.randn(1, 576)
big, small = torch.empty(64 << 20, dtype=torch.uint8), torch.empty(1 << 20, dtype=torch.uint8)


def busy(seconds):
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        pass


def after(label, between, call, count=60):
    times = []
    for _ in range(count):
        between()
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    print(f"  {label:34s} median {1e6 * statistics.median(times):7.1f} us, fastest {1e6 * min(times):7.1f}")


with threads_for(target.model), torch.inference_mode():
    print(f"the head's qkv product ({qkv.nbytes / 1e6:.2f} MB), {engine_threads()} engine threads, right after:")
    after("nothing (a tight loop)", lambda: None, lambda: qkv.multiply(x576))
    after("filling 64 MB of other memory", lambda: big.fill_(1), lambda: qkv.multiply(x576))
    after("filling 1 MB", lambda: small.fill_(1), lambda: qkv.multiply(x576))
    after("sleeping 9 ms", lambda: time.sleep(0.009), lambda: qkv.multiply(x576))
    after("9 ms of Python on this thread", lambda: busy(0.009), lambda: qkv.multiply(x576))
    after("nothing (a tight loop) again", lambda: None, lambda: qkv.multiply(x576))

    runner = measuring_runner(target.model)
    runner.forward(torch.arange(256) % runner.vocab_size, logits_for=1)
    token = torch.tensor([11])

    def target_pass():
        runner.forward(token, logits_for=1)
        runner.rollback(256)

    numerics = engine_head.rows.numerics
    products = {f"{n} rows ({n * 576 * 34 // 32 / 1e6:.2f} MB)": QuantWeight.quantize(torch.randn(n, 576), numerics, Q8_0)
                for n in (32, 256, 1024)}
    head_runner = HeadRunner(head)
    generator = torch.Generator().manual_seed(0)
    head_runner.extend(torch.randn(256, head.config.feature_width, generator=generator),
                       torch.arange(256) * 7 % head.config.vocab_size, from_target=True)

    def head_extend():
        head_runner.extend(x576, token)
        head_runner.rollback(256)

    parts = {**{label: (lambda w=w: w.multiply(x576)) for label, w in products.items()},
             "head: W_fc and the embedding": lambda: engine_head.fused_input(x576, token),
             "head: its layer's extend (1 row)": head_extend,
             "head: 8,192 LM-head rows": lambda: engine_head.rows.multiply(x576)}
    samples = {label: ([], []) for label in parts}
    for _ in range(15):
        for label, call in parts.items():
            target_pass()
            started = time.perf_counter()
            call()
            middle = time.perf_counter()
            call()
            samples[label][0].append(middle - started)
            samples[label][1].append(time.perf_counter() - middle)
    print("right after a one-token target pass (256 cached tokens), and at once again:")
    for label, (cold, again) in samples.items():
        print(f"  {label:34s} {1e6 * statistics.median(cold):7.1f} us, again {1e6 * statistics.median(again):7.1f}")
