"""The registered model families (``base.ModelFamily``): one module each, one line here.

``describe(config)`` is what loading asks: the features the batched forward walks for this
config, or why it cannot (an architecture no family answers for, or a feature its family does
not run exactly): the serial exact route then serves, and says why.
"""

from __future__ import annotations

from typing import Any

from gateway.engine.forward.features import DecoderFeatures
from gateway.engine.models.families.base import ModelFamily
from gateway.engine.models.families.deepseek_v3 import DEEPSEEK_V3
from gateway.engine.models.families.falcon_h1 import FALCON_H1
from gateway.engine.models.families.gemma2 import GEMMA2
from gateway.engine.models.families.gemma3 import GEMMA3
from gateway.engine.models.families.glm4 import GLM4
from gateway.engine.models.families.gpt_oss import GPT_OSS
from gateway.engine.models.families.granite_hybrid import GRANITE_HYBRID
from gateway.engine.models.families.lfm2 import LFM2
from gateway.engine.models.families.llama import LLAMA
from gateway.engine.models.families.mistral import MISTRAL
from gateway.engine.models.families.olmo2 import OLMO2
from gateway.engine.models.families.phi3 import PHI3
from gateway.engine.models.families.qwen2 import QWEN2
from gateway.engine.models.families.qwen3 import QWEN3
from gateway.engine.models.families.qwen3_5 import QWEN3_5
from gateway.engine.models.families.qwen3_moe import QWEN3_MOE
from gateway.engine.models.families.qwen3_next import QWEN3_NEXT
from gateway.engine.models.families.smollm3 import SMOLLM3

FAMILIES: tuple[ModelFamily, ...] = (
    LLAMA,
    QWEN3,
    MISTRAL,
    QWEN3_MOE,
    GEMMA3,
    QWEN2,
    SMOLLM3,
    OLMO2,
    PHI3,
    GLM4,
    GPT_OSS,
    GEMMA2,
    DEEPSEEK_V3,
    LFM2,
    QWEN3_5,
    QWEN3_NEXT,
    GRANITE_HYBRID,
    FALCON_H1,
)


def family_for(architectures: Any) -> ModelFamily | None:
    """The family answering for any of ``architectures`` (``config.architectures``), or None."""
    names = set(architectures or ())
    return next((f for f in FAMILIES if names & set(f.architectures)), None)


def describe(config: Any) -> DecoderFeatures | str:
    """The features of a model with ``config``, or in one line why the batched forward cannot
    run it."""
    names = list(getattr(config, "architectures", None) or [])
    family = family_for(names)
    if family is None:
        known = ", ".join(a for f in FAMILIES for a in f.architectures)
        return f"architecture {sorted(names)} is not one of the registered families ({known})"
    problem = family.problem(config)
    if problem is not None:
        return f"{family.name}: {problem}"
    return family.features(config)
