"""A latent-attention model's cache in the page pool: each token's latent over the K and V halves.

Why the pool's two planes: a model with multi-head latent attention (DeepSeek-V2/V3) keeps one
vector a token and layer -- its normalised latent and its rotated shared key, side by side
(``LatentAttention.width`` numbers) -- where other models keep K and V per KV head. Every page,
block, tier, MAC and transfer here moves a layer as a K plane and a V plane of
``[kv_heads, tokens, head_dim]``; a latent model's layout is one "KV head" of ``width / 2``
numbers, the latent's first half in the K plane and its second in the V plane. A cached token
then costs exactly the latent's bytes, as in the model's own cache, and no tier needs to know.

Attention reads the halves back side by side (``LatentKV``); the latent is both what the
queries score against and what their weights sum (the values), so one gathered tensor serves as
both.
"""

from __future__ import annotations

import torch

from gateway.engine.kv.sequence import LayerPages
from tiers.payload import KVLayout


def latent_layout(num_layers: int, width: int, dtype: torch.dtype) -> KVLayout:
    """The pool's layout for latents of ``width`` numbers a token and layer (an even width)."""
    if width % 2:
        raise ValueError(f"a latent of {width} numbers does not split over the K and V halves")
    return KVLayout(num_layers=num_layers, kv_heads=1, head_dim=width // 2, dtype=dtype)


def latent_halves(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V planes' parts of latents ``[..., tokens, width]``: ``[..., tokens, 1,
    width / 2]`` each, as the forward hands a step's K and V to be written."""
    half = latent.shape[-1] // 2
    return (latent[..., :half].unsqueeze(-2).contiguous(),
            latent[..., half:].unsqueeze(-2).contiguous())


def joined_latent(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The latents ``[1, tokens, width]`` of a layer's K and V planes ``[1, tokens, width/2]``."""
    return torch.cat([keys, values], dim=-1)


class LatentKV:
    """One layer of a latent sequence as attention reads it: the latents gathered, serving as
    keys and as values (``gateway.engine.attention.tiled.LayerKV``)."""

    __slots__ = ("_latent", "_planes")

    def __init__(self, planes: LayerPages) -> None:
        self._planes = planes
        self._latent: torch.Tensor | None = None

    def keys(self) -> torch.Tensor:
        """``[1, capacity, width]``: every position's latent and rotated shared key."""
        if self._latent is None:
            self._latent = joined_latent(self._planes.keys(), self._planes.values())
        return self._latent

    def values(self) -> torch.Tensor:
        return self.keys()
