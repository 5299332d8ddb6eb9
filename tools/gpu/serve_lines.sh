#!/usr/bin/env bash
# start kvgate serve with MODEL DEVICE DTYPE, print its log until it serves (or 120 s), stop it
model=$1; device=$2; dtype=$3; port=$4
log=$OUT/serve-$(basename $model)-$device-$dtype.log
kvgate serve --model $model --device $device --dtype $dtype --port $port --no-http --data-dir /tmp/sd-$port > $log 2>&1 &
pid=$!
for i in $(seq 1 240); do grep -qi "serving\|listening\|error" $log && break; sleep 0.5; done
sleep 1; kill $pid; wait $pid
echo "== $model $device $dtype"; grep -v "Loading weights" $log | tail -8
