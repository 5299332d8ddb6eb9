"""gpt-oss's mixture of experts in the batched forward (``gateway.engine.forward.gpt_oss_experts``),
checked against transformers' own ``GptOssMLP`` with weights large enough that the clamped
SwiGLU clamps (the tiny conformance checkpoint's products stay far inside its limit): the same
outputs within float rounding, the activation's bits transformers', and a token's bits its own
whatever other tokens share the step."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from gateway.engine.forward.features import ClampedSwigluRouting
from gateway.engine.forward.gpt_oss_experts import clamped_swiglu, clamped_swiglu_mlp
from gateway.engine.linear.row_products import (
    BLAS_CPU_PRODUCTS,
    ONEDNN_ROW_PADDING,
    RowProducts,
    onednn_problem,
)

HIDDEN, INNER, EXPERTS, TOP_K = 64, 48, 4, 2
ROUTING = ClampedSwigluRouting(top_k=TOP_K, alpha=1.702, limit=7.0)
RELATIVE_TOLERANCE = 1e-5
"""float32 products of other kernels (oneDNN or BLAS against transformers' loop over experts),
as a share of the largest output (~50 here): a few float32 roundings, ~1e-6 measured."""


def _products() -> RowProducts:
    if onednn_problem(torch.device("cpu")) is None:
        return RowProducts(kernel="onednn", padding=ONEDNN_ROW_PADDING, shares_decode_rows=True)
    return BLAS_CPU_PRODUCTS


@pytest.fixture(scope="module")
def mlp() -> GptOssMLP:
    """transformers' block with every weight and bias random, the experts' wide enough that a
    good share of gate and up values fall outside [-7, 7]."""
    config = GptOssConfig(hidden_size=HIDDEN, intermediate_size=INNER,
                          num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    config._experts_implementation = "eager"  # its own loop over experts, as a model runs it
    generator = torch.Generator().manual_seed(0)
    block: GptOssMLP = GptOssMLP(config).eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for name, parameter in block.named_parameters():
            std = 0.5 if name.endswith(("gate_up_proj", "down_proj")) else 0.3
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    return block


def _rows(seed: int, count: int) -> torch.Tensor:
    return torch.randn(count, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _ours(mlp: GptOssMLP, rows: torch.Tensor) -> torch.Tensor:
    """The step's rows padded as the forward pads them, every one shared."""
    products = _products()
    count = products.padding.rows_for(rows.shape[0])
    padded = torch.cat([rows, rows.new_zeros(count - rows.shape[0], HIDDEN)])
    with torch.inference_mode():
        return clamped_swiglu_mlp(mlp, ROUTING, padded, count, products)[:rows.shape[0]]


def test_the_activation_has_the_bits_of_transformers_gate(mlp: GptOssMLP) -> None:
    gate_up = torch.linspace(-20.0, 20.0, 2 * INNER * 8).reshape(8, 2 * INNER)
    gate_up = gate_up[:, torch.randperm(2 * INNER, generator=torch.Generator().manual_seed(1))]
    assert (gate_up.abs() > ROUTING.limit).any()
    assert torch.equal(clamped_swiglu(gate_up, ROUTING), mlp.experts._apply_gate(gate_up))


def test_the_block_is_within_float_rounding_of_transformers(mlp: GptOssMLP) -> None:
    rows = _rows(2, 24)
    with torch.inference_mode():
        theirs, _ = mlp(rows[None])
        gate_up = rows @ mlp.experts.gate_up_proj[0] + mlp.experts.gate_up_proj_bias[0]
    assert (gate_up.abs() > ROUTING.limit).float().mean() > 0.05  # the clamp is exercised
    largest = float(theirs.abs().max())
    assert float((_ours(mlp, rows) - theirs[0]).abs().max()) <= RELATIVE_TOLERANCE * largest


def test_a_token_alone_has_the_bits_it_has_beside_others(mlp: GptOssMLP) -> None:
    rows = _rows(3, 21)
    beside = _ours(mlp, rows)
    for index in (0, 7, 20):
        assert torch.equal(_ours(mlp, rows[index:index + 1])[0], beside[index])
