#!/usr/bin/env bash
# Issue 24's targets on a lent GPU, in one call of about 9-10 minutes (timeout_s 600; write what it prints
# into docs/gpu.md with the date and the card). Copy this file, profile_cold.py, profile_warm.py and the bundle
# (../shared/gpu/prepare.sh with EXTRA_PACKAGES="hiredis blake3 starlette uvicorn pyzmq msgspec")
# into .gpu-bundle/, carry .gpu-bundle, run: bash .gpu-bundle/targets.sh
# Order: what proves answers right first (parity on CUDA, captured decode steps included), the
# captured decode steps against eager, then the 8B-shape figures the
# targets name (with the gateway's default load-or-recompute choice: the target is what users
# get), the warm path's profile, then the 1B shape (every tier row loading from its tier) and
# the kernel table: what the 600 s may cut off comes last.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[t+$(( $(date +%s) - t0 ))s] $*"; }
el setup; bash .gpu-bundle/on-gpu.sh setup 2>&1 | tail -1
el parity
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu --maxfail=5 tests/gateway/engine \
  tests/gateway/bench tests/tiers 2>&1 | tail -15 > $OUT/parity.log; tail -3 $OUT/parity.log
el models; bash .gpu-bundle/on-gpu.sh model 1b model 8b 2>&1 | grep "^model"
el decode  # captured decode steps against eager, beside one read of the weights
for s in "8b 1,8" "1b 1,8,32"; do set -- $s
  timeout 60 python3 -m gateway.bench.decode_steps --model /tmp/models/$1 --device cuda \
    --dtype bfloat16 --rows $2 --context 2048 --repeats 20 2>&1 | tail -9
done > $OUT/decode.log; cat $OUT/decode.log
el ttft-8b  # with captured steps (the 1B rows below run without: both are seen)
timeout 240 kvgate bench ttft --spawn --device cuda --model /tmp/models/8b --data-dir /tmp/kv8 \
  --lengths 8192 --suffix-tokens 40 --repeats 3 --no-peers --no-plot --skip-slow-tiers \
  2>&1 \
  | tail -26 > $OUT/ttft-8b.log
sed -n 1,18p $OUT/ttft-8b.log
el profile-warm
timeout 90 python3 .gpu-bundle/profile_warm.py /tmp/models/1b 2048 32 cuda > $OUT/profile-warm.log 2>&1
sed -n 1,6p $OUT/profile-warm.log
el ttft-1b
timeout 100 kvgate bench ttft --spawn --device cuda --model /tmp/models/1b --data-dir /tmp/kv1 \
  --lengths 2048,8192 --repeats 3 --no-peers --no-plot 2>&1 | tail -40 > $OUT/ttft-1b.log
grep -E "^prefix|cold|warm|copy|suffix" $OUT/ttft-1b.log
el kernels
for s in 8b 1b; do timeout 40 python3 -m gateway.bench.attention_kernels --shape $s --repeats 10; done \
  > $OUT/kernels.log 2>&1; cat $OUT/kernels.log
el done
