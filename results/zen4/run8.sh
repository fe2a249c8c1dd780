#!/usr/bin/env bash
# Zen 4 (AMD EPYC family 25 model 17: AVX-512 with VNNI and BF16, no AMX; 2 cores), 2026-12-05, stop 53: the keyed
# draws on AVX-512 (f363480) against ff2f78b, whose noise kernel is its own (built in its folder: the extension's
# interface changed), and the issue's measures at temperature 1.
#   nohup bash results/zen4/run8.sh > results/zen4/run8.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen4/int8
source results/zen3/step.sh
before=$(before_own_build ff2f78b)
step noise_rows python benchmarks/noise_rows.py --rows 1,4,12 --repeats 20 --out $out/noise_rows.json
step loop_time_noise_avx512 python benchmarks/loop_time.py --methods ar,hybrid --temperatures 0,1 --prompts 4 --tokens 128 --repeats 3 --before "$before" --out $out/loop_time_noise_avx512.json
step spec_bench_noise_avx512_t1 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-noise-avx512-t1 --no-progress
step serve_load_noise_avx512 python benchmarks/serve_load.py --concurrency 1,8 --requests-per-client 2 --max-tokens 128 --peers --out $out/serve_load_noise_avx512.json
step batch_cycle_noise_shared python benchmarks/batch_cycle.py --sizes 8 --methods hybrid --prompts 32 --temperature 1 --noise-rows-shared-from 8,24,8 --out $out/batch_cycle_noise_shared.json
echo "all done $(date -u +%FT%TZ)"
