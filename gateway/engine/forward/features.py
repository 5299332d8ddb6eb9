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

NormPlacement = Literal["pre", "post"]
"""Where a layer normalises around its attention and its MLP (``LayerFeatures.norms``)."""
NORM_PLACEMENTS: tuple[NormPlacement, ...] = ("pre", "post")


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerFeatures:
    """What one decoder layer does beyond Llama's (every field off: a Llama layer).

    Attributes:
        qk_norm: q and k are normalised per head (an RMSNorm over the head dimension,
            ``self_attn.q_norm`` and ``self_attn.k_norm``) before their rotation: Qwen3.
        window: a query at position p attends the keys at positions p - window < k <= p only
            (a sliding window, as transformers' masks have it); None: every key up to p.
            Mistral, Qwen3 with ``use_sliding_window``, and the local layers of Gemma 2/3.
        rotary: q and k are rotated by their positions (rotary embeddings); False: a "NoPE"
            layer, whose attention sees positions only through causal order (SmolLM3's every
            fourth layer, ``no_rope_layers``). Its K are cached unrotated, as transformers
            keeps them.
        qk_projection_norm: q and k are normalised over their whole projection (every head at
            once: ``self_attn.q_norm`` over heads x head_dim) before they are split into heads
            and rotated: OLMo 2. Not Qwen3's per-head ``qk_norm``: the same module names, other
            arithmetic (one of the two at most).
        norms: "pre": the attention's and the MLP's inputs are normalised (``input_layernorm``,
            then ``post_attention_layernorm`` before the MLP: Llama's); "post": their outputs
            are, before each residual add (``post_attention_layernorm`` after the attention,
            ``post_feedforward_layernorm`` after the MLP), and their inputs not: OLMo 2.
    """

    qk_norm: bool = False
    window: int | None = None
    rotary: bool = True
    qk_projection_norm: bool = False
    norms: NormPlacement = "pre"

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

    @classmethod
    def uniform(cls, family: str, num_layers: int, layer: LayerFeatures) -> DecoderFeatures:
        """Every one of ``num_layers`` layers alike."""
        return cls(family=family, layers=(layer,) * num_layers)
