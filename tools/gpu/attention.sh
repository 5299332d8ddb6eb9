#!/usr/bin/env bash
# What the 2026-11-26 H100 session ran last (docs/gpu.md, "An H100 (2026-11-26)"): the Triton
# kernel's tests compiled, its shapes timed beside SDPA, a cold 8k prefill profiled, bench ttft
# on the 1B shape, the parity tests. Copy it and profile_cold.py into .gpu-bundle/ first.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[t+$(( $(date +%s) - t0 ))s] $*"; }
left() { echo $(( $1 - ($(date +%s) - t0) )); }
el setup; bash .gpu-bundle/on-gpu.sh setup 2>&1 | tail -1
el kernel-tests
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gateway/engine/test_triton_attention.py tests/gateway/engine/test_kv_sequence.py 2>&1 | tail -30 > $OUT/kernel-tests.log; tail -4 $OUT/kernel-tests.log
el kernel-bench
for s in 8b 1b; do timeout 70 python3 -m gateway.bench.attention_kernels --shape $s --repeats 10 --variant 32,64,8,- --variant 16,128,-,- --variant 32,128,8,- --variant 16,64,8,- --variant 16,64,-,2 --variant 16,64,-,4 2>&1 | tail -8; done > $OUT/kernel-bench.log; cat $OUT/kernel-bench.log
el model; bash .gpu-bundle/on-gpu.sh model 1b 2>&1 | tail -1
el profile
timeout 60 python3 .gpu-bundle/profile_cold.py /tmp/models/1b 8192 8192 > $OUT/profile.log 2>&1; grep -E "^cold" $OUT/profile.log
el ttft
timeout 80 kvgate bench ttft --spawn --device cuda --model /tmp/models/1b --data-dir /tmp/kvdata --lengths 2048,8192 --repeats 3 --no-peers --no-plot 2>&1 | tail -32 > $OUT/ttft.log; sed -n 1,24p $OUT/ttft.log
el gpu-tests
timeout $(left 290) python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/gateway/engine/test_parity.py tests/gateway/engine/test_gpu_placement.py tests/gateway/engine/test_dtype.py 2>&1 | tail -20 > $OUT/gpu-tests.log; tail -4 $OUT/gpu-tests.log
el done
