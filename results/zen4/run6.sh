#!/usr/bin/env bash
# Zen 4 (AMD EPYC family 25 model 17: AVX-512 with VNNI and BF16, no AMX; 2 cores), 2026-12-05, stop 52: the hybrid
# drafts nothing where nothing pays (its dormancy, measured by what the verdicts say its drafts saved), with the loop's
# and the pass's Python after a pass trimmed (run5): the issue's Spec-Bench measures, the loop beside the session's
# first commit (484cad1), what the noise of a sampled n-gram draft says of its fate, and the server at 1 and 8 clients.
#   nohup bash results/zen4/run6.sh > results/zen4/run6.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen4/int8
source results/zen3/step.sh
before=$(before_checkout 484cad1)
step spec_bench_dormant_t1 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-dormant-t1 --no-progress
step spec_bench_dormant_t0 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-dormant-t0 --no-progress
step loop_time_dormant python benchmarks/loop_time.py --methods ar,hybrid --temperatures 0,1 --prompts 4 --tokens 128 --repeats 3 --before "$before" --out $out/loop_time_dormant.json
step ngram_noise python benchmarks/ngram_noise.py --method hybrid --per-category 4 --tokens 128 --temperature 1
step serve_load_dormant python benchmarks/serve_load.py --concurrency 1,8 --requests-per-client 2 --max-tokens 128 --peers --out $out/serve_load_dormant.json --report $out/serve_load_dormant.md
echo "all done $(date -u +%FT%TZ)"
