"""The targets ``kvgate bench ttft`` prints after its tables: PASS or MISS against references
measured in the same run (information, never an assertion).

Two sets, by where the model runs. On a CPU, at 2,048 tokens: the warm rows against kvgate's own
cold row, transformers' warm recipe and llama.cpp's caches. On a GPU, at 8,192 tokens, the GPU
issue's: cold against transformers' one-shot prefill, warm from the device tier against its
suffix-only forward over a ready cache, warm from the host tier against the pinned copy of the
prefix plus that forward, and disk and Redis never slower than cold -- whether they loaded or the
gateway recomputed instead (``skip_slow_tiers``: what a user gets counts there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from gateway.bench.rows import (
    COLD,
    DEVICE,
    DISK,
    HF_COLD,
    HF_SUFFIX,
    HF_WARM,
    HOST,
    LLAMA_DISK,
    LLAMA_RAM,
    PINNED_COPY,
    REDIS,
    LengthResult,
    Row,
)

CPU_TARGET_LENGTH = 2048
GPU_TARGET_LENGTH = 8192


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """``row``'s median <= ``factor`` x the sum of the ``references``' medians.

    ``served_any``: the row counts however it was served (a recompute included); otherwise
    only a row every sample of which came from the tier it is meant to show.
    """

    name: str
    row: str
    references: tuple[str, ...]
    factor: float
    served_any: bool = False


CPU_TARGETS = (
    Target(name="warm device <= 1.3x HF recipe warm", row=DEVICE, references=(HF_WARM,),
           factor=1.3),
    Target(name="warm device <= 5% of cold", row=DEVICE, references=(COLD,), factor=0.05),
    Target(name="warm disk <= 10% of cold", row=DISK, references=(COLD,), factor=0.10),
    Target(name="warm redis <= 12% of cold", row=REDIS, references=(COLD,), factor=0.12),
    Target(name="warm device <= llama.cpp RAM cache", row=DEVICE, references=(LLAMA_RAM,),
           factor=1.0),
    Target(name="warm host <= llama.cpp RAM cache", row=HOST, references=(LLAMA_RAM,),
           factor=1.0),
    Target(name="warm disk <= llama.cpp disk cache", row=DISK, references=(LLAMA_DISK,),
           factor=1.0),
)

GPU_TARGETS = (
    Target(name="cold <= 1.25x HF one-shot prefill", row=COLD, references=(HF_COLD,),
           factor=1.25, served_any=True),
    Target(name="warm device <= 1.15x HF suffix only", row=DEVICE, references=(HF_SUFFIX,),
           factor=1.15),
    Target(name="warm host <= 1.2x (pinned copy + suffix)", row=HOST,
           references=(PINNED_COPY, HF_SUFFIX), factor=1.2),
    Target(name="disk row never slower than cold", row=DISK, references=(COLD,), factor=1.0,
           served_any=True),
    Target(name="redis row never slower than cold", row=REDIS, references=(COLD,), factor=1.0,
           served_any=True),
)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def _verdict(target: Target, result: LengthResult) -> tuple[str, str]:
    row = result.row(target.row)
    if row is None or row.median_s is None:
        return "n/a", f"{target.row}: not measured"
    if not target.served_any and not row.is_served_as_meant:
        return "n/a", f"served from {row.served_text}, not {row.tier}"
    medians: list[float] = []
    for name in target.references:
        reference: Row | None = result.row(name)
        if reference is None or reference.median_s is None:
            return "n/a", f"{name}: not measured"
        medians.append(reference.median_s)
    bound = target.factor * sum(medians)
    verdict = "PASS" if row.median_s <= bound else "MISS"
    return verdict, f"{_ms(row.median_s)} ms vs {_ms(bound)} ms"


def print_targets(results: Sequence[LengthResult], out: TextIO, *,
                  on_gpu: bool = False) -> dict[str, str]:
    """PASS / MISS (or n/a, saying why) per target of the device's set, at its length."""
    targets, length = ((GPU_TARGETS, GPU_TARGET_LENGTH) if on_gpu
                       else (CPU_TARGETS, CPU_TARGET_LENGTH))
    verdicts: dict[str, str] = {}
    result = next((r for r in results if r.prefix_tokens == length), None)
    out.write(f"\ntargets at {length:,} tokens (information only):\n")
    if result is None:
        out.write(f"  not measured: add {length} to --lengths\n")
        return verdicts
    width = max(38, *(len(target.name) for target in targets))
    for target in targets:
        verdict, detail = _verdict(target, result)
        verdicts[target.name] = verdict
        out.write(f"  {verdict:<5} {target.name:<{width}} {detail}\n")
    return verdicts
