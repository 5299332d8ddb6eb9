"""One life of a vLLM engine, run in vLLM's own venv by the tests of ``tests/vllm_worker``.

Reads a JSON job on stdin -- the checkpoint, the kvgate config (or none: vLLM without the
connector), the requests in order -- runs each request alone through an eager ``vllm.LLM``
(greedy), and prints one JSON line per request: its generated token ids, what the connector
returned in ``kv_transfer_params``, vLLM's count of cached prompt tokens, and its time to
finish. A life is a process of its own so that a restart is a real one: vLLM's memory is gone,
kvgate's disk and Redis are not.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

RESULT_PREFIX = "KVGATE-LIFE "


def engine(job: dict[str, Any]) -> Any:
    from vllm import LLM

    options: dict[str, Any] = {
        "model": job["model"], "dtype": job.get("dtype", "float32"), "enforce_eager": True,
        "block_size": job["block_size"],
        "enable_prefix_caching": job.get("prefix_caching", False),
        "max_model_len": job.get("max_model_len", 1024),
        "kv_cache_memory_bytes": job.get("kv_cache_bytes", 64 << 20), "seed": 0,
    }
    if job.get("kvgate_config"):
        extra = {"kvgate_config": job["kvgate_config"],
                 "default_scope": job.get("default_scope", "none")}
        options["kv_transfer_config"] = {
            "kv_connector": "KvgateConnector",
            "kv_connector_module_path": "gateway.vllm_connector.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}
    return LLM(**options)


def main() -> None:
    from vllm import SamplingParams

    job = json.load(sys.stdin)
    llm = engine(job)
    previous: list[int] = []
    for request in job["requests"]:
        params = SamplingParams(temperature=0.0, max_tokens=job.get("max_tokens", 8),
                                ignore_eos=job.get("ignore_eos", False),
                                extra_args=({"kv_transfer_params": request["params"]}
                                            if request.get("params") else None))
        # "after_previous": the next turn of a conversation -- the previous prompt, its
        # answer, then these tokens
        tokens = (previous + request["after_previous"] if "after_previous" in request
                  else request["tokens"])
        started = time.perf_counter()
        (output,) = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
        previous = tokens + list(output.outputs[0].token_ids)
        seconds = time.perf_counter() - started
        print(RESULT_PREFIX + json.dumps({
            "tokens": list(output.outputs[0].token_ids),
            "prompt": tokens,
            "connector": output.kv_transfer_params,
            "cached": output.num_cached_tokens,
            "seconds": seconds,
        }), flush=True)


if __name__ == "__main__":
    main()
