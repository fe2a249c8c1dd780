# Stop 65: the server at 1 and 8 clients with the AMX path's 256-row chunks against the stop's start 2c516f8 built
# from its own sources (whole runs alternated twice; passes at 8 clients carry ~17 rows, a joining prompt's
# chunk 64 more). Resumable; every step under the exclusive lock.
set -u
cd "$(dirname "$0")/../.."
out=results/xeon_amx
source results/zen3/step.sh
before=$(before_own_build 2c516f8)
for round in 1 2; do
    for side in before after; do
        root=$PWD; [ $side = before ] && root=$before
        step serve_load_stop65_${side}_${round} env PYTHONPATH=$root python benchmarks/serve_load.py --concurrency 1,8 \
            --out $out/serve_load_stop65_${side}_${round}.json
    done
done
echo "all done $(date -u +%FT%TZ)"
