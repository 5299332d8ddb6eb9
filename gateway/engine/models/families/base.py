"""The model-family seam: how a checkpoint's config becomes what the batched forward walks.

A family is one module here plus one line in the registry (``families/__init__.py``): the
architectures it answers for, what of a config it cannot run exactly, and the features each of
its layers uses (``gateway.engine.forward.features``). Its module tree is either its own reader's
(Llama's, without transformers) or transformers' ``from_pretrained`` -- both have transformers'
attribute names, and the forward only walks their weights and calls their small modules (norms,
activation, rotary embedding), never transformers' model forward.

Every registered family runs the one conformance suite (tests/gateway/engine/families/).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from gateway.engine.forward.features import DecoderFeatures


class ModelFamily(Protocol):
    """One family of decoder checkpoints (Llama, Qwen3, ...)."""

    @property
    def name(self) -> str:
        """Short and lower-case (``qwen3``): in route notes and messages."""
        ...

    @property
    def architectures(self) -> tuple[str, ...]:
        """The ``config.architectures`` names it answers for (``Qwen3ForCausalLM``)."""
        ...

    def problem(self, config: Any) -> str | None:
        """What of ``config`` (transformers' attribute names) the batched forward cannot run
        exactly, in one line; None when it can. The model then runs the serial exact route."""
        ...

    def features(self, config: Any) -> DecoderFeatures:
        """What each layer of a model with ``config`` does (only called when ``problem`` is
        None)."""
        ...


@runtime_checkable
class RenamedFamily(Protocol):
    """A family whose transformers model names its modules otherwise than Llama's (LFM2's
    ``conv``, ``feed_forward.w1``...): loading hands the forward ``module_tree(model)``."""

    def module_tree(self, model: Any) -> Any:
        """``model``'s own modules, none copied, under transformers' Llama attribute names."""
        ...
