#!/usr/bin/env bash
# GPU call 1 (2026-11-28, H200): the 8B TTFT rows (host, disk, Redis, cold) first, then decode
# steps. Bundle as next_8b.sh; carry .gpu-bundle; copy this file there; bash .gpu-bundle/call1.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[t+$(( $(date +%s) - t0 ))s] $*"; }
el setup; bash .gpu-bundle/on-gpu.sh setup model 8b 2>&1 | tail -4
git log -1 --format='%h %s' 2>/dev/null | cut -c1-80; nproc
el ttft-8b
timeout 230 kvgate bench ttft --spawn --device cuda --model /tmp/models/8b --data-dir /tmp/kv8 \
  --lengths 8192 --suffix-tokens 40 --repeats 5 --no-peers --no-plot --skip-slow-tiers \
  > $OUT/ttft-8b.log 2>&1; echo "ttft rc=$?"
sed -n '/^kvgate bench ttft:/,$p' $OUT/ttft-8b.log | head -60
grep -iE "bandwidth|slower|recompute|error|Traceback" $OUT/ttft-8b.log | head -12
el decode
timeout 120 python3 -m gateway.bench.decode_steps --model /tmp/models/8b --device cuda \
  --dtype bfloat16 --rows 1,8 --context 2048 --repeats 20 > $OUT/decode-8b.log 2>&1; echo "decode rc=$?"
tail -8 $OUT/decode-8b.log
el done
