# Stop 65: the current code's numbers on this Xeon in one campaign (the issue's commands and BENCHMARKS.md's
# at-a-glance rows), and the batch's cut skipping proposals with no drafts against the stop's start 2c516f8
# (its tree with this checkout's extensions: the C is the same). Resumable; every step under the exclusive lock.
set -u
cd "$(dirname "$0")/../.."
out=results/xeon_amx
source results/zen3/step.sh
before=$(before_checkout 2c516f8)
for round in 1 2; do
    for side in before after; do
        root=$PWD; [ $side = before ] && root=$before
        step batch_cycle_stop65_${side}_${round} env PYTHONPATH=$root python benchmarks/batch_cycle.py \
            --sizes 1,8 --methods hybrid,ar --temperature 0 --out $out/batch_cycle_stop65_${side}_${round}.json
    done
done
step loop_time_stop65 python benchmarks/loop_time.py --methods ar,hybrid --temperatures 0,1 --prompts 4 --tokens 128 \
    --repeats 3 --out $out/loop_time_stop65.json
step serve_load_stop65 python benchmarks/serve_load.py --concurrency 1,2,4,8,16 --peers --out $out/serve_load_stop65.json
step spec_bench_peers_t0_stop65 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 0 \
    --seed 0 --methods ar,hybrid,llamacpp-greedy,llamacpp-lookup,ov-greedy,ov-lookup --out $out/spec_bench-peers-t0-stop65 --no-progress
step spec_bench_t1_stop65 tierspec bench --dataset spec_bench --per-category 5 --max-new-tokens 128 --temperature 1 \
    --seed 0 --methods ar,hybrid,llamacpp-greedy --out $out/spec_bench-t1-stop65 --no-progress
step pass_cost_stop65 python benchmarks/pass_cost.py --configs auto:auto --llamacpp --rounds 7 --out $out/pass_cost_stop65.md
step prefill_stop65 python benchmarks/prefill.py --configs auto --rounds 3 --openvino --out $out/prefill_stop65.md
step prefill_2048_stop65 python benchmarks/prefill.py --configs auto --rounds 3 --openvino --tokens 2048 \
    --out $out/prefill_2048_stop65.md
step kquant_stop65 python benchmarks/kquant_passes.py gemma3-270m smollm2-135m --dtypes auto --rounds 3
step memory_startup_stop65 python benchmarks/memory_startup.py --repeats 3 --out $out/memory_startup_stop65.md
echo "all done $(date -u +%FT%TZ)"
