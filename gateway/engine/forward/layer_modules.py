"""Which modules of a decoder layer the batched forward walks for its features, and why a
layer's modules do not fit them.

Why a check of its own: the forward calls a module by name only where a feature says so, so a
layer with more than its family described (a Qwen3 layer described as Llama's would keep its
``q_norm`` unapplied) would be walked past silently, and one with less would fail mid-step.
``BatchedForward`` asks ``layer_problem`` of every layer before any step: a norm or a projection
the features walk must be there, a norm or projection the layer has must be walked, attention
sinks (``self_attn.sinks``) applied exactly where the layer has them, and q/k norms must be as
wide as the features' kind of q/k norm. A recurrent layer (``LayerFeatures.mixer``) has its
``mixer`` module in place of ``self_attn``, whose arithmetic its kind's module walks.
"""

from __future__ import annotations

from typing import Any

from gateway.engine.forward.features import ExpertRouting, GroupLimitedRouting, LayerFeatures

Walked = tuple[tuple[str, str], ...]
"""(where, name) pairs: "layer" for the decoder layer's own modules, "attention" for
``self_attn``'s, "mlp" for ``mlp``'s."""


def walked_modules(features: LayerFeatures) -> Walked:
    """The modules ``BatchedForward._layer`` calls or multiplies by in a layer with
    ``features``."""
    norms = features.norms.names
    mlp = _mlp_modules(features)
    if features.mixer is not None and features.parallel is None:
        return (tuple(("layer", name) for name in (*norms, "mixer"))
                + tuple(("mlp", name) for name in mlp))
    mixer = (("layer", "mixer"),) if features.mixer is not None else ()
    qk_norms = ("q_norm", "k_norm") if features.qk_norm or features.qk_projection_norm else ()
    attention = (("qkv_proj",) if features.fused_qkv else ("q_proj", "k_proj", "v_proj"))
    if features.latent is not None:  # its queries' own projections, the latent's, kv_b_proj
        queries = (("q_a_proj", "q_a_layernorm", "q_b_proj")
                   if features.latent.query_rank is not None else ("q_proj",))
        attention = (*queries, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")
    return (tuple(("layer", name) for name in norms) + mixer
            + tuple(("attention", name) for name in (*qk_norms, *attention, "o_proj"))
            + tuple(("mlp", name) for name in mlp))


def _mlp_modules(features: LayerFeatures) -> tuple[str, ...]:
    if isinstance(features.experts, GroupLimitedRouting):  # and a dense MLP of every token
        return (features.experts.router, "experts", "shared_experts")
    if isinstance(features.experts, ExpertRouting) and features.experts.shared_expert:
        return (features.experts.router, "experts", "shared_expert", "shared_expert_gate")
    if isinstance(features.experts, ExpertRouting) and features.experts.shared_mlp:
        return (features.experts.router, "experts", "shared_mlp")
    if features.experts is not None:  # a router and the experts' stacked weights (MoE)
        return (features.experts.router, "experts")
    if features.fused_gate_up:
        return ("gate_up_proj", "down_proj", "activation_fn")
    return ("gate_proj", "up_proj", "down_proj", "act_fn")


def layer_problem(layer: Any, features: LayerFeatures, qk_widths: tuple[int, int]) -> str | None:
    """Why the forward cannot walk ``layer`` as ``features`` say, or None.

    Args:
        layer: one decoder layer of the module tree.
        features: what its family says it does.
        qk_widths: how many numbers its q and k norms must normalise over (per head for
            Qwen3's ``qk_norm``, the whole projection for OLMo 2's ``qk_projection_norm``).

    Returns:
        A phrase to follow "layer i" (a module missing, one present and not walked, or q/k
        norms of the other width), or None.
    """
    attention = getattr(layer, "self_attn", None)
    if features.mixer is not None and features.parallel is None and attention is not None:
        return f"has self_attn, where its features say a recurrent layer ({features.mixer})"
    if (features.mixer is None or features.parallel is not None) and attention is None:
        return "has no self_attn to apply"
    modules = {"layer": layer, "mlp": layer.mlp}
    if attention is not None:
        modules["attention"] = attention
    wanted = walked_modules(features)
    missing = [name for where, name in wanted if getattr(modules[where], name, None) is None]
    if missing:
        return f"has no {' and '.join(missing)} to apply"
    present = {(where, name) for where, module in modules.items()
               for name, _ in module.named_children() if name.endswith(("norm", "_proj"))}
    unwalked = sorted(name for _, name in present - set(wanted))
    if unwalked:
        return f"has {', '.join(unwalked)}, which its features do not apply"
    has_sinks = getattr(attention, "sinks", None) is not None
    if features.sinks != has_sinks:
        return ("has attention sinks, which its features do not apply" if has_sinks
                else "has no attention sinks to apply")
    if features.qk_norm or features.qk_projection_norm:
        for name, width in zip(("q_norm", "k_norm"), qk_widths, strict=True):
            weight = getattr(getattr(modules["attention"], name), "weight", None)
            if weight is not None and weight.shape[-1] != width:
                return (f"has a {name} over {weight.shape[-1]} numbers, not "
                        f"{'per head' if features.qk_norm else 'over the projection'} ({width})")
    return None
