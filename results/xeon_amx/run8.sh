#!/usr/bin/env bash
# Intel Xeon with AMX (as run1.sh), 2026-12-06, stop 62: top-k and top-p without a sort of the vocabulary
# (sampling.nucleus_ids, keyed_allowed_tokens), the cycle's sampled path leaner, the prefill logging only the
# features a head reads. Before/after in one process against the stop's first commit (16347a9; the C is unchanged
# since, so its copy runs this checkout's build):
#   nohup bash results/xeon_amx/run8.sh > results/xeon_amx/run8.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/xeon_amx
source results/zen3/step.sh
before=$(before_checkout 16347a9)
# Top-p's nucleus changed how its mass is summed (the row's own softmax, not the sorted row's), so filtered
# sampled texts may differ from 16347a9's in a rare last-bit case: sampled texts are not compared here
# (tests/pure/test_sampling.py pins the definitions; the Spec-Bench runs below compare every lossless text).
step loop_time_filters python benchmarks/loop_time.py --methods ar,hybrid --temperatures 0,1,1/p0.95,1/k40,0.7/k40/p0.9 \
    --prompts 4 --tokens 128 --repeats 2 --before $before --sampled-texts-differ \
    --out $out/loop_time_filters.json
step spec_bench_t1_stop62 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 \
    --methods ar,hybrid,eagle,llamacpp-greedy --out $out/spec_bench-t1-stop62 --no-progress
step spec_bench_t1_p095_stop62 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 \
    --top-p 0.95 --seed 0 --methods ar,hybrid,llamacpp-greedy,ov-greedy --out $out/spec_bench-t1-p095-stop62 --no-progress
step spec_bench_peers_t0_stop62 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 \
    --seed 0 --methods ar,hybrid,llamacpp-greedy,llamacpp-lookup,ov-greedy,ov-lookup --out $out/spec_bench-peers-t0-stop62 --no-progress
step batch_cycle_stop62_t1 python benchmarks/batch_cycle.py --sizes 1,8 --methods hybrid,ar --prompts 16 --temperature 1 \
    --out $out/batch_cycle_stop62_t1.json
step serve_load_stop62 python benchmarks/serve_load.py --concurrency 1,8 --requests-per-client 3 --max-tokens 128 \
    --out $out/serve_load_stop62.json
# After the review: the same beside 16347a9 on the second known model (Gemma 3 270M, Q4_K_M: 262,144 tokens a row)
step loop_time_filters_gemma python benchmarks/loop_time.py --model gemma3-270m --methods ar --temperatures 1,1/p0.95,0.7/k40/p0.9 \
    --prompts 2 --tokens 64 --repeats 2 --before $before --sampled-texts-differ --out $out/loop_time_filters_gemma.json
echo "all done $(date -u +%FT%TZ)"
