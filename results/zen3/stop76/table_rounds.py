"""How a forward-cost table's ratios scatter by estimator and by rounds: ROUNDS rounds of 1-11 token passes of the
default model (int8 rows) after 256 cached tokens, the sizes in turn as costs._timed_sizes takes them; then 1,500
random subsets of 5, 10 and 20 rounds read by each size's fastest pass (the table's estimator before stop 76), its
median, the mean of its fastest half, and the median of the rounds' paired ratios (costs.paired_costs).

    python results/zen3/stop76/table_rounds.py [ROUNDS=40]"""
import random, statistics, sys, time
import torch
import tierspec
from tierspec import costs
from tierspec.engine import threads_for

rounds_wanted = int(sys.argv[1]) if len(sys.argv) > 1 else 40
target = tierspec.load_model("smollm2-135m", dtype="auto")
costs.few_row_threads(target)
runner = costs.measuring_runner(target.model)
vocab, sizes = runner.vocab_size, list(range(1, 12))
samples = {n: [] for n in sizes}
with threads_for(target.model), torch.inference_mode():
    runner.forward(torch.arange(costs.TABLE_CONTEXT) % vocab, logits_for=1)
    for r in range(rounds_wanted + 1):
        for n in sizes:
            tokens = (torch.arange(n) * 7 + 11) % vocab
            started = time.perf_counter(); runner.forward(tokens, logits_for=n); elapsed = time.perf_counter() - started
            runner.rollback(costs.TABLE_CONTEXT)
            if r:
                samples[n].append(elapsed)
print(f"{rounds_wanted} rounds, ms: size: fastest / median / fastest ratio / paired-median ratio")
paired = costs.paired_costs(samples)
for n in sizes:
    print(f"  {n:2d}: {1e3 * min(samples[n]):6.2f} / {1e3 * statistics.median(samples[n]):6.2f} / "
          f"{min(samples[n]) / min(samples[1]):.3f} / {paired[n] / paired[1]:.3f}")
def low_half(v):
    v = sorted(v); return sum(v[: max(1, len(v) // 2)]) / max(1, len(v) // 2)
estimators = {"fastest": min, "median": statistics.median, "fastest half": low_half}
rng = random.Random(0)
for k in (5, 10, 20):
    for name in list(estimators) + ["paired median"]:
        ratios = {2: [], 3: [], 4: [], 8: []}
        for _ in range(1500):
            chosen = rng.sample(range(rounds_wanted), k)
            sub = {n: [samples[n][r] for r in chosen] for n in sizes}
            if name == "paired median":
                table = costs.paired_costs(sub)
            else:
                table = {n: estimators[name](v) for n, v in sub.items()}
            for n in ratios:
                ratios[n].append(table[n] / table[1])
        cells = []
        for n, v in ratios.items():
            q = statistics.quantiles(v, n=20)
            cells.append(f"{n}: {statistics.median(v):.3f} [{q[0]:.3f}-{q[-1]:.3f}]")
        print(f"{k:2d} rounds, {name:13s} " + "  ".join(cells))
# What measuring a table takes (the default model, both contexts, as many rounds at each, after a warm-up round): the
# estimator before stop 76 took 5 rounds. The log was made at b3d7996, whose measure_forward_costs also took a
# separate count of rounds at the long context (its third line, 20 / 10; `git show b3d7996:tierspec/costs.py`).
for rounds in (5, costs.TABLE_ROUNDS):
    started = time.perf_counter()
    table = costs.measure_forward_costs(target.model, 11, repeats=rounds)
    print(f"measure_forward_costs, {rounds} / {rounds} rounds: {time.perf_counter() - started:.2f} s; ratios "
          + " ".join(f"{n}: {v / table.seconds[1]:.3f}" for n, v in table.seconds.items()))
