"""Linear kernels for tests: the machine's own where they hold, seams where they do not.

Why seams: whether a kernel keeps a row's bits whatever the row count is a property of the
machine (docs/design.md, "Parity"), so a test that needs "the batched route" or "decode rows alone"
must not assume this machine has it. ``ROWWISE`` computes every row as a matrix-vector product
of its own: it gives a row the same bits for any row count on any machine, so with it every
branch of the batched route runs everywhere. ``varies_below`` and ``raising`` play the machines
whose kernels need more rows, or cannot run a dtype at all.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from gateway.engine.attention.tiled import SequenceAttention
from gateway.engine.engine import EngineConfig
from gateway.engine.forward.batched import BatchedForward, projection_weights
from gateway.engine.linear.row_padding import RowPadding
from gateway.engine.linear.row_products import (
    KERNELS,
    LinearKernel,
    Product,
    RowProducts,
    candidate_row_products,
)
from gateway.engine.models.loading import LoadedModel
from gateway.engine.parity.probe import probe_invariance
from gateway.engine.parity.route_search import search_route


def rowwise(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Each row a matrix-vector product of its own: no row count changes any row's bits."""
    out = torch.stack([torch.mv(weight, row) for row in rows]) if rows.shape[0] else \
        rows.new_empty(0, weight.shape[0])
    return out + bias if bias is not None else out


def varies_below(count: int) -> Product:
    """``F.linear``, but rows come out rounded differently below ``count`` rows (as a kernel
    that splits its reduction for small products does)."""
    def product(rows: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        out = F.linear(rows, weight, bias)
        return out.to(torch.bfloat16).to(out.dtype) if rows.shape[0] < count else out
    return product


def varies_with_count(rows: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` whose rows differ for every row count (no padding can hold)."""
    out = F.linear(rows, weight, bias)
    return out * (1.0 + rows.shape[0] * 2.0 ** -20)


def raising(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A kernel the machine cannot run (oneDNN's bfloat16 inner product on an AVX2 CPU)."""
    raise RuntimeError("could not create a primitive descriptor for the inner product forward "
                       "propagation primitive")


ROWWISE_KERNELS: Mapping[str, Product] = {"onednn": rowwise, "blas": rowwise}
"""Both kernels invariant by construction: the batched route holds on any machine."""

ROWWISE = RowProducts(kernel="blas", padding=RowPadding(minimum=1, multiple=1),
                      shares_decode_rows=False, product_override=rowwise)


_FOUND: dict[tuple[int, str], bool] = {}
"""Whether the machine's search found the batched route, per (model object, linear kernel)."""


def _machine_batched(loaded: LoadedModel, linear_kernel: LinearKernel) -> bool:
    key = (id(loaded), linear_kernel)
    if key not in _FOUND:
        verdict = search_route(loaded,
                               EngineConfig(linear_kernel=linear_kernel).search_settings())
        _FOUND[key] = verdict.name == "batched"
    return _FOUND[key]


def batched_kernels(loaded: LoadedModel,
                    linear_kernel: LinearKernel = "auto") -> Mapping[str, Product]:
    """The machine's kernels where its search finds the batched route for ``loaded``, else
    ``ROWWISE_KERNELS`` (so that tests of the batched loop run on every machine)."""
    if _machine_batched(loaded, linear_kernel):
        return KERNELS
    return ROWWISE_KERNELS


def machine_products(loaded: LoadedModel, attention: SequenceAttention) -> RowProducts:
    """The first products this machine's search finds whose forward with ``attention`` the
    probe finds invariant on ``loaded``; ``ROWWISE`` where none is."""
    settings = EngineConfig().search_settings()
    model = loaded.model
    for products in candidate_row_products(
            loaded.device, projection_weights(model), model.lm_head.weight,
            max_rows=settings.max_rows, max_logit_rows=settings.max_logit_rows):
        forward = BatchedForward(model, attention, products)
        if probe_invariance(forward, loaded.layout, int(model.config.vocab_size)).is_invariant:
            return products
    return ROWWISE
