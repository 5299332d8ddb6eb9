"""One batched forward over the new tokens of many sequences, each token's numbers its own.

Why not call the transformers model: its forward takes one padded batch, builds masks and runs
SDPA, so a row's bits depend on the batch, the chunking and the padding. This module walks the
same weights (a Llama-shaped ``*ForCausalLM``: embeddings, RMSNorm, rotary positions, q/k/v/o
projections, gated MLP; what a family's layers do beyond that, such as Qwen3's per-head q/k
norms, its ``DecoderFeatures`` say) with the rows of every sequence side by side for the
row-wise parts (norms, projections, MLP) and ``SequenceAttention`` for each sequence over its
own KV buffers. Everything row-wise keeps a row's bits whatever else shares the product once there
are enough rows, so each forward's rows are padded to such a count (docs/design.md, "Parity").

Which kernel multiplies the rows, how many rows it needs, and whether decode rows (a sampled
token fed back) join the shared product is ``gateway.engine.linear.row_products``' choice, made
once at start-up: on a CPU with oneDNN every row of the step is in one product of at least 2 rows,
so a
decode row's numbers are a prefill's and an answer's blocks are stored as decoded; with BLAS
each decode row is a matrix-vector product of its own (a lone row padded to MKL's 4 costs more),
whose numbers are not a prefill's (``gateway.engine.parity.probe`` reports which holds). Logits rows
follow decode rows.

It only touches the modules' weights and forward methods, never transformers' APIs
(``gateway.engine.models.transformers_api`` stays the only importer of ``transformers``; the modules
are ``gateway.engine.models.llama_modules``' where the checkpoint is read without it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from gateway.engine.attention.softcap import soft_cap_
from gateway.engine.attention.tiled import AttentionItem, SequenceAttention
from gateway.engine.forward.deepseek_experts import group_limited_mlp, group_limited_weights
from gateway.engine.forward.experts import expert_mlp, expert_weights
from gateway.engine.forward.features import (
    ClampedSwigluRouting,
    DecoderFeatures,
    GroupLimitedRouting,
    LayerFeatures,
)
from gateway.engine.forward.gpt_oss_experts import clamped_swiglu_mlp, clamped_swiglu_weights
from gateway.engine.forward.latent_attention import FoldedHeads, folded_weights, latent_attention
from gateway.engine.forward.layer_modules import layer_problem
from gateway.engine.forward.recurrent.lanes import by_row
from gateway.engine.forward.recurrent_step import RecurrentLayers
from gateway.engine.forward.rotary import partially, rotate_halves, rotate_pairs
from gateway.engine.kv.latent import LatentKV
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.kv.step_writes import StepWrites, join_rows
from gateway.engine.linear.joined_panels import JOINED_GATE_UP, JOINED_QKV, joined
from gateway.engine.linear.row_products import RowProducts
from tiers.payload import KVLayout

ROPE_CHUNK = 4096
"""Rotary tables are computed in fixed chunks of positions (the same call for every request)."""


ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "q_a_proj", "q_b_proj",
                         "kv_a_proj_with_mqa", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
"""The projections a layer may have, separate or fused, in the order the products search them."""


class UnsupportedModel(ValueError):
    """The model is not one this forward knows how to walk (no ``DecoderFeatures`` for it, or
    features that do not match its modules)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SequenceRows:
    """The new tokens of one sequence in a step.

    Attributes:
        sequence: its KV buffers; the tokens continue it (their first position is its length).
        tokens: the token ids, ``[n]``.
        wants_logits: whether the step returns the logits of the last token.
        is_decode: the one token sampled last step, fed back: its row is a product of its own
            (fast alone, and the same whatever runs beside it), its K/V not the prefill's.
    """

    sequence: KVSequence
    tokens: torch.Tensor
    wants_logits: bool
    is_decode: bool = False


LayerAttention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attend(layer, q, k, v)``: write one layer's K/V of the step's rows where they belong and
return the rows' attention ``[rows, heads, head_dim]`` (zero for padding rows)."""

LayerMix = Callable[[int, Any, torch.Tensor, int], torch.Tensor]
"""``mix(layer, module, normed, num_shared)``: a recurrent layer's output ``[rows, hidden]`` for
the step's normed rows (zero for padding rows), each sequence from its own state."""


class StepForward(Protocol):
    """Runs one step's rows: writes their K/V into their sequences, returns wanted logits."""

    def forward(self, batch: Sequence[SequenceRows]) -> list[torch.Tensor | None]:
        """Per entry of ``batch``, the float32 logits of its last token, or None."""
        ...


class BatchedForward:
    """Runs the rows of several sequences through a Llama-shaped model in one pass.

    Args:
        model: a loaded ``*ForCausalLM`` module tree (eval mode) with transformers' attribute
            names (``model.layers[i].self_attn.q_proj``...).
        attention: the per-sequence attention (one implementation per device kind).
        products: how rows are multiplied by the weights (found on the machine at start-up:
            ``gateway.engine.parity.route_search``).
        features: what its layers do beyond Llama's (its family's description,
            ``LoadedModel.features``); None: the module tree's own ``features`` (the trees
            ``gateway.engine.models`` builds carry theirs).

    Raises:
        UnsupportedModel: no features are given or carried, or they do not fit the modules.
    """

    def __init__(self, model: Any, attention: SequenceAttention, products: RowProducts,
                 features: DecoderFeatures | None = None) -> None:
        features = features if features is not None else getattr(model, "features", None)
        if not isinstance(features, DecoderFeatures):
            raise UnsupportedModel(
                f"{type(model).__name__} carries no DecoderFeatures: load it through "
                "gateway.engine.models.loading, whose families describe what each layer does")
        layers = model.model.layers
        if len(features.layers) != len(layers):
            raise UnsupportedModel(f"{features.family} describes {len(features.layers)} layers, "
                                   f"the model has {len(layers)}")
        for index, (layer, wanted) in enumerate(zip(layers, features.layers, strict=True)):
            experts = getattr(layer.mlp, "experts", None)
            if (wanted.experts is not None) != (experts is not None) or (
                    experts is not None and not all(
                        hasattr(experts, name) for name in ("gate_up_proj", "down_proj"))):
                raise UnsupportedModel(f"layer {index}'s MLP is not the "
                                       f"{'mixture of experts' if wanted.experts else 'dense MLP'} "
                                       f"{features.family} describes")
        config = model.config
        head_dim = int(getattr(config, "head_dim", None)
                       or config.hidden_size // config.num_attention_heads)
        num_heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
        for index, (layer, wanted) in enumerate(zip(layers, features.layers, strict=True)):
            qk_widths = ((head_dim, head_dim) if wanted.qk_norm
                         else (num_heads * head_dim, kv_heads * head_dim))
            problem = layer_problem(layer, wanted, qk_widths)
            if problem is not None:
                raise UnsupportedModel(f"layer {index} {problem} ({features.family} layers)")
        self._features = features
        # Each layer's attention sinks (gpt-oss), the tensors every step's items carry.
        self._sinks = tuple(layer.self_attn.sinks if wanted.sinks else None
                            for layer, wanted in zip(layers, features.layers, strict=True))
        # Each latent layer's kv_b_proj cut per head, folded into queries and outputs.
        self._folded = tuple(
            FoldedHeads.of(layer.self_attn, wanted.latent, num_heads)
            if wanted.latent is not None else None
            for layer, wanted in zip(layers, features.layers, strict=True))
        self._model = model
        self._attention = attention
        self._products = products
        self._num_heads = num_heads
        self._kv_heads = kv_heads
        self._head_dim = head_dim
        self._qkv_widths = (num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        dtype = model.model.embed_tokens.weight.dtype
        try:
            self._recurrent = RecurrentLayers.of(config, features.mixers, KVLayout(
                num_layers=len(layers), kv_heads=kv_heads, head_dim=head_dim, dtype=dtype),
                beside_attention=features.mixers_beside_attention)
        except ValueError as exc:
            raise UnsupportedModel(f"{features.family}: {exc}") from exc
        # One rotation per kind the layers use, side by side: [positions, sum of the kinds'
        # rotary widths] (one kind for most models: the tables every step reads).
        self._rope_kinds = features.rope_kinds
        self._cos = torch.empty(0, len(self._rope_kinds) * self._head_dim, dtype=dtype)
        self._sin = torch.empty(0, len(self._rope_kinds) * self._head_dim, dtype=dtype)
        # (start, width) of each kind's columns, set by the first chunk built (_grow_rope).
        self._rope_spans = _spans([self._head_dim] * len(self._rope_kinds))

    @property
    def device(self) -> torch.device:
        """Where the model (and so every sequence's KV buffers) lives."""
        device: torch.device = self._model.model.embed_tokens.weight.device
        return device

    @property
    def num_layers(self) -> int:
        return len(self._model.model.layers)

    def forward(self, batch: Sequence[SequenceRows]) -> list[torch.Tensor | None]:
        """Run one step: write every row's K/V into its sequence and return the wanted logits.

        Returns:
            Per entry of ``batch``, the float32 logits ``[vocab]`` of its last token, or None.

        Raises:
            ValueError: an entry has no tokens, or its sequence cannot hold them.
        """
        if not batch:
            return []
        lengths = [int(rows.tokens.numel()) for rows in batch]
        if min(lengths) < 1:
            raise ValueError("every sequence in a step needs at least one token")
        if any(rows.is_decode and n != 1 for rows, n in zip(batch, lengths, strict=True)):
            raise ValueError("a decode entry feeds back exactly one token")
        for rows, n in zip(batch, lengths, strict=True):
            if rows.sequence.length + n > rows.sequence.capacity:
                raise ValueError(f"{n} tokens do not fit a sequence of {rows.sequence.length}/"
                                 f"{rows.sequence.capacity}")
        device = self.device
        # Rows: every prefill entry's tokens, then (when decode rows share the product) every
        # decode entry's, padding up to a row count that keeps their bits, then (otherwise) one
        # row per decode entry, each a product of its own.
        products = self._products
        spans: list[tuple[int, int]] = [(0, 0)] * len(batch)
        id_parts: list[torch.Tensor] = []
        position_parts: list[torch.Tensor] = []
        offset = num_shared = 0
        groups = ((False, True),) if products.shares_decode_rows else ((False,), (True,))
        for index, group in enumerate(groups):
            for i, (rows, n) in enumerate(zip(batch, lengths, strict=True)):
                if rows.is_decode in group:
                    spans[i] = (offset, offset + n)
                    offset += n
                    id_parts.append(rows.tokens.reshape(-1).to(device="cpu", dtype=torch.long))
                    position_parts.append(torch.arange(rows.sequence.length,
                                                       rows.sequence.length + n))
            if index == 0:
                num_pad = products.padding.rows_for(offset) - offset
                id_parts.append(torch.zeros(num_pad, dtype=torch.long))
                position_parts.append(torch.zeros(num_pad, dtype=torch.long))
                offset += num_pad
                num_shared = offset
        ids = torch.cat(id_parts).to(device)
        positions = torch.cat(position_parts)
        cos, sin = self._rope(positions)
        cos, sin = cos.to(device), sin.to(device)
        positions = positions.to(device)
        writes = StepWrites.claim([rows.sequence for rows in batch], spans, device)
        # Pages a host-tier hit may still be filling, layer by layer (tiers.layer_arrivals).
        pools = list({id(rows.sequence.pool): rows.sequence.pool for rows in batch}.values())

        def attend(index: int, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> torch.Tensor:
            for pool in pools:
                pool.await_layer(index)
            if writes is not None:
                writes.write(index, k, v)
            layer_features = self._features.layers[index]
            window, scale = layer_features.window, layer_features.attention_scale
            softcap = layer_features.logit_softcap
            latent = layer_features.latent is not None
            items = []
            for rows, (start, end) in zip(batch, spans, strict=True):
                seq = rows.sequence
                if writes is None:
                    seq.write(index, k[start:end].transpose(0, 1),
                              v[start:end].transpose(0, 1))
                pages = seq.layer(index)
                items.append(AttentionItem(q[start:end], LatentKV(pages) if latent else pages,
                                           positions[start:end],
                                           is_decode=rows.is_decode, first_position=seq.length,
                                           window=window, scale=scale, softcap=softcap,
                                           sinks=self._sinks[index]))
            return join_rows(self._attention.attend(items), spans, q)

        def mix(index: int, module: Any, normed: torch.Tensor, num_shared: int) -> torch.Tensor:
            # The layers its state lies in (its own, and extra ones after the model's).
            first = batch[0].sequence.pool
            home = self._recurrent.written_layers(index, first.page_tokens,
                                                  first.layout.num_layers)
            for pool in pools:
                for layer in home:
                    pool.await_layer(layer)
            # Those layers' K/V slots of the step's positions hold nothing but the states kept
            # at block ends: zeros first, never what a page held before.
            zeros = normed.new_zeros(normed.shape[0], self._kv_heads, self._head_dim)
            for layer in home:
                if writes is not None:
                    writes.write(layer, zeros, zeros)
                else:
                    for rows, (start, end) in zip(batch, spans, strict=True):
                        empty = zeros[start:end].transpose(0, 1)
                        rows.sequence.write(layer, empty, empty)
            return self._recurrent.mix(
                index, module, normed, [rows.sequence for rows in batch],
                spans, self._products, num_shared)

        with torch.inference_mode():
            hidden = self.run_layers(ids, cos, sin, num_shared, attend, mix)
            for pool in pools:
                pool.await_all()  # what comes after the step reads every page as it is
            for rows, n in zip(batch, lengths, strict=True):
                rows.sequence.advance(n)
            wanted = [end - 1 for (_, end), rows in zip(spans, batch, strict=True)
                      if rows.wants_logits]
            if not wanted:
                return [None] * len(batch)
            picked = hidden[torch.tensor(wanted, device=device)]
            num_logit_rows = 0
            if products.shares_decode_rows:
                num_logit_rows = products.padding.rows_for(len(wanted))
                picked = torch.cat([picked, picked.new_zeros(num_logit_rows - len(wanted),
                                                             picked.shape[1])])
            logits = self.logits(picked, num_logit_rows)
        out: list[torch.Tensor | None] = []
        row = 0
        for rows in batch:
            if rows.wants_logits:
                out.append(logits[row].clone())
                row += 1
            else:
                out.append(None)
        return out

    def run_layers(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   num_shared: int, attend: LayerAttention,
                   mix: LayerMix | None = None) -> torch.Tensor:
        """The hidden states ``[rows, hidden]`` after every layer, for the step's rows:
        token ``ids``, rotary ``cos``/``sin`` of their positions, the first ``num_shared`` rows
        in the shared product, each layer's attention (and K/V writes) done by ``attend``, each
        recurrent layer's mixing by ``mix`` (needed where the features name one).
        The one walk of the weights every forward of this model takes (``forward`` here and
        the captured steps of ``gateway.engine.forward.captured_steps``)."""
        hidden: torch.Tensor = self._model.model.embed_tokens(ids)
        if self._features.embedding_multiplier is not None:  # Granite's
            hidden = hidden * self._features.embedding_multiplier
        for index, layer in enumerate(self._model.model.layers):
            hidden = self._layer(index, layer, self._features.layers[index], hidden, cos, sin,
                                 num_shared, attend, mix)
        return hidden

    def logits(self, picked: torch.Tensor, num_logit_rows: int) -> torch.Tensor:
        """The float32 logits of the hidden rows ``picked`` (padding rows zero), the first
        ``num_logit_rows`` in the shared product, soft-capped where the features say so
        (``final_logit_softcap``, in float32). The final norm sees the padded rows, as every
        layer's norms do."""
        normed = self._model.model.norm(picked)
        logits = self._products.project(self._model.lm_head, normed, num_logit_rows)
        if self._features.logits_divisor is not None:  # Granite's logits_scaling
            logits = logits / self._features.logits_divisor
        if self._features.logits_multiplier is not None:  # Falcon-H1's lm_head_multiplier
            logits = logits * self._features.logits_multiplier
        return soft_cap_(logits.float(), self._features.final_logit_softcap)

    @property
    def products(self) -> RowProducts:
        return self._products

    @property
    def features(self) -> DecoderFeatures:
        return self._features

    @property
    def attention(self) -> SequenceAttention:
        return self._attention

    @property
    def head_dim(self) -> int:
        return self._head_dim

    def layer_sinks(self, index: int) -> torch.Tensor | None:
        """Layer ``index``'s attention sinks ``[heads]`` (``LayerFeatures.sinks``), or None."""
        return self._sinks[index]

    def rope_tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary cos and sin ``[>= num_positions, widths]`` (CPU) every step reads: one
        slice per rotation kind (``DecoderFeatures.rope_kinds``), as wide as its rotary
        embedding's tables (a head, or its rotated part)."""
        self._grow_rope(num_positions)
        return self._cos, self._sin

    def _layer(self, index: int, layer: Any, features: LayerFeatures, hidden: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, num_shared: int,
               attend: LayerAttention, mix: LayerMix | None) -> torch.Tensor:
        norms = features.norms
        normed = _norm(layer, norms.before_attention, hidden)
        if features.mixer is not None:
            if mix is None:
                raise UnsupportedModel(f"layer {index} is recurrent ({features.mixer}): this "
                                       "walk of the layers mixes none")
            out = mix(index, layer.mixer, normed, num_shared)
            beside = features.parallel
            if beside is not None:  # and an attention over the same input (Falcon-H1)
                attended = self._attention_sublayer(index, layer, features,
                                                    normed * beside.attention_in, cos, sin,
                                                    num_shared, attend)
                out = out * beside.mixer_out + attended * beside.attention_out
            return self._after_mixing(layer, features, hidden, out, num_shared)
        out = self._attention_sublayer(index, layer, features, normed, cos, sin, num_shared,
                                       attend)
        return self._after_mixing(layer, features, hidden, out, num_shared)

    def _attention_sublayer(self, index: int, layer: Any, features: LayerFeatures,
                            normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            num_shared: int, attend: LayerAttention) -> torch.Tensor:
        """The layer's attention sublayer's output for its ``normed`` rows."""
        if len(self._rope_kinds) > 1:  # this layer's kind of rotation, its own width
            at, width = self._rope_spans[self._rope_kinds.index(features.rope)]
            cos, sin = cos[:, at:at + width], sin[:, at:at + width]
        folded = self._folded[index]
        if features.latent is not None and folded is not None:
            out = latent_attention(
                layer.self_attn, features.latent, folded, normed, cos, sin, num_shared,
                self._products, interleaved=features.rotary_interleaved,
                attend=lambda q, k, v: attend(index, q, k, v))
        else:
            out = self._per_head_attention(index, layer.self_attn, features, normed, cos, sin,
                                           num_shared, attend)
        return out

    def _after_mixing(self, layer: Any, features: LayerFeatures, hidden: torch.Tensor,
                      out: torch.Tensor, num_shared: int) -> torch.Tensor:
        """The layer's residual after its attention's (or recurrent layer's) output ``out``:
        that output added, then the MLP's."""
        norms = features.norms
        scale = features.residual_multiplier
        out = _norm(layer, norms.after_attention, out)
        hidden = hidden + (out if scale is None else out * scale)
        normed = _norm(layer, norms.before_mlp, hidden)
        out = _norm(layer, norms.after_mlp, self._mlp(layer.mlp, features, normed, num_shared))
        residual: torch.Tensor = hidden + (out if scale is None else out * scale)
        return residual

    def _per_head_attention(self, index: int, attn: Any, features: LayerFeatures,
                            normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            num_shared: int, attend: LayerAttention) -> torch.Tensor:
        """The attention sublayer's output (before any norm after it) of per-head q, k, v."""
        num_rows = normed.shape[0]
        project = self._products.project
        if features.fused_qkv:  # one product, its columns q | k | v (Phi-3)
            qkv = project(attn.qkv_proj, normed, num_shared)
            q, k, v = (part.contiguous()
                       for part in torch.split(qkv, list(self._qkv_widths), dim=-1))
        elif (qkv_joined := joined(attn, JOINED_QKV)) is not None:  # panels: one call
            q, k, v = qkv_joined.split(project(qkv_joined, normed, num_shared))
        else:
            q = project(attn.q_proj, normed, num_shared)
            k = project(attn.k_proj, normed, num_shared)
            v = project(attn.v_proj, normed, num_shared)
        if features.qk_projection_norm:  # every head at once, before the split (OLMo 2)
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        if features.key_multiplier is not None:  # Falcon-H1's, before any rotation
            k = k * features.key_multiplier
        gate = None
        if features.output_gate:  # each head's query, then its gate (Qwen3.5)
            q, gate = q.view(num_rows, self._num_heads, 2 * self._head_dim).chunk(2, dim=-1)
            gate = gate.reshape(num_rows, -1)
        q = q.reshape(num_rows, self._num_heads, self._head_dim)
        k = k.view(num_rows, self._kv_heads, self._head_dim)
        v = v.view(num_rows, self._kv_heads, self._head_dim)
        if features.qk_norm:  # per head, over head_dim, before the rotation (as Qwen3 does)
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        if features.rotary:
            rotate = rotate_pairs if features.rotary_interleaved else rotate_halves
            q = partially(rotate, q, cos, sin)
            k = partially(rotate, k, cos, sin)
        attended = attend(index, q, k, v).reshape(num_rows, -1)
        if gate is not None:
            attended = attended * by_row(torch.sigmoid, gate)
        out: torch.Tensor = project(attn.o_proj, attended, num_shared)
        return out

    def _mlp(self, mlp: Any, features: LayerFeatures, normed: torch.Tensor,
             num_shared: int) -> torch.Tensor:
        """The layer's MLP of its normed rows: dense and gated (its gate and up one product or
        two), or a mixture of experts."""
        if isinstance(features.experts, ClampedSwigluRouting):  # gpt-oss's
            return clamped_swiglu_mlp(mlp, features.experts, normed, num_shared, self._products)
        if isinstance(features.experts, GroupLimitedRouting):  # DeepSeek-V3's
            return group_limited_mlp(mlp, features.experts, normed, num_shared, self._products)
        if features.experts is not None:
            return expert_mlp(mlp, features.experts, normed, num_shared, self._products)
        project = self._products.project
        scales = features.mlp_multipliers  # Falcon-H1's (gate, down)
        if features.fused_gate_up:  # one product, its columns gate | up (Phi-3, GLM-4)
            gate, up = project(mlp.gate_up_proj, normed, num_shared).chunk(2, dim=-1)
            gate = gate if scales is None else gate * scales[0]
            gated = up * mlp.activation_fn(gate)
        elif (gate_up := joined(mlp, JOINED_GATE_UP)) is not None:  # panels: one call
            gate, up = gate_up.split(project(gate_up, normed, num_shared))
            gate = gate if scales is None else gate * scales[0]
            gated = mlp.act_fn(gate) * up
        else:
            gate = project(mlp.gate_proj, normed, num_shared)
            gate = gate if scales is None else gate * scales[0]
            gated = mlp.act_fn(gate) * project(mlp.up_proj, normed, num_shared)
        out: torch.Tensor = project(mlp.down_proj, gated, num_shared)
        return out if scales is None else out * scales[1]

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[rows, head_dim]`` for ``positions``, from tables built in fixed chunks."""
        self._grow_rope(int(positions.max()) + 1)
        return self._cos[positions], self._sin[positions]

    def _grow_rope(self, num_positions: int) -> None:
        """Extend the rotary tables, in whole ``ROPE_CHUNK``s, to cover ``num_positions``."""
        needed = -(-max(1, num_positions) // ROPE_CHUNK) * ROPE_CHUNK
        if self._cos.shape[0] < needed and self._model.model.rotary_emb is None:
            # No layer rotates (Granite 4.0-H's NoPE): tables of no width, never read.
            self._cos = torch.empty(needed, 0, dtype=self._cos.dtype)
            self._sin = torch.empty(needed, 0, dtype=self._sin.dtype)
            self._rope_spans = _spans([0] * len(self._rope_kinds))
        if self._cos.shape[0] < needed:
            rotary = self._model.model.rotary_emb
            # What the rotary embedding reads of its input: the dtype and device (the
            # embeddings' table may be packed with a tied head: no plain rows to take).
            table = self._model.model.embed_tokens.weight
            weight = torch.empty(1, 1, dtype=table.dtype, device=table.device)
            # The first chunk sets the tables' width: each kind's a head's, or fewer where
            # it rotates only part of each head (GLM-4, Phi-3 partial), side by side.
            cos_parts = [self._cos] if self._cos.shape[0] else []
            sin_parts = [self._sin] if self._sin.shape[0] else []
            for start in range(self._cos.shape[0], needed, ROPE_CHUNK):
                ids = torch.arange(start, start + ROPE_CHUNK, device=weight.device).unsqueeze(0)
                with torch.inference_mode():
                    kinds = [rotary(weight[:1].unsqueeze(0), ids) if kind is None
                             else rotary(weight[:1].unsqueeze(0), ids, kind)
                             for kind in self._rope_kinds]
                if self._features.rotary_frequencies_once:  # each frequency twice, as Llama's
                    kinds = [(torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1))
                             for cos, sin in kinds]
                self._rope_spans = _spans([cos.shape[-1] for cos, _ in kinds])
                cos_parts.append(torch.cat([cos[0] for cos, _ in kinds], dim=-1).cpu())
                sin_parts.append(torch.cat([sin[0] for _, sin in kinds], dim=-1).cpu())
            self._cos = torch.cat(cos_parts)
            self._sin = torch.cat(sin_parts)


def projection_weights(model: Any) -> list[torch.Tensor]:
    """One weight of every shape the shared products multiply by: each layer's attention
    projections and its MLP's, separate or fused (``qkv_proj``, ``gate_up_proj``), or one
    expert's and the router's, a shape once (layers may differ: dense and expert MLPs)."""
    by_shape: dict[tuple[int, ...], torch.Tensor] = {}
    for layer in model.model.layers:
        attention, mlp = getattr(layer, "self_attn", None), layer.mlp
        weights = [getattr(attention, name).weight for name in ATTENTION_PROJECTIONS
                   if getattr(attention, name, None) is not None]
        mixer = getattr(layer, "mixer", None)
        if mixer is not None:  # a recurrent layer (beside an attention or not): its products
            weights += [module.weight for module in mixer.modules()
                        if isinstance(module, torch.nn.Linear)]
        if attention is not None and hasattr(attention, "kv_b_proj"):  # latent attention's
            weights += folded_weights(attention, model.config)
        if hasattr(mlp, "router"):  # gpt-oss's experts, stored [in, out]
            weights += clamped_swiglu_weights(mlp)
        elif hasattr(mlp, "shared_experts"):  # DeepSeek-V3's
            weights += group_limited_weights(mlp)
        elif hasattr(mlp, "experts"):
            weights += expert_weights(mlp)
        else:
            weights += [getattr(mlp, name).weight
                        for name in MLP_PROJECTIONS if hasattr(mlp, name)]
        for weight in weights:
            by_shape.setdefault(tuple(weight.shape), weight)
    return list(by_shape.values())


def _spans(widths: list[int]) -> tuple[tuple[int, int], ...]:
    """(start, width) of tables of ``widths`` laid side by side."""
    starts = [sum(widths[:i]) for i in range(len(widths))]
    return tuple(zip(starts, widths, strict=True))


def _norm(layer: Any, name: str | None, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` through the layer's norm ``name`` (None: no norm there, the rows as they are)."""
    if name is None:
        return rows
    out: torch.Tensor = getattr(layer, name)(rows)
    return out
