#!/usr/bin/env bash
# Thirteenth part of the campaign (same CPU and rules as run.sh), 2026-12-04: the server's events held
# until the next pass (scheduler.Outbox) and a batch's chain walks over Python lists, measured through the
# server against the checkout before them (874bf72), the two servers taking turns round by round, with
# OpenVINO's continuous batching in the same run.
#   nohup bash results/zen3/run13.sh > results/zen3/int8/run13.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
out=results/zen3/int8
source results/zen3/step.sh
before=$(before_checkout 874bf72)  # the C engine is the same in both
step serve_load_outbox python benchmarks/serve_load.py --concurrency 1,2,4,8,16 --requests-per-client 2 --max-tokens 128 --peers --before "$before" --rounds 2 --out $out/serve_load_outbox.json
echo "all done $(date -u +%FT%TZ)"
