import random, time  # python prompt_index.py: NgramDrafter indexing a new generation's prompt (its first lookup), warm
import numpy as np
from tierspec.drafters.ngram import NgramDrafter
rng = random.Random(0)
for length in (100, 500, 2000):
    text = np.array([rng.randrange(49152) for _ in range(length)])
    best = float("inf")
    for _ in range(200):
        drafter = NgramDrafter(3)
        began = time.perf_counter()
        drafter._indexed(text)
        best = min(best, time.perf_counter() - began)
    print(f"{length:5d}-token prompt: {best * 1e6:7.1f} us", flush=True)
