"""The route search: a candidate that fails is passed over, never the end of start-up."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from gateway.engine.attention.tiled import AttentionItem, TiledAttention
from gateway.engine.models.loading import LoadedModel
from gateway.engine.parity import route_search
from gateway.engine.settings import EngineConfig
from tests.gateway.engine.kernels import ROWWISE_KERNELS


class _RaisingAttention:
    numerics = "raises"

    def attend(self, items: Sequence[AttentionItem]) -> list[torch.Tensor]:
        raise ValueError("this attention cannot take these shapes")


def test_an_attention_that_raises_in_the_probe_is_passed_over_for_the_next(
        tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(route_search, "ATTENTIONS", {
        "raising": lambda decode_as_prefill: _RaisingAttention(),
        "tiled": lambda decode_as_prefill: TiledAttention(),
    })
    verdict = route_search.search_route(tiny, EngineConfig().search_settings(),
                                        kernels=ROWWISE_KERNELS)
    assert (verdict.name, verdict.attention) == ("batched", "tiled")


def test_the_paged_kernel_is_not_offered_for_heads_it_cannot_take() -> None:
    problem = route_search.attention_problem("paged", torch.device("cpu"), torch.float32, 36)
    assert problem is not None and "multiples of 8" in problem
