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


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerNorms:
    """Which of a decoder layer's own norms normalise where around its attention and its MLP
    (a module name of the layer; None: no norm there). A norm before a sublayer normalises its
    input; one after it, its output before the residual add.

    Why names and not a kind of placement: the same name means other places in other families
    (Llama's ``post_attention_layernorm`` normalises the MLP's input, OLMo 2's and Gemma's the
    attention's output), so a family says which module sits where.
    """

    before_attention: str | None = "input_layernorm"
    after_attention: str | None = None
    before_mlp: str | None = "post_attention_layernorm"
    after_mlp: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The modules, in the order the layer applies them."""
        return tuple(name for name in (self.before_attention, self.after_attention,
                                       self.before_mlp, self.after_mlp) if name is not None)


PRE_NORMS = LayerNorms()
"""Llama's: each sublayer's input normalised (``input_layernorm``, ``post_attention_layernorm``)."""
POST_NORMS = LayerNorms(before_attention=None, after_attention="post_attention_layernorm",
                        before_mlp=None, after_mlp="post_feedforward_layernorm")
"""OLMo 2's: each sublayer's output normalised before the residual add, its input not."""
GLM4_NORMS = LayerNorms(after_attention="post_self_attn_layernorm",
                        after_mlp="post_mlp_layernorm")
"""GLM-4's: each sublayer's input and its output normalised ("sandwich" norms)."""
GEMMA3_NORMS = LayerNorms(after_attention="post_attention_layernorm",
                          before_mlp="pre_feedforward_layernorm",
                          after_mlp="post_feedforward_layernorm")
"""Gemma 2/3's: GLM-4's sandwich under other names (``post_attention_layernorm`` on the
attention's output, ``pre_feedforward_layernorm`` before the MLP)."""


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
        shared_expert: a dense gated MLP of every token (``mlp.shared_expert``) is added to
            the experts' sum, weighted by ``sigmoid(mlp.shared_expert_gate(x))`` (one number
            per token): Qwen3-Next's; False: the routed experts alone (Qwen3-MoE's).
        softmax_of_top_k: the router's top k scores are chosen first (in float32) and softmaxed
            among themselves (Granite 4.0-H's), not softmaxed over every expert first;
            ``normalize`` then has nothing to do.
        shared_mlp: a dense MLP of every token (``mlp.shared_mlp``: ``input_linear`` gate | up
            in halves, ``activation``, ``output_linear``) is added to the experts' sum, unweighted
            (Granite 4.0-H's).
    """

    top_k: int
    normalize: bool
    shared_expert: bool = False
    softmax_of_top_k: bool = False
    shared_mlp: bool = False

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"a token is routed to at least one expert, not {self.top_k}")

    @property
    def router(self) -> str:
        """The MLP's module that scores each token's experts."""
        return "gate"


@dataclass(frozen=True, slots=True, kw_only=True)
class ClampedSwigluRouting:
    """A layer whose MLP is gpt-oss's mixture of experts: ``mlp.router`` (a ``Linear`` with a
    bias) scores each token, its ``top_k`` highest scores are softmaxed among themselves (the
    top k chosen first, then the softmax over them), and each chosen expert computes, with its
    weights stored ``[experts, in, out]`` (``x @ w``) and a bias per product:
    ``gate_up = x @ gate_up_proj[e] + gate_up_proj_bias[e]``, gate and up interleaved in its
    columns (gate the even ones, up the odd), ``gate`` clamped from above at ``limit``, ``up``
    to ``[-limit, limit]``, ``(up + 1) * gate * sigmoid(alpha * gate)``, then
    ``@ down_proj[e] + down_proj_bias[e]``. The outputs, weighted, are summed in expert order.

    Attributes:
        top_k: experts per token (``num_experts_per_tok``).
        alpha: the sigmoid's slope (``swiglu_alpha``, 1.702).
        limit: the clamp (``swiglu_limit``, 7.0).
    """

    top_k: int
    alpha: float
    limit: float

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"a token is routed to at least one expert, not {self.top_k}")
        if self.limit <= 0:
            raise ValueError(f"the clamp's limit is positive, not {self.limit}")

    @property
    def router(self) -> str:
        """The MLP's module that scores each token's experts."""
        return "router"


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupLimitedRouting:
    """A layer whose MLP is DeepSeek-V3's mixture of experts: ``mlp.gate`` (a router whose
    ``weight`` is ``[experts, hidden]``, with an ``e_score_correction_bias`` per expert) scores
    each token in float32 through a sigmoid; the experts are cut into ``groups`` groups, each
    group scored by the sum of its two best corrected scores, and a token's ``top_k`` experts are
    chosen by their corrected scores from its ``top_groups`` best groups only. Their uncorrected
    scores weigh them (renormalised over the top k where ``normalize``, then multiplied by
    ``scale``); ``mlp.experts`` holds their gated MLPs as Qwen3-MoE's does, and a dense
    ``mlp.shared_experts`` MLP of every token is added to their sum.

    Attributes:
        top_k: experts per token (``num_experts_per_tok``).
        groups: groups the experts are cut into (``n_group``).
        top_groups: groups a token's experts come from (``topk_group``).
        normalize: the top-k weights are divided by their sum (``norm_topk_prob``).
        scale: what the weights are multiplied by last (``routed_scaling_factor``).
    """

    top_k: int
    groups: int
    top_groups: int
    normalize: bool
    scale: float

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"a token is routed to at least one expert, not {self.top_k}")
        if not 1 <= self.top_groups <= self.groups:
            raise ValueError(f"a token's experts come from 1 to {self.groups} groups, "
                             f"not {self.top_groups}")

    @property
    def router(self) -> str:
        """The MLP's module that scores each token's experts."""
        return "gate"


@dataclass(frozen=True, slots=True, kw_only=True)
class LatentAttention:
    """A layer whose attention is multi-head latent attention (DeepSeek-V2/V3): its keys and
    values come from one compressed latent per token, shared by every head.

    Each token's ``kv_a_proj_with_mqa`` gives a latent of ``rank`` numbers (normalised by
    ``kv_a_layernorm``) and one rotary key of ``rope_dim`` numbers that every head shares;
    ``kv_b_proj`` would expand the latent into each head's unrotated key (``nope_dim``) and
    value (``value_dim``). The cache keeps the latent and the rotated key only, ``rank +
    rope_dim`` numbers a token and layer, as the model's own cache does; attention folds
    ``kv_b_proj`` into the queries and the output instead of expanding every cached token
    (``gateway.engine.forward.latent_attention``).

    Attributes:
        rank: the latent's width (``kv_lora_rank``).
        rope_dim: the rotary key's width (``qk_rope_head_dim``).
        nope_dim: each head's unrotated query and key width (``qk_nope_head_dim``).
        value_dim: each head's value width (``v_head_dim``).
        query_rank: the queries' own low-rank width (``q_lora_rank``: ``q_a_proj``,
            ``q_a_layernorm``, ``q_b_proj``); None: one ``q_proj``.
    """

    rank: int
    rope_dim: int
    nope_dim: int
    value_dim: int
    query_rank: int | None = None

    def __post_init__(self) -> None:
        for name in ("rank", "rope_dim", "nope_dim", "value_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.width % 2:
            raise ValueError(f"a latent of {self.width} numbers does not split over the "
                             "pages' K and V halves")

    @property
    def width(self) -> int:
        """Numbers a token keeps per layer: the latent and the rotary key."""
        return self.rank + self.rope_dim


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelMix:
    """A layer whose recurrent layer and attention both read its normed input (Falcon-H1's):
    the attention's input is scaled by ``attention_in``, and the layer's output is
    ``mixer(x) * mixer_out + attention(x * attention_in) * attention_out``, in that order."""

    attention_in: float = 1.0
    attention_out: float = 1.0
    mixer_out: float = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerFeatures:
    """What one decoder layer does beyond Llama's (every field off: a Llama layer).

    Attributes:
        qk_norm: q and k are normalised per head (an RMSNorm over the head dimension,
            ``self_attn.q_norm`` and ``self_attn.k_norm``) before their rotation: Qwen3.
        window: a query at position p attends the keys at positions p - window < k <= p only
            (a sliding window, as transformers' masks have it); None: every key up to p.
            Mistral, Qwen3 with ``use_sliding_window``, and the local layers of Gemma 2/3.
        experts: the MLP is a sparse mixture of experts routed so (``ExpertRouting``, or
            gpt-oss's ``ClampedSwigluRouting``); None: a dense gated MLP.
        attention_scale: what a query's scores are multiplied by (Gemma's
            ``query_pre_attn_scalar ** -0.5``); None: ``head_dim ** -0.5``.
        rope: the layer type the model's rotary embedding takes for this layer (Gemma 3's local
            and global layers rotate with other bases: ``rotary_emb(x, positions, rope)``);
            None: the one rotation every layer shares.
        rotary: q and k are rotated by their positions (rotary embeddings); False: a "NoPE"
            layer, whose attention sees positions only through causal order (SmolLM3's every
            fourth layer, ``no_rope_layers``). Its K are cached unrotated, as transformers
            keeps them. Where the rotary embedding's tables are narrower than a head (a partial
            rotation, GLM-4's half), only the head's first numbers turn, the rest pass.
        qk_projection_norm: q and k are normalised over their whole projection (every head at
            once: ``self_attn.q_norm`` over heads x head_dim) before they are split into heads
            and rotated: OLMo 2. Not Qwen3's per-head ``qk_norm``: the same module names, other
            arithmetic (one of the two at most).
        norms: which norm modules normalise where (``LayerNorms``): Llama's ``PRE_NORMS``,
            OLMo 2's ``POST_NORMS`` (after each sublayer instead of before it), GLM-4's
            ``GLM4_NORMS`` and Gemma 2/3's ``GEMMA3_NORMS`` (before and after).
        rotary_interleaved: the rotation turns pairs of neighbouring numbers (2i, 2i + 1) of a
            head, each pair by the i-th frequency (transformers' GLM ``rotate_half`` over
            ``cos[..., :half]`` repeated twice), not Llama's halves (i, i + half): GLM-4.
        fused_qkv: q, k and v are one product (``self_attn.qkv_proj``, its output q | k | v,
            split by the heads' widths) instead of three: Phi-3. One product of the fused weight
            is what the checkpoint's model computes; its rows keep their bits as any shape's do
            (the padding is searched over it, ``projection_weights``).
        fused_gate_up: the MLP's gate and up projections are one product
            (``mlp.gate_up_proj``, its output gate | up, in halves; the activation is
            ``mlp.activation_fn``): Phi-3 and GLM-4.
        logit_softcap: a query's scaled scores are squashed to ``cap * tanh(score / cap)``
            before the mask and the softmax (Gemma 2's ``attn_logit_softcapping``): no score
            beyond +-cap; None: scores as they are. An element-wise step: a row's bits stay its
            own.
        sinks: the attention has one learned logit per query head (``self_attn.sinks``) that
            joins each row's softmax denominator as a key with no value (gpt-oss's attention
            sinks): every attention the forward runs adds it (``AttentionItem.sinks``).
        latent: the attention is multi-head latent attention (``LatentAttention``, DeepSeek):
            its queries, keys and values come from its own projections, not q/k/v; None: not.
        mixer: the layer mixes tokens with a recurrent layer in place of attention (its
            ``mixer`` module, no ``self_attn``): the kind's name in
            ``gateway.engine.forward.recurrent.mixers.RECURRENT_MIXERS`` (LFM2's
            ``lfm2_conv``); None: attention. Its state at each block's end is kept in the
            block (``gateway.engine.forward.kept_states``).
        residual_multiplier: each sublayer's output is multiplied by it before the residual
            add (Granite's ``residual_multiplier``); None: added as it is.
        parallel: the layer's recurrent layer (``mixer``) runs beside its attention, not in
            its place (``ParallelMix``: Falcon-H1's); its state then lies in extra layers only,
            the layer's own slots holding the attention's K/V. None: one or the other.
        key_multiplier: the keys are multiplied by it after ``k_proj``, before any rotation
            (Falcon-H1's); None: as the projection gives them.
        mlp_multipliers: the MLP's gate product is multiplied by the first before its
            activation and its output by the second (Falcon-H1's ``mlp_multipliers``); None:
            neither.
        output_gate: the attention's output is gated per number before ``o_proj``: ``q_proj``
            gives each head its query and then as many gate numbers (``[heads, 2 * head_dim]``),
            and the attended rows are multiplied by ``sigmoid(gate)`` (Qwen3.5's and
            Qwen3-Next's gated attention); False: the attended rows as they are.
    """

    qk_norm: bool = False
    window: int | None = None
    experts: ExpertRouting | ClampedSwigluRouting | GroupLimitedRouting | None = None
    attention_scale: float | None = None
    rope: str | None = None
    norms: LayerNorms = PRE_NORMS
    rotary: bool = True
    qk_projection_norm: bool = False
    rotary_interleaved: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    logit_softcap: float | None = None
    sinks: bool = False
    latent: LatentAttention | None = None
    mixer: str | None = None
    output_gate: bool = False
    residual_multiplier: float | None = None
    parallel: ParallelMix | None = None
    key_multiplier: float | None = None
    mlp_multipliers: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        _check_softcap(self.logit_softcap)
        if self.parallel is not None and self.mixer is None:
            raise ValueError("a layer that mixes beside its attention names its mixer")
        if self.mixer is not None and self.parallel is None and (
                self.qk_norm or self.qk_projection_norm or self.fused_qkv
                or self.sinks or self.latent is not None or self.output_gate
                or self.key_multiplier is not None or self.window is not None
                or self.logit_softcap is not None):
            raise ValueError("a recurrent layer has no attention: no q/k norms, fused q/k/v, "
                             "sinks, latents, output gate, key multiplier, window or soft-cap")
        if self.latent is not None and (self.qk_norm or self.qk_projection_norm
                                        or self.fused_qkv or self.sinks or self.output_gate):
            raise ValueError("latent attention has projections of its own: no q/k norms, "
                             "fused q/k/v, sinks or output gate")
        if self.output_gate and self.fused_qkv:
            raise ValueError("an output gate comes from q_proj, which a fused q/k/v has not")
        if self.qk_norm and self.qk_projection_norm:
            raise ValueError("q and k are normalised per head or over the projection, not both")
        if self.rotary_interleaved and not self.rotary:
            raise ValueError("a layer that does not rotate has no rotation form")
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window holds at least one position, not {self.window}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DecoderFeatures:
    """A model's layers as the batched forward walks them.

    Attributes:
        family: the family that described them (``gateway.engine.models.families``), for
            messages and the route note.
        layers: one record per decoder layer, in order.
        rotary_frequencies_once: the model's rotary embedding returns each frequency's cos
            and sin once (``[..., rotated width / 2]``, rotating halves as
            ``first * cos - second * sin``: gpt-oss), not twice side by side as Llama's; the
            forward repeats them, which turns the halves alike.
        final_logit_softcap: the output logits are squashed to ``cap * tanh(logit / cap)``
            (Gemma 2's ``final_logit_softcapping``); None: as the output projection gives them.
        embedding_multiplier: the token embeddings are multiplied by it before the first layer
            (Granite's and Falcon-H1's ``embedding_multiplier``); None: as the table holds them.
        logits_divisor: the output logits are divided by it (Granite's ``logits_scaling``),
            before any soft-cap; None: as the output projection gives them.
        logits_multiplier: the output logits are multiplied by it (Falcon-H1's
            ``lm_head_multiplier``), before any soft-cap; None: as the projection gives them.
    """

    family: str
    layers: tuple[LayerFeatures, ...]
    rotary_frequencies_once: bool = False
    final_logit_softcap: float | None = None
    embedding_multiplier: float | None = None
    logits_divisor: float | None = None
    logits_multiplier: float | None = None

    def __post_init__(self) -> None:
        _check_softcap(self.final_logit_softcap)
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
    def has_logit_softcap(self) -> bool:
        """Whether any layer soft-caps its attention scores (an attention must then cap)."""
        return any(layer.logit_softcap is not None for layer in self.layers)

    @property
    def has_sinks(self) -> bool:
        """Whether any layer's attention has sinks (an attention must then add them)."""
        return any(layer.sinks for layer in self.layers)

    @property
    def has_latent(self) -> bool:
        """Whether any layer's attention is latent (its pages hold latents, not K/V)."""
        return any(layer.latent is not None for layer in self.layers)

    @property
    def masks_or_scales(self) -> bool:
        """Whether an attention must do more than a causal softmax at ``head_dim ** -0.5``:
        windows, another scale, sinks or soft-capped scores (torch's flash kernel cannot)."""
        return (self.has_windows or self.has_custom_scale or self.has_sinks
                or self.has_logit_softcap)

    @property
    def rope_kinds(self) -> tuple[str | None, ...]:
        """The rotations the layers use, in order of first use."""
        return tuple(dict.fromkeys(layer.rope for layer in self.layers))

    @property
    def mixers(self) -> dict[int, str]:
        """The recurrent layers, by index: their kind (``LayerFeatures.mixer``)."""
        return {index: layer.mixer for index, layer in enumerate(self.layers)
                if layer.mixer is not None}

    @property
    def mixers_beside_attention(self) -> frozenset[int]:
        """The recurrent layers that run beside an attention (``LayerFeatures.parallel``): their
        own slots hold the attention's K/V."""
        return frozenset(index for index, layer in enumerate(self.layers)
                         if layer.parallel is not None)

    @property
    def has_experts(self) -> bool:
        """Whether any layer routes tokens to experts (data-dependent work: no captured step)."""
        return any(layer.experts is not None for layer in self.layers)

    @classmethod
    def uniform(cls, family: str, num_layers: int, layer: LayerFeatures) -> DecoderFeatures:
        """Every one of ``num_layers`` layers alike."""
        return cls(family=family, layers=(layer,) * num_layers)


def _check_softcap(cap: float | None) -> None:
    if cap is not None and not cap > 0:
        raise ValueError(f"a soft-cap is a positive bound, not {cap}")
