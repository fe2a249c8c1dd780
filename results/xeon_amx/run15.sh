# Stop 65: a long pass in chunks of 256 rows on the AMX path (kernels.pass_rows), against the stop's start
# 2c516f8 built from its own sources: prefills of 1,024 and 2,048 tokens, whole runs alternated twice, then the
# current code beside the peers. Resumable; every step under the exclusive lock.
set -u
cd "$(dirname "$0")/../.."
out=results/xeon_amx
source results/zen3/step.sh
before=$(before_own_build 2c516f8)
for round in 1 2; do
    for side in before after; do
        root=$PWD; [ $side = before ] && root=$before
        for tokens in 1024 2048; do
            step prefill_stop65_${tokens}_${side}_${round} env PYTHONPATH=$root python benchmarks/prefill.py --configs auto \
                --rounds 3 --no-llamacpp --tokens $tokens --out $out/prefill_stop65_${tokens}_${side}_${round}.md
        done
    done
done
step prefill_chunks_stop65 python benchmarks/prefill.py --configs auto --rounds 3 --openvino --out $out/prefill_chunks_stop65.md
step serve_load_chunks_stop65 python benchmarks/serve_load.py --concurrency 1,8,16 --peers --out $out/serve_load_chunks_stop65.json
echo "all done $(date -u +%FT%TZ)"
