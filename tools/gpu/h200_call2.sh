#!/usr/bin/env bash
# GPU call 2 (2026-11-28, H200): the chat load on the 1B shape at 8 and 32 users beside
# transformers serve CB, then the flood. Bundle: as next.sh says (PEER_SERVE=1).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[t+$(( $(date +%s) - t0 ))s] $*"; }
el setup; command -v kvgate >/dev/null || bash .gpu-bundle/on-gpu.sh setup 2>&1 | tail -2
bash .gpu-bundle/on-gpu.sh model 1b 2>&1 | tail -1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peersite .gpu-bundle/peer-whl/*.whl || echo "no peer wheels"
# The image's python3 is itself a venv: a venv made from it with --system-site-packages sees
# none of its packages. The peer's wheels go on PYTHONPATH through two wrappers instead
# (bench load runs the `transformers` script beside --peers-python).
mkdir -p /tmp/pbin; B=$(dirname "$(command -v python3)")
for tool in python3 transformers; do
  printf '#!/bin/sh\nPYTHONPATH=/tmp/peersite exec %s "$@"\n' "$B/$tool" > /tmp/pbin/${tool%3}
done; chmod +x /tmp/pbin/*
el chat-load
timeout ${LOAD_S:-240} kvgate bench load --model /tmp/models/1b --device cuda --dtype bfloat16 \
  --users 8,32 --configs kvgate,peer --peers-python /tmp/pbin/python --no-plot \
  --data-dir /tmp/kvload > $OUT/chat-load.log 2> $OUT/chat-load.err; echo "load rc=$?"
tail -22 $OUT/chat-load.log; tail -3 $OUT/chat-load.err
el flood
timeout ${FLOOD_S:-90} python3 .gpu-bundle/flood.py /tmp/models/1b cuda 64 8192 > $OUT/flood.log 2>&1; echo "flood rc=$?"
tail -8 $OUT/flood.log
el done
