"""vLLM's first warm request after a restart, its prefix loaded from kvgate's disk tier through
the KV connector, against a cold prompt of the same length in the same life (issue 49).

    python tools/bench/vllm_restart.py [--model bundled] [--cached-tokens 2048] [--runs 5]
        [--vllm-python .venv-vllm/bin/python] [--dtype bfloat16] [--block-size 64]

One vLLM life stores a prompt of ``--cached-tokens`` whole blocks and one more block; then each
run is a new life (a restart: vLLM's memory is empty, kvgate's disk is not) whose first request
is that prompt -- its blocks loaded from disk, only its last block computed -- and whose second
is a prompt of the same length nobody cached. Each request generates one token, so its time is
its time to first token. Prints every run and the median ratio warm / cold. The warm request
is each life's first: whatever a first request costs a fresh vLLM, it pays.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULT = "KVGATE-BENCH "


def life(job: dict[str, Any]) -> None:
    """In vLLM's venv: one engine, the job's prompts in order, one token each."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], dtype=job["dtype"], enforce_eager=True,
              block_size=job["block_size"], enable_prefix_caching=False,
              max_model_len=job["max_model_len"], kv_cache_memory_bytes=512 << 20, seed=0,
              kv_transfer_config={
                  "kv_connector": "KvgateConnector",
                  "kv_connector_module_path": "gateway.vllm_connector.connector",
                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {"kvgate_config": job["config"],
                                                "default_scope": "shared"}})
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for tokens in job["prompts"]:
        started = time.perf_counter()
        (output,) = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        print(RESULT + json.dumps({"seconds": seconds, "connector": output.kv_transfer_params}),
              flush=True)


def run_life(python: str, job: dict[str, Any]) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    done = subprocess.run([python, __file__, "--life"], input=json.dumps(job), text=True,
                          capture_output=True, env=env, cwd=REPO, timeout=1800, check=False)
    results = [json.loads(line[len(RESULT):]) for line in done.stdout.splitlines()
               if line.startswith(RESULT)]
    if done.returncode != 0 or len(results) != len(job["prompts"]):
        sys.exit(f"vLLM's life failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return results


def model_directory(model: str) -> str:
    if model != "bundled":
        return model
    from gateway.engine.models.loading import converted_checkpoint
    directory = converted_checkpoint("bundled", REPO / "data" / "models")
    assert directory is not None
    return str(directory)


def write_config(directory: Path, block_size: int) -> Path:
    path = directory / "kvgate.toml"
    path.write_text(f"""
[server]
data_dir = "{directory / 'data'}"

[cache]
block_tokens = {block_size}
measure_at_start = false

[[cache.tier]]
kind = "device"
bytes = "512MiB"

[[cache.tier]]
kind = "disk"
bytes = "4GiB"
path = "{directory / 'kv'}"
fsync = false
""")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--life", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="bundled")
    parser.add_argument("--cached-tokens", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    options = parser.parse_args()
    if options.life:
        life(json.load(sys.stdin))
        return
    if options.cached_tokens % options.block_size:
        sys.exit("--cached-tokens must be whole blocks (a multiple of --block-size)")
    length = options.cached_tokens + options.block_size
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(10, options.vocab) for _ in range(length)]

    cached = prompt()
    with tempfile.TemporaryDirectory(prefix="kvgate-vllm-restart-") as scratch:
        directory = Path(scratch)
        job = {"model": model_directory(options.model), "dtype": options.dtype,
               "block_size": options.block_size, "max_model_len": length + 64,
               "config": str(write_config(directory, options.block_size))}
        stored = run_life(options.vllm_python, {**job, "prompts": [cached]})[0]
        print(f"stored: {length} tokens in {stored['seconds']:.3f} s (a cold life's first "
              "request)", flush=True)
        ratios = []
        for run in range(1, options.runs + 1):
            warm, cold = run_life(options.vllm_python, {**job, "prompts": [cached, prompt()]})
            loaded = (warm["connector"] or {}).get("kvgate.loaded_tokens", 0)
            ratio = warm["seconds"] / cold["seconds"]
            ratios.append(ratio)
            print(f"run {run}: after a restart, warm {warm['seconds']:.3f} s ({loaded} tokens "
                  f"from kvgate's disk), cold {cold['seconds']:.3f} s: {ratio:.3f}x", flush=True)
    print(f"median warm / cold over {options.runs} restarts: {statistics.median(ratios):.3f}x "
          f"({options.cached_tokens} cached tokens, {options.dtype}, block {options.block_size})")


if __name__ == "__main__":
    main()
