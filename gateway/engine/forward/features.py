"""What the batched forward must know of a model's layers beyond Llama's walk: the features a
family's layers use, as one record the family fills in and the forward reads.

Why a record and not a look at the modules: the same attribute can mean different arithmetic in
different families (Qwen3's ``q_norm`` normalises each head, OLMo 2's the whole projection), so
the forward never guesses from what a module tree happens to hold. A family
(``gateway.engine.models.families``) reads its config and says what each layer does; the forward
walks exactly that, and a feature it does not know is refused before any of it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

NormPlacement = Literal["pre", "sandwich", "post"]
"""Where a layer normalises around its attention and its MLP (``LayerFeatures.norms``)."""

NORM_PLACEMENTS: dict[str, tuple[str, ...]] = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
}
"""Where a layer's norms sit (``LayerFeatures.norms``), and the modules each placement reads."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertRouting:
    """A layer whose MLP is a sparse mixture of experts (Qwen3-MoE): ``mlp.gate`` (a router
    whose ``weight`` is ``[experts, hidden]``) scores each token, its ``top_k`` experts' gated MLPs
    (``mlp.experts.gate_up_proj`` ``[experts, 2 * inner, hidden]`` and ``down_proj``
    ``[experts, hidden, inner]``, ``mlp.experts.act_fn``) run on it, and their outputs, weighted
    by the router's softmax (renormalised over the top ``top_k`` where ``normalize``), are
    summed in expert order.

    Attributes:
        top_k: experts per token.
        normalize: the top-k weights are divided by their sum (``norm_topk_prob``).
    """

    top_k: int
    normalize: bool

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"a token is routed to at least one expert, not {self.top_k}")


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerFeatures:
    """What one decoder layer does beyond Llama's (every field off: a Llama layer).

    Attributes:
        qk_norm: q and k are normalised per head (an RMSNorm over the head dimension,
            ``self_attn.q_norm`` and ``self_attn.k_norm``) before their rotation: Qwen3.
        window: a query at position p attends the keys at positions p - window < k <= p only
            (a sliding window, as transformers' masks have it); None: every key up to p.
            Mistral, Qwen3 with ``use_sliding_window``, and the local layers of Gemma 2/3.
        experts: the MLP is a sparse mixture of experts routed so (``ExpertRouting``); None: a
            dense gated MLP.
        attention_scale: what a query's scores are multiplied by (Gemma's
            ``query_pre_attn_scalar ** -0.5``); None: ``head_dim ** -0.5``.
        rope: the layer type the model's rotary embedding takes for this layer (Gemma 3's local
            and global layers rotate with other bases: ``rotary_emb(x, positions, rope)``);
            None: the one rotation every layer shares.
        norms: where the layer's RMSNorms sit (``NORM_PLACEMENTS``): "pre" (Llama:
            ``input_layernorm`` before attention, ``post_attention_layernorm`` before the MLP);
            "sandwich" (Gemma 2/3: ``input_layernorm`` before attention and
            ``post_attention_layernorm`` on its output, ``pre_feedforward_layernorm`` before the
            MLP and ``post_feedforward_layernorm`` on its output, each before the residual add);
            "post" (OLMo 2: no norm before either, ``post_attention_layernorm`` and
            ``post_feedforward_layernorm`` on their outputs).
        rotary: q and k are rotated by their positions (rotary embeddings); False: a "NoPE"
            layer, whose attention sees positions only through causal order (SmolLM3's every
            fourth layer, ``no_rope_layers``). Its K are cached unrotated, as transformers
            keeps them.
        qk_projection_norm: q and k are normalised over their whole projection (every head at
            once: ``self_attn.q_norm`` over heads x head_dim) before they are split into heads
            and rotated: OLMo 2. Not Qwen3's per-head ``qk_norm``: the same module names, other
            arithmetic (one of the two at most).
    """

    qk_norm: bool = False
    window: int | None = None
    experts: ExpertRouting | None = None
    attention_scale: float | None = None
    rope: str | None = None
    norms: NormPlacement = "pre"
    rotary: bool = True
    qk_projection_norm: bool = False

    def __post_init__(self) -> None:
        if self.qk_norm and self.qk_projection_norm:
            raise ValueError("q and k are normalised per head or over the projection, not both")
        if self.norms not in NORM_PLACEMENTS:
            raise ValueError(f"norms are placed {' or '.join(NORM_PLACEMENTS)}, "
                             f"not {self.norms!r}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window holds at least one position, not {self.window}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DecoderFeatures:
    """A model's layers as the batched forward walks them.

    Attributes:
        family: the family that described them (``gateway.engine.models.families``), for
            messages and the route note.
        layers: one record per decoder layer, in order.
    """

    family: str
    layers: tuple[LayerFeatures, ...]

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a decoder has at least one layer")

    @property
    def has_windows(self) -> bool:
        """Whether any layer attends a sliding window (an attention must then keep windows)."""
        return any(layer.window is not None for layer in self.layers)

    @property
    def has_custom_scale(self) -> bool:
        """Whether any layer scales its scores otherwise than by ``head_dim ** -0.5``."""
        return any(layer.attention_scale is not None for layer in self.layers)

    @property
    def rope_kinds(self) -> tuple[str | None, ...]:
        """The rotations the layers use, in order of first use."""
        return tuple(dict.fromkeys(layer.rope for layer in self.layers))

    @property
    def has_experts(self) -> bool:
        """Whether any layer routes tokens to experts (data-dependent work: no captured step)."""
        return any(layer.experts is not None for layer in self.layers)

    @classmethod
    def uniform(cls, family: str, num_layers: int, layer: LayerFeatures) -> DecoderFeatures:
        """Every one of ``num_layers`` layers alike."""
        return cls(family=family, layers=(layer,) * num_layers)
