import sys, time, random  # python index_crossover.py: NgramDrafter's per-token loop against its array path, by new positions
# Warm: a drafter holding a 300-token text indexes `count` more positions by each path (forced), the fastest of many runs.
import numpy as np
from tierspec.drafters import ngram
from tierspec.drafters.ngram import NgramDrafter
rng = random.Random(0)
text = [rng.randrange(49152) for _ in range(300 + 64)]
for count in (1, 2, 4, 6, 8, 10, 11, 12, 14, 16, 20, 24, 32, 64):
    row = []
    for bulk in (10**9, 0):  # the loop, then the arrays
        ngram.BULK_INDEX = bulk
        best = float("inf")
        for _ in range(300):
            drafter = NgramDrafter(3)
            drafter._indexed(np.array(text[:300]))
            context = np.array(text[: 300 + count])
            began = time.perf_counter()
            drafter._indexed(context)
            best = min(best, time.perf_counter() - began)
        row.append(best * 1e6)
    print(f"{count:3d} new positions: loop {row[0]:6.2f} us, arrays {row[1]:6.2f} us", flush=True)
