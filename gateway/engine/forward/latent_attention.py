"""Multi-head latent attention (DeepSeek-V2/V3) in the batched forward, each token's numbers
its own.

What the model computes (transformers' ``DeepseekV3Attention``): a token's latent ``c`` (the
normalised first ``rank`` numbers of ``kv_a_proj_with_mqa``) and its shared rotary key ``r``
(the rest, rotated); each head's key is ``[W_k c ; r]`` and its value ``W_v c``, ``W_k`` and
``W_v`` the head's rows of ``kv_b_proj``. Expanding every cached token through ``kv_b_proj`` at
every step would cost the whole context's product per layer and step. Here the head's
``W_k`` is folded into its query instead (``q' = [W_k^T q_nope ; q_rot]``, so that
``q' . [c ; r]`` is the head's score) and its ``W_v`` into the output (``W_v`` of the weighted
sum of latents): the attention is then one "KV head" of ``rank + rope_dim`` numbers that every
query head shares, over exactly what the cache holds (``gateway.engine.kv.latent``).

Every product is the row products' own (``RowProducts.project``), the folded ``W_k^T`` and
``W_v`` one per head, so a row's bits depend on that row alone; the scores' scale is the
model's (``qk_head_dim ** -0.5``, YaRN's mscale applied: the family's ``attention_scale``), not
the latent's width's. Folding changes the order of the sums from transformers' expanded form:
the logits agree within the conformance suite's tolerance, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gateway.engine.forward.experts import ExpertProjection
from gateway.engine.forward.features import LatentAttention
from gateway.engine.forward.rotary import rotate_halves
from gateway.engine.kv.latent import latent_halves
from gateway.engine.linear.row_products import RowProducts

LatentAttend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(queries, key_half, value_half)``: write the rows' latents (as the pages' K and V
halves) and return the queries' attention over their sequences' latents ``[rows, heads,
width]``."""


@dataclass(frozen=True, slots=True)
class FoldedHeads:
    """One layer's ``kv_b_proj`` cut per head and laid out as the row products read weights
    (``[out, in]``, contiguous): ``key_up[h]`` takes a head's unrotated query into the latent
    (``W_k^T``: ``[rank, nope_dim]``), ``value_up[h]`` a head's weighted latent to its value
    (``W_v``: ``[value_dim, rank]``)."""

    key_up: tuple[ExpertProjection, ...]
    value_up: tuple[ExpertProjection, ...]

    @classmethod
    def of(cls, attn: Any, spec: LatentAttention, num_heads: int) -> FoldedHeads:
        weight = attn.kv_b_proj.weight.detach().view(num_heads, spec.nope_dim + spec.value_dim,
                                                     spec.rank)
        return cls(
            key_up=tuple(ExpertProjection(weight[h, :spec.nope_dim].T.contiguous())
                         for h in range(num_heads)),
            value_up=tuple(ExpertProjection(weight[h, spec.nope_dim:].contiguous())
                           for h in range(num_heads)))

    def weights(self) -> list[torch.Tensor]:
        """One weight of each shape its products take (the start-up search pads them)."""
        return [self.key_up[0].weight, self.value_up[0].weight]


def folded_weights(attn: Any, config: Any) -> list[torch.Tensor]:
    """One head's folded weights of a latent layer with ``config`` (transformers' names): the
    shapes ``FoldedHeads`` multiplies by, for the start-up search to pad."""
    nope, value = int(config.qk_nope_head_dim), int(config.v_head_dim)
    weight = attn.kv_b_proj.weight.detach()
    head = weight[:nope + value]
    return [head[:nope].T.contiguous(), head[nope:].contiguous()]


def latent_attention(attn: Any, spec: LatentAttention, folded: FoldedHeads,
                     normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     num_shared: int, products: RowProducts, *, interleaved: bool,
                     attend: LatentAttend) -> torch.Tensor:
    """The attention sublayer's output ``[rows, hidden]`` for the step's normed rows (the
    first ``num_shared`` in shared products): queries, the rows' latents written through
    ``attend``, the folded heads' attention, ``o_proj``.

    Args:
        interleaved: the rotary numbers are laid out in neighbouring pairs (DeepSeek-V3's
            ``rope_interleave``): they are taken apart into halves before the rotation, as
            transformers rotates them, so the cached rotary key is in halves either way.
    """
    project = products.project
    num_rows = normed.shape[0]
    if spec.query_rank is not None:
        queries = project(attn.q_b_proj, attn.q_a_layernorm(project(attn.q_a_proj, normed,
                                                                    num_shared)), num_shared)
    else:
        queries = project(attn.q_proj, normed, num_shared)
    queries = queries.view(num_rows, len(folded.key_up), spec.nope_dim + spec.rope_dim)
    query_nope, query_rope = torch.split(queries, [spec.nope_dim, spec.rope_dim], dim=-1)
    compressed = project(attn.kv_a_proj_with_mqa, normed, num_shared)
    latent, key_rope = torch.split(compressed, [spec.rank, spec.rope_dim], dim=-1)
    latent = attn.kv_a_layernorm(latent)
    key_rope = key_rope.unsqueeze(1)
    if interleaved:
        query_rope, key_rope = _halves(query_rope), _halves(key_rope)
    query_rope = rotate_halves(query_rope, cos, sin).to(queries.dtype)
    key_rope = rotate_halves(key_rope, cos, sin).to(queries.dtype)
    folded_queries = torch.stack(
        [project(weight, query_nope[:, h].contiguous(), num_shared)
         for h, weight in enumerate(folded.key_up)], dim=1)
    rows_latent = torch.cat([latent, key_rope[:, 0]], dim=-1)
    key_half, value_half = latent_halves(rows_latent)
    attended = attend(torch.cat([folded_queries, query_rope], dim=-1), key_half, value_half)
    weighted = attended[..., :spec.rank]
    values = torch.cat([project(weight, weighted[:, h].contiguous(), num_shared)
                        for h, weight in enumerate(folded.value_up)], dim=-1)
    out: torch.Tensor = project(attn.o_proj, values, num_shared)
    return out


def _halves(x: torch.Tensor) -> torch.Tensor:
    """Neighbouring pairs ``(x0, x1), (x2, x3)...`` laid out as halves ``(x0, x2...; x1,
    x3...)``: the form transformers' interleaved rotation returns."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
