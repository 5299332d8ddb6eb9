"""The namespace of a vLLM page layout: which vLLM pages kvgate may hand to which vLLM.

Why the layout is part of the name: vLLM's CPU backend keeps a layer's KV as one tensor
``[blocks, kv_heads, block_size, 2 * head_size]`` whose bytes are packed for the instruction set
its kernels chose (``vec``: K dimension-major, V token-major; ``amx``: both tile-packed), so a
stored page means something only to the same vLLM version, backend, instruction set, dtype and
block size (docs/vllm-worker.md, "How it works"). All of them go into the
namespace's device kind, beside the model's fingerprint and the scope, so two builds never read
each other's pages. A page cannot be cut into token ranges either: kvgate's block is vLLM's
page, and its size is checked, not converted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gateway.core.fingerprint import Namespace, NamespaceSpec, Scope, derive_namespace
from tiers.payload import KVLayout

CPU_BLOCK_MULTIPLE = 32
"""vLLM's CPU attention takes block sizes in multiples of 32."""


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmPageLayout:
    """How one vLLM deployment lays out a model's KV pages.

    Attributes:
        vllm_version: vLLM's version (``vllm.__version__``).
        backend: its attention backend's name (``CPU_ATTN``).
        isa: the instruction set the backend's kernels pack pages for (``vec``, ``amx``...).
        dtype: the KV cache's dtype.
        block_size: tokens a page.
        num_layers: layers with a KV cache.
        kv_heads: KV heads a layer (of this worker: tensor parallelism is refused).
        head_size: a head's size.
    """

    vllm_version: str
    backend: str
    isa: str
    dtype: torch.dtype
    block_size: int
    num_layers: int
    kv_heads: int
    head_size: int

    @property
    def kv_dtype(self) -> str:
        """The KV dtype's name, as namespaces write it (``float32``)."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def device_kind(self) -> str:
        """The namespace's device kind: every field that changes what a page's bytes mean."""
        return (f"vllm-cpu/{self.vllm_version}/{self.backend}/{self.isa}/{self.kv_dtype}"
                f"/bs{self.block_size}")

    @property
    def kv_layout(self) -> KVLayout:
        """kvgate's layout of a block holding one page of every layer."""
        return KVLayout(num_layers=self.num_layers, kv_heads=self.kv_heads,
                        head_dim=self.head_size, dtype=self.dtype)

    def problems(self, block_tokens: int) -> list[str]:
        """Why kvgate's blocks of ``block_tokens`` cannot hold these pages (empty: they can),
        one sentence each, naming the setting to change."""
        found = []
        if self.block_size % CPU_BLOCK_MULTIPLE:
            found.append(f"vLLM's block size {self.block_size} is not a multiple of "
                         f"{CPU_BLOCK_MULTIPLE}: start vLLM with --block-size a multiple of it")
        if block_tokens != self.block_size:
            found.append(f"kvgate's [cache] block_tokens is {block_tokens} and vLLM's block size "
                         f"{self.block_size}: a vLLM page is one kvgate block, so set both to "
                         "the same size (vLLM's --block-size)")
        return found

    def namespace(self, *, deployment_secret: bytes, model_fingerprint: str,
                  scope: Scope) -> Namespace:
        """The namespace these pages are stored under for ``scope``."""
        return derive_namespace(NamespaceSpec(
            deployment_secret=deployment_secret, model_fingerprint=model_fingerprint,
            kv_dtype=self.kv_dtype, device_kind=self.device_kind, scope=scope))
