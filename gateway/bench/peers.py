"""The references beside kvgate in ``kvgate bench ttft``: transformers' recipe and llama.cpp.

* transformers' prompt-reuse recipe, in this process on the same model, on the gateway's device
  in its dtype (``--device``, ``--dtype``): prefill the prefix into a ``DynamicCache`` once,
  then per request ``copy.deepcopy`` it and run the suffix.
* llama.cpp's own prompt cache on the same GGUF file (``LlamaRAMCache`` and ``LlamaDiskCache``
  through llama-cpp-python), run by the separate ``.venv-peers`` interpreter (``make
  bench-peers``) so that kvgate's own environment needs nothing.

Both return ``Row``s of the same labels and samples as the gateway's, so the report puts them
side by side.
"""

from __future__ import annotations

import copy
import inspect
import json
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import torch

from gateway.bench.numerics import BenchNumerics
from gateway.bench.prompts import SuffixSource
from gateway.bench.rows import (
    HF_COLD,
    HF_SUFFIX,
    HF_WARM,
    LLAMA_COLD,
    LLAMA_DISK,
    LLAMA_RAM,
    PINNED_COPY,
    BenchError,
    Row,
    Sample,
)
from gateway.engine.models.loading import LoadedModel

PEERS_VENV = ".venv-peers"
LLAMA_CPP_THREADS = 2


# ---- transformers' prompt-reuse recipe -----------------------------------------------------


def _first_token(loaded: LoadedModel, token_ids: Sequence[int], cache: Any,
                 device: torch.device) -> tuple[int, Any]:
    """The greedy first token (``int`` waits for the device) and the cache after the forward."""
    with torch.inference_mode():
        out = loaded.transformers_model()(
            input_ids=torch.tensor([list(token_ids)], dtype=torch.long, device=device),
            past_key_values=cache, use_cache=True, logits_to_keep=1)
    return int(out.logits[0, -1].argmax()), out.past_key_values


def hf_recipe_rows(loaded: LoadedModel, prefix: list[int], suffixes: SuffixSource,
                   repeats: int, err: TextIO, numerics: BenchNumerics) -> list[Row]:
    """Cold: the whole prompt in one forward. Warm: the documented recipe -- the prefix's
    ``DynamicCache`` computed once, ``copy.deepcopy``'d per request, the suffix run on it.
    Then two physical references: the suffix alone over the ready cache (no copy: the floor of
    a warm start from memory the model reads in place), and on a GPU the copy of the prefix's
    K/V bytes from pinned host memory to the device (the floor of a warm start from the host
    tier, before its suffix).

    ``loaded`` runs on ``numerics.device`` in its dtype (the gateway's: the comparison is fair
    only on the same hardware); the clock is read once the device is done.
    """
    device = numerics.device
    cold = Row(label=HF_COLD, system="hf")
    warm = Row(label=HF_WARM, system="hf")
    for i in range(repeats):
        began = numerics.clock()
        _first_token(loaded, prefix + suffixes.next(), None, device)
        cold.samples.append(Sample(seconds=numerics.clock() - began, cached_tokens=0,
                                   served_from="-"))
        err.write(f"[ttft] {len(prefix)}: HF recipe cold {i + 1}/{repeats}: "
                  f"{cold.samples[-1].seconds * 1e3:.1f} ms\n")
    _, prefix_cache = _first_token(loaded, prefix, None, device)
    for i in range(repeats):
        began = numerics.clock()
        cache = copy.deepcopy(prefix_cache)
        num_cached = int(cache.get_seq_length())
        _first_token(loaded, suffixes.next(), cache, device)
        warm.samples.append(Sample(seconds=numerics.clock() - began,
                                   cached_tokens=num_cached, served_from="DynamicCache copy"))
        err.write(f"[ttft] {len(prefix)}: HF recipe warm {i + 1}/{repeats}: "
                  f"{warm.samples[-1].seconds * 1e3:.1f} ms\n")
    suffix_only = Row(label=HF_SUFFIX, system="hf")
    for _ in range(repeats):
        cache = copy.deepcopy(prefix_cache)  # before the clock: only the forward is timed
        began = numerics.clock()
        _first_token(loaded, suffixes.next(), cache, device)
        suffix_only.samples.append(Sample(seconds=numerics.clock() - began,
                                          cached_tokens=len(prefix), served_from="in place"))
    return [cold, warm, suffix_only, _pinned_copy_row(loaded, len(prefix), repeats, numerics)]


def _pinned_copy_row(loaded: LoadedModel, num_tokens: int, repeats: int,
                     numerics: BenchNumerics) -> Row:
    """The prefix's K/V bytes copied from pinned host memory to the device, in one copy."""
    if numerics.device.type != "cuda":
        return Row(label=PINNED_COPY, system="hf",
                   note=f"n/a (a GPU's host -> device copy; the model runs on "
                        f"{numerics.device.type})")
    num_bytes = loaded.layout.bytes_per_token * num_tokens
    source = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    row = Row(label=PINNED_COPY, system="hf")
    for _ in range(repeats + 1):  # the first one allocates on the device: not counted
        began = numerics.clock()
        copied = source.to(numerics.device, non_blocking=True)
        seconds = numerics.clock() - began
        del copied
        row.samples.append(Sample(seconds=seconds, cached_tokens=num_tokens,
                                  served_from=f"{num_bytes / 2**20:,.0f} MiB pinned"))
    row.samples.pop(0)
    return row


# ---- llama.cpp (llama-cpp-python in its own venv) ------------------------------------------


def _llama_cpp_worker() -> None:
    """Runs in the peers venv (stdlib and llama_cpp only): a JSON spec on stdin, results on
    stdout. Every completion is one token, streamed; TTFT is the time to its first chunk (the
    cache saves its state after the last chunk, outside the timing)."""
    import importlib
    import json
    import os
    import shutil
    import sys
    import tempfile
    import time

    llama_cpp = importlib.import_module("llama_cpp")
    spec = json.load(sys.stdin)
    progress = sys.stderr
    sys.stderr = open(os.devnull, "w")  # LlamaDiskCache prints on every put
    llm = llama_cpp.Llama(model_path=spec["gguf"], n_ctx=spec["n_ctx"], n_batch=512,
                          n_threads=spec["threads"], n_threads_batch=spec["threads"],
                          verbose=False)

    num_evaluated = [0]
    evaluate = llm.eval

    def counting_eval(tokens: list[int]) -> None:
        num_evaluated[0] += len(tokens)
        evaluate(tokens)

    llm.eval = counting_eval  # what the prompt cache did not supply is evaluated here

    def timed(prompt: list[int]) -> list[float]:
        llm.reset()  # forget the context's own tokens: only the prompt cache may help
        num_evaluated[0] = 0
        began = time.perf_counter()
        stream = llm.create_completion(prompt, max_tokens=1, temperature=0.0, stream=True)
        next(stream, None)
        elapsed = time.perf_counter() - began
        num_cached = len(prompt) - num_evaluated[0]
        for _ in stream:
            pass
        return [elapsed, float(num_cached)]

    def say(text: str) -> None:
        progress.write(f"[ttft] {text}\n")
        progress.flush()

    results: dict[str, dict[str, list[list[float]]]] = {}
    scratch = tempfile.mkdtemp(prefix="kvgate-bench-llama-cache-")
    try:
        llm.set_cache(None)
        timed(spec["warmup"])
        for case in spec["cases"]:
            prefix = case["prefix"]
            n = len(prefix)
            out: dict[str, list[list[float]]] = {"cold": [], "ram": [], "disk": []}
            llm.set_cache(None)
            for i, suffix in enumerate(case["cold"]):
                out["cold"].append(timed(prefix + suffix))
                say(f"{n}: llama.cpp cold {i + 1}/{len(case['cold'])}: "
                    f"{out['cold'][-1][0] * 1e3:.1f} ms")
            caches = (
                ("ram", llama_cpp.LlamaRAMCache(capacity_bytes=spec["cache_bytes"])),
                ("disk", llama_cpp.LlamaDiskCache(cache_dir=f"{scratch}/{n}",
                                                  capacity_bytes=spec["cache_bytes"])),
            )
            for name, cache in caches:
                llm.set_cache(cache)
                timed(prefix)  # fills the cache with the prefix's state
                for i, suffix in enumerate(case[name]):
                    out[name].append(timed(prefix + suffix))
                    say(f"{n}: llama.cpp {name}-cache warm {i + 1}/{len(case[name])}: "
                        f"{out[name][-1][0] * 1e3:.1f} ms")
            llm.set_cache(None)
            results[str(n)] = out
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    json.dump({"version": llama_cpp.__version__, "results": results}, sys.stdout)


def peers_python(explicit: Path | None = None) -> tuple[Path | None, str]:
    """The interpreter with llama_cpp, or None and why not."""
    python = explicit if explicit is not None else (
        Path(__file__).resolve().parents[2] / PEERS_VENV / "bin" / "python")
    if not python.is_file():
        return None, "n/a (run make bench-peers)"
    probe = subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True,
                           timeout=120, check=False)
    if probe.returncode != 0:
        return None, "n/a (run make bench-peers: llama_cpp does not import)"
    return python, ""


def llama_cpp_rows(python: Path, gguf: Path, cases: list[tuple[list[int], SuffixSource]],
                   repeats: int, err: TextIO) -> tuple[dict[int, list[Row]], str]:
    """Run the llama.cpp reference for every length in one subprocess (one model load)."""
    longest = max(len(prefix) for prefix, _ in cases)
    spec = {
        "gguf": str(gguf),
        "n_ctx": -(-(longest + 64) // 256) * 256,
        "threads": LLAMA_CPP_THREADS,
        "cache_bytes": 8 << 30,
        "warmup": cases[0][0][:32],
        "cases": [
            {"prefix": prefix,
             **{name: [suffixes.next() for _ in range(repeats)]
                for name in ("cold", "ram", "disk")}}
            for prefix, suffixes in cases
        ],
    }
    source = textwrap.dedent(inspect.getsource(_llama_cpp_worker)) + "\n_llama_cpp_worker()\n"
    proc = subprocess.run([str(python), "-c", source], input=json.dumps(spec), text=True,
                          stdout=subprocess.PIPE, stderr=None if err is sys.stderr else
                          subprocess.PIPE, cwd=tempfile.gettempdir(), check=False)
    if proc.returncode != 0:
        raise BenchError(f"the llama.cpp reference failed (status {proc.returncode})"
                         + (f":\n{proc.stderr[-2000:]}" if proc.stderr else ""))
    if proc.stderr:
        err.write(proc.stderr)
    answer = json.loads(proc.stdout)
    rows: dict[int, list[Row]] = {}
    for key, out in answer["results"].items():
        labelled = ((LLAMA_COLD, "cold", "-"), (LLAMA_RAM, "ram", "LlamaRAMCache"),
                    (LLAMA_DISK, "disk", "LlamaDiskCache"))
        rows[int(key)] = [
            Row(label=label, system="llama.cpp", samples=[
                Sample(seconds=s, cached_tokens=int(c), served_from=where if c else "-")
                for s, c in out[name]
            ])
            for label, name, where in labelled
        ]
    return rows, str(answer["version"])
