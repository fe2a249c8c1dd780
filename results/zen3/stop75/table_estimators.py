"""How a forward-cost table's ratios scatter by estimator: 60 rounds of 1-4 token passes after 256 cached tokens (sizes in
turn, as costs._timed_sizes times them), then 400 random subsets of 5 and of 9 rounds read by the fastest of each size
(the table's estimator) and by the median of the rounds' paired ratios. python results/zen3/stop75/table_estimators.py"""
import time, statistics, random, torch
import tierspec
from tierspec import costs
from tierspec.engine import threads_for
target = tierspec.load_model("smollm2-135m", dtype="auto")
costs.few_row_threads(target)
runner = costs.measuring_runner(target.model)
vocab = runner.vocab_size
rounds = []
with threads_for(target.model), torch.inference_mode():
    runner.forward(torch.arange(256) % vocab, logits_for=1)
    for r in range(61):
        row = {}
        for n in (1, 2, 3, 4):
            tokens = (torch.arange(n) * 7 + 11) % vocab
            t = time.perf_counter(); runner.forward(tokens, logits_for=n); row[n] = time.perf_counter() - t
            runner.rollback(256)
        if r: rounds.append(row)
rng = random.Random(0)
for k in (5, 9):
    for name, est in (("min", lambda s, n: min(x[n] for x in s) / min(x[1] for x in s)),
                      ("paired-median", lambda s, n: statistics.median(x[n] / x[1] for x in s))):
        for n in (2, 4):
            vals = [est([rounds[i] for i in sorted(rng.sample(range(len(rounds)), k))], n) for _ in range(400)]
            q = statistics.quantiles(vals, n=20)
            print(f"k={k} {name:14s} size {n}: median {statistics.median(vals):.3f}  5-95% {q[0]:.3f}-{q[-1]:.3f}")
print("all 60 rounds: paired-median", {n: round(statistics.median(x[n]/x[1] for x in rounds), 3) for n in (2,3,4)},
      "min", {n: round(min(x[n] for x in rounds)/min(x[1] for x in rounds), 3) for n in (2,3,4)})
