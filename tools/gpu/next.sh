#!/usr/bin/env bash
# The next GPU session's second call (first: next_8b.sh), written 2026-11-27: the issue-24
# targets that have never run on a GPU (the chat load, the flood), then the host path's profile,
# whole and layer by layer (layered_host_loads, built 2026-11-27 without a GPU), and its tests.
# One call, timeout_s 600. Bundle: EXTRA_PACKAGES="hiredis blake3 starlette uvicorn h11 pyzmq
# msgspec" PEER_SERVE=1 ../shared/gpu/prepare.sh; copy this file, next_8b.sh, flood.py and profile_warm.py into
# .gpu-bundle/, carry .gpu-bundle, run: bash .gpu-bundle/next.sh
# The peer's wheels (an older starlette among them) go into a venv of their own, so that
# kvgate's HTTP front keeps the starlette it needs.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[t+$(( $(date +%s) - t0 ))s] $*"; }
el setup; bash .gpu-bundle/on-gpu.sh setup model 1b 2>&1 | tail -2
python3 -m venv --system-site-packages /tmp/peer && /tmp/peer/bin/python -m pip install -q \
  --no-index --no-deps --no-compile .gpu-bundle/peer-whl/*.whl || echo "no peer venv"
el chat-load  # 1B shape, 8 and 32 users: kvgate (captured steps, the default) beside transformers serve CB
timeout 300 kvgate bench load --model /tmp/models/1b --device cuda --dtype bfloat16 \
  --users 8,32 --configs kvgate,peer --peers-python /tmp/peer/bin/python --no-plot \
  --data-dir /tmp/kvload > $OUT/chat-load.log 2> $OUT/chat-load.err
tail -20 $OUT/chat-load.log; tail -3 $OUT/chat-load.err
el flood  # 64 users with 8k prompts: each answered or refused with RESOURCE_EXHAUSTED
timeout 120 python3 .gpu-bundle/flood.py /tmp/models/1b cuda 64 8192 2>&1 | tail -8
el host-profile  # the host path after the batched get (one fence a chain) and lazy page views
timeout 90 python3 .gpu-bundle/profile_warm.py /tmp/models/1b 8192 40 cuda host 2>&1 | \
  grep -E "medians|warm|cold|suffix" | head -6
el host-layered  # [cache] layered_host_loads: the copy by layer on its own stream, beside the step
timeout 90 python3 .gpu-bundle/profile_warm.py /tmp/models/1b 8192 40 cuda host-layered 2>&1 | \
  grep -E "medians|warm|cold|suffix|layered" | head -6
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/tiers/test_layer_arrivals.py \
  tests/gateway/engine/test_parity.py -k "layer" 2>&1 | tail -3
el done
