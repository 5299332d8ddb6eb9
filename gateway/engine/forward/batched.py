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

from gateway.engine.attention.tiled import AttentionItem, SequenceAttention
from gateway.engine.forward.experts import expert_mlp, expert_weights
from gateway.engine.forward.features import NORM_PLACEMENTS, DecoderFeatures, LayerFeatures
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.kv.step_writes import StepWrites, join_rows
from gateway.engine.linear.row_products import RowProducts

ROPE_CHUNK = 4096
"""Rotary tables are computed in fixed chunks of positions (the same call for every request)."""


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
            problem = _norms_problem(layer, wanted, qk_widths)
            if problem is not None:
                raise UnsupportedModel(f"layer {index} {problem} ({features.family} layers)")
        self._features = features
        self._model = model
        self._attention = attention
        self._products = products
        self._num_heads = num_heads
        self._kv_heads = kv_heads
        self._head_dim = head_dim
        dtype = model.model.embed_tokens.weight.dtype
        # One rotation per kind the layers use, side by side: [positions, kinds * head_dim]
        # (one kind for most models: the tables every step reads, as they always were).
        self._rope_kinds = features.rope_kinds
        self._cos = torch.empty(0, len(self._rope_kinds) * self._head_dim, dtype=dtype)
        self._sin = torch.empty(0, len(self._rope_kinds) * self._head_dim, dtype=dtype)

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
        model = self._model.model
        device = model.embed_tokens.weight.device
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
            items = []
            for rows, (start, end) in zip(batch, spans, strict=True):
                seq = rows.sequence
                if writes is None:
                    seq.write(index, k[start:end].transpose(0, 1),
                              v[start:end].transpose(0, 1))
                items.append(AttentionItem(q[start:end], seq.layer(index), positions[start:end],
                                           is_decode=rows.is_decode, first_position=seq.length,
                                           window=window, scale=scale))
            return join_rows(self._attention.attend(items), spans, q)

        with torch.inference_mode():
            hidden = self.run_layers(ids, cos, sin, num_shared, attend)
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
                   num_shared: int, attend: LayerAttention) -> torch.Tensor:
        """The hidden states ``[rows, hidden]`` after every layer, for the step's rows:
        token ``ids``, rotary ``cos``/``sin`` of their positions, the first ``num_shared`` rows
        in the shared product, each layer's attention (and K/V writes) done by ``attend``.
        The one walk of the weights every forward of this model takes (``forward`` here and
        the captured steps of ``gateway.engine.forward.captured_steps``)."""
        hidden: torch.Tensor = self._model.model.embed_tokens(ids)
        for index, layer in enumerate(self._model.model.layers):
            hidden = self._layer(index, layer, self._features.layers[index], hidden, cos, sin,
                                 num_shared, attend)
        return hidden

    def logits(self, picked: torch.Tensor, num_logit_rows: int) -> torch.Tensor:
        """The float32 logits of the hidden rows ``picked`` (padding rows zero), the first
        ``num_logit_rows`` in the shared product. The final norm sees the padded rows, as
        every layer's norms do."""
        normed = self._model.model.norm(picked)
        return self._products.project(self._model.lm_head, normed, num_logit_rows).float()

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

    def rope_tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary cos and sin ``[>= num_positions, kinds * head_dim]`` (CPU) every step
        reads: one ``head_dim`` slice per rotation kind (``DecoderFeatures.rope_kinds``)."""
        self._grow_rope(num_positions)
        return self._cos, self._sin

    def _layer(self, index: int, layer: Any, features: LayerFeatures, hidden: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, num_shared: int,
               attend: LayerAttention) -> torch.Tensor:
        attn = layer.self_attn
        norms = features.norms  # where the norms sit (LayerFeatures.norms)
        normed = hidden if norms == "post" else layer.input_layernorm(hidden)
        num_rows = hidden.shape[0]
        project = self._products.project
        q = project(attn.q_proj, normed, num_shared)
        k = project(attn.k_proj, normed, num_shared)
        v = project(attn.v_proj, normed, num_shared)
        if features.qk_projection_norm:  # every head at once, before the split (OLMo 2)
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        q = q.view(num_rows, self._num_heads, self._head_dim)
        k = k.view(num_rows, self._kv_heads, self._head_dim)
        v = v.view(num_rows, self._kv_heads, self._head_dim)
        if features.qk_norm:  # per head, over head_dim, before the rotation (as Qwen3 does)
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        if len(self._rope_kinds) > 1:  # this layer's kind of rotation
            at = self._rope_kinds.index(features.rope) * self._head_dim
            cos, sin = cos[:, at:at + self._head_dim], sin[:, at:at + self._head_dim]
        if features.rotary:
            q = _rotate(q, cos, sin)
            k = _rotate(k, cos, sin)
        attended = attend(index, q, k, v)
        attention_out = project(attn.o_proj, attended.reshape(num_rows, -1), num_shared)
        if norms == "pre":
            hidden = hidden + attention_out
            normed = layer.post_attention_layernorm(hidden)
        else:  # the attention's output is normed before the residual add
            hidden = hidden + layer.post_attention_layernorm(attention_out)
            normed = hidden if norms == "post" else layer.pre_feedforward_layernorm(hidden)
        mlp_out = self._mlp(layer.mlp, features, normed, num_shared)
        if norms != "pre":
            mlp_out = layer.post_feedforward_layernorm(mlp_out)
        out: torch.Tensor = hidden + mlp_out
        return out

    def _mlp(self, mlp: Any, features: LayerFeatures, normed: torch.Tensor,
             num_shared: int) -> torch.Tensor:
        """The layer's MLP of its normed rows: dense and gated, or a mixture of experts."""
        if features.experts is not None:
            return expert_mlp(mlp, features.experts, normed, num_shared, self._products)
        project = self._products.project
        gated = (mlp.act_fn(project(mlp.gate_proj, normed, num_shared))
                 * project(mlp.up_proj, normed, num_shared))
        out: torch.Tensor = project(mlp.down_proj, gated, num_shared)
        return out

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[rows, head_dim]`` for ``positions``, from tables built in fixed chunks."""
        self._grow_rope(int(positions.max()) + 1)
        return self._cos[positions], self._sin[positions]

    def _grow_rope(self, num_positions: int) -> None:
        """Extend the rotary tables, in whole ``ROPE_CHUNK``s, to cover ``num_positions``."""
        needed = -(-max(1, num_positions) // ROPE_CHUNK) * ROPE_CHUNK
        if self._cos.shape[0] < needed:
            rotary = self._model.model.rotary_emb
            weight = self._model.model.embed_tokens.weight
            cos_parts, sin_parts = [self._cos], [self._sin]
            for start in range(self._cos.shape[0], needed, ROPE_CHUNK):
                ids = torch.arange(start, start + ROPE_CHUNK, device=weight.device).unsqueeze(0)
                with torch.inference_mode():
                    kinds = [rotary(weight[:1].unsqueeze(0), ids) if kind is None
                             else rotary(weight[:1].unsqueeze(0), ids, kind)
                             for kind in self._rope_kinds]
                cos_parts.append(torch.cat([cos[0] for cos, _ in kinds], dim=-1).cpu())
                sin_parts.append(torch.cat([sin[0] for _, sin in kinds], dim=-1).cpu())
            self._cos = torch.cat(cos_parts)
            self._sin = torch.cat(sin_parts)


def walked_norms(features: LayerFeatures) -> tuple[tuple[str, str], ...]:
    """The norms ``BatchedForward._layer`` applies to a layer with ``features``, as (where,
    name): "layer" for the decoder layer's own modules, "attention" for ``self_attn``'s."""
    placed = NORM_PLACEMENTS[features.norms]
    qk = (("q_norm", "k_norm") if features.qk_norm or features.qk_projection_norm else ())
    return (tuple(("layer", name) for name in placed)
            + tuple(("attention", name) for name in qk))


def _norms_problem(layer: Any, features: LayerFeatures,
                   qk_widths: tuple[int, int]) -> str | None:
    """Why the forward cannot walk ``layer``'s norms as ``features`` say, or None: a norm it
    applies is missing, or a norm the layer has is not one it applies (a feature the family did
    not describe: walking past it would be silently wrong), or its q and k norms are not
    ``qk_widths`` wide (per head for Qwen3's, over the projection for OLMo 2's)."""
    modules = {"layer": layer, "attention": layer.self_attn}
    wanted = walked_norms(features)
    missing = [name for where, name in wanted if not hasattr(modules[where], name)]
    if missing:
        return f"has no {' and '.join(missing)} to apply"
    present = {(where, name) for where, module in modules.items()
               for name, _ in module.named_children() if name.endswith("norm")}
    unwalked = sorted(name for _, name in present - set(wanted))
    if unwalked:
        return f"has {', '.join(unwalked)}, which its features do not apply"
    if features.qk_norm or features.qk_projection_norm:
        for name, width in zip(("q_norm", "k_norm"), qk_widths, strict=True):
            weight = getattr(getattr(modules["attention"], name), "weight", None)
            if weight is not None and weight.shape[-1] != width:
                return (f"has a {name} over {weight.shape[-1]} numbers, not "
                        f"{'per head' if features.qk_norm else 'over the projection'} ({width})")
    return None


def projection_weights(model: Any) -> list[torch.Tensor]:
    """One weight of every shape the shared products multiply by: each layer's attention
    projections and its MLP's (a dense one's, or one expert's and the router's), a shape once."""
    by_shape: dict[tuple[int, ...], torch.Tensor] = {}
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        weights = [module.weight for module in (attention.q_proj, attention.k_proj,
                                                attention.v_proj, attention.o_proj)]
        if hasattr(mlp, "experts"):
            weights += expert_weights(mlp)
        else:
            weights += [module.weight for module in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
        for weight in weights:
            by_shape.setdefault(tuple(weight.shape), weight)
    return list(by_shape.values())


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[rows, heads, d]`` (Llama's rotate-half form)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
