#!/usr/bin/env bash
# Issue 24's chat-load targets on a lent GPU (second call, after targets.sh; timeout_s 600):
# the 1B shape under `kvgate bench load` at 8 and 32 users, kvgate eager and with captured
# steps beside transformers serve --continuous-batching on the same GPU. Needs the bundle made
# with PEER_SERVE=1 (../shared/gpu/prepare.sh) for the peer's rows; without it they say n/a.
# Copy this file into .gpu-bundle/, carry .gpu-bundle, run: bash .gpu-bundle/chat_load.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[t+$(( $(date +%s) - t0 ))s] $*"; }
el setup; bash .gpu-bundle/on-gpu.sh setup peer-serve model 1b 2>&1 | tail -2
el load
timeout 540 kvgate bench load --model /tmp/models/1b --device cuda --dtype bfloat16 \
  --users 8,32 --configs kvgate,eager,peer --peers-python python3 --no-plot \
  --data-dir /tmp/kvload > $OUT/chat-load.log 2> $OUT/chat-load.err
tail -20 $OUT/chat-load.log; tail -5 $OUT/chat-load.err
el done
