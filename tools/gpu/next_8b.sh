#!/usr/bin/env bash
# The next GPU session's first call (written 2026-11-27, after a session without a GPU): what
# that session built on the CPU, timed on the 8B shape. One call, timeout_s ~420. Bundle as for
# next.sh (same files), carry .gpu-bundle, run: bash .gpu-bundle/next_8b.sh
#  - decode steps at one and eight rows: each weight shape padded as it needs (one row where a
#    shape keeps its bits there), against the 2x-the-weight-read target (2.42x on 2026-11-27);
#  - the 8B TTFT rows at 8k + 40: host (one lock and one fence a chain), disk and Redis (their
#    bandwidth and the recompute speed measured before serving, so the first hit is judged).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[t+$(( $(date +%s) - t0 ))s] $*"; }
el setup; bash .gpu-bundle/on-gpu.sh setup model 8b 2>&1 | tail -2
el decode  # the padding per shape: the header names the shapes padded further
timeout 150 python3 -m gateway.bench.decode_steps --model /tmp/models/8b --device cuda \
  --dtype bfloat16 --rows 1,8 --context 2048 --repeats 20 2>&1 | tail -12
el ttft-8b  # host, disk and Redis rows, 5 repeats, the targets judged by the bench itself
timeout 170 kvgate bench ttft --spawn --device cuda --model /tmp/models/8b --data-dir /tmp/kv8 \
  --lengths 8192 --suffix-tokens 40 --repeats 5 --no-peers --no-plot --skip-slow-tiers \
  > $OUT/ttft-8b.log 2>&1; grep -E "host|cold|device|suffix|pinned|disk|redis|PASS|MISS" \
  $OUT/ttft-8b.log | tail -24
el done
