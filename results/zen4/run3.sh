#!/usr/bin/env bash
# Zen 4 (AMD EPYC family 25 model 17: AVX-512 with VNNI and BF16, no AMX; 2 cores), 2026-12-04, stop 51: products
# over 1-2 rows on the threads measured faster for the model here (costs.few_row_threads): the measurement itself
# (A B B A blocks, three times), then the issue's Spec-Bench measure at temperature 1 and greedy (compare with run2's
# through the peer's ratio: llama.cpp did not change) and the loop's own time.
#   nohup bash results/zen4/run3.sh > results/zen4/run3.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen4/int8
source results/zen3/step.sh
step few_row_threads python -c "
import torch; torch.set_num_threads(2)
import tierspec
from tierspec import costs
target = tierspec.load_model('smollm2-135m', dtype='auto')
for _ in range(3):
    m = costs.few_row_threads(target, refresh=True)
    print({r: 'every thread %.2f ms, one thread %.2f ms' % (e * 1e3, o * 1e3) for r, (e, o) in m.seconds.items()}, 'one_thread_rows', m.one_thread_rows)
"
step spec_bench_few_rows_t1 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-few-rows-t1 --no-progress
step spec_bench_few_rows_t0 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-few-rows-t0 --no-progress
step loop_time_few_rows python benchmarks/loop_time.py --methods ar,hybrid --temperatures 0,1 --prompts 4 --tokens 128 --repeats 3 --out $out/loop_time_few_rows.json
echo "all done $(date -u +%FT%TZ)"
# appended after the steps above ran (at b122646, the same computation): the draft head's methods at t=1 beside the
# default, 3 prompts a category (run by hand into /tmp, then copied here)
step spec_bench_heads_t1 tierspec bench --dataset spec_bench --per-category 3 --max-new-tokens 128 --temperature 1 --seed 0 --methods ar,hybrid,hybrid-tree,eagle-tree,eagle --out $out/spec_bench-heads-t1 --no-progress
echo "all done $(date -u +%FT%TZ)"
step prefill_few_rows python benchmarks/prefill.py --tokens 512 --configs auto --rounds 3 --out $out/prefill_few_rows.md
echo "all done $(date -u +%FT%TZ)"
