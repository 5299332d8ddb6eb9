#!/usr/bin/env bash
# One device call: gpu tests, then kvgate's benches on CUDA (smol, 1b, 8b shapes). Results in $OUT.
export PYTHONUNBUFFERED=1
bash .gpu-bundle/on-gpu.sh setup model smol model 1b > $OUT/setup.log 2>&1; tail -1 $OUT/setup.log
KVGATE_REQUIRE_GPU=1 KVGATE_REQUIRE_REDIS=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --timeout 100 --ignore tests/gateway/cli/test_grpc_cli.py --ignore tests/gateway/service/test_metrics.py --ignore tests/gateway/service/test_openai_http.py > $OUT/gputests.log 2>&1
echo "pytest rc $?"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/gputests.log | cut -c1-300 | tail -12
b() { name=$1; shift; timeout $1 "${@:2}" > $OUT/$name.txt 2> $OUT/$name.err; echo "== $name rc $?"; }
b ttft-smol 100 kvgate bench ttft --spawn --device cuda --model /tmp/models/smol --lengths 2048 --repeats 3 --data-dir /tmp/bd --no-plot
b tiers-smol 60 kvgate bench tiers --device cuda --model /tmp/models/smol --data-dir /tmp/bd --no-plot
b ttft-1b 150 kvgate bench ttft --spawn --device cuda --model /tmp/models/1b --lengths 2048,8192 --repeats 3 --data-dir /tmp/bd --no-plot
bash .gpu-bundle/on-gpu.sh model 8b > $OUT/model8b.log 2>&1
b ttft-8b 170 kvgate bench ttft --spawn --device cuda --model /tmp/models/8b --lengths 8192 --repeats 3 --data-dir /tmp/bd --no-plot
for f in ttft-smol tiers-smol ttft-1b ttft-8b; do echo "##### $f"; grep -v "^\[ttft\]" $OUT/$f.txt | grep -v "^$" | head -40; tail -2 $OUT/$f.err; done
