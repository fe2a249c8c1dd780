"""The forward-cost table measured three times in one process (costs.measure_forward_costs as a first run measures it: the
fastest of 5 passes of each size), each size's pass over the 1-token pass. python results/zen3/stop75/table_remeasure.py"""
import torch, tierspec
from tierspec import costs
target = tierspec.load_model("smollm2-135m", dtype="auto")
costs.few_row_threads(target)
for i in range(3):
    t = costs.measure_forward_costs(target.model, 11)
    s = t.seconds
    print(" ".join(f"{n}:{s[n]/s[1]:.3f}" for n in range(1, 8)), f"one {1000*s[1]:.2f} ms")
