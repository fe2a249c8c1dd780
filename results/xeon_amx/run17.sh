# Stop 65: a product's rows prepared (rounded to 8 bits) by every thread from 64 rows, against 67c4351 (the 256-row
# chunks, its extensions built from its own sources): prefills of 1,024 and 2,048 tokens, whole runs alternated
# twice. Resumable; every step under the exclusive lock.
set -u
cd "$(dirname "$0")/../.."
out=results/xeon_amx
source results/zen3/step.sh
before=$(before_own_build 67c4351)
for round in 1 2; do
    for side in before after; do
        root=$PWD; [ $side = before ] && root=$before
        for tokens in 1024 2048; do
            step prefill_prepare_${tokens}_${side}_${round} env PYTHONPATH=$root python benchmarks/prefill.py --configs auto \
                --rounds 3 --no-llamacpp --tokens $tokens --out $out/prefill_prepare_${tokens}_${side}_${round}.md
        done
    done
done
step prefill_final_stop65 python benchmarks/prefill.py --configs auto --rounds 3 --openvino --out $out/prefill_final_stop65.md
step prefill_final_2048_stop65 python benchmarks/prefill.py --configs auto --rounds 3 --openvino --tokens 2048 \
    --out $out/prefill_final_2048_stop65.md
echo "all done $(date -u +%FT%TZ)"
