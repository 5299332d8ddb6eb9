"""How the batched forward multiplies a step's rows by a projection's weight: the kernel, how
many rows each product is padded to, and whether decode rows share the product.

Why a seam of its own: a row's bits depend on the kernel and on the row count it is called
with, and both differ between libraries and devices (DESIGN.md, "Parity"):

- **oneDNN** (``torch.ops.mkldnn._linear_pointwise``, the fp32 inner product behind inductor's
  CPU linears) gives a row the same bits for every row count from 2: checked for every count
  from 2 to 1,100 on SmolLM2's five weight shapes (a lone row differs). On this project's AMD
  CPU it is also about twice as fast as ``F.linear`` (MKL's sgemm, whose AVX-512 paths are
  Intel's): SmolLM2's 210 projections took 59 ms for 96 rows against 112 ms, 17.6 ms for 2 rows
  against 23.8 ms for one matrix-vector product per row. So every row of a step, prefill and
  decode alike, goes into one product padded to at least 2 rows (``ONEDNN_ROW_PADDING``): a
  decode row's numbers are then a prefill's, so the blocks an answer fills are stored as decoded
  (the start-up probe checks it), and the decode rows of many users cost one product instead of
  one each.
- **BLAS** (``F.linear``): on this CPU, MKL keeps a row's bits for 4, 8 and 12+ rows only, and a
  lone decode row padded to 4 costs more than a matrix-vector product; on CUDA, cuBLAS needs the
  searched padding of ``gateway.engine.row_padding``. There, prefill rows share a padded product
  and each decode row is a matrix-vector product of its own (its numbers are then not a
  prefill's, and an answer's blocks are left for the next turn's prefill to store).

Logits rows follow the same rule as decode rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from gateway.engine.row_padding import (
    CPU_ROW_PADDING,
    RowPadding,
    find_row_padding,
    row_padding_for,
    sampled_counts,
)

logger = logging.getLogger(__name__)

LinearKernel = Literal["auto", "onednn", "blas"]
LINEAR_KERNELS: tuple[LinearKernel, ...] = ("auto", "onednn", "blas")

ONEDNN_ROW_PADDING = RowPadding(minimum=2, multiple=8)
"""At least 2 rows (every count from 2 keeps a row's bits); larger counts rounded up to a
multiple of 8, so that oneDNN builds (and caches) one primitive per 8 counts, not one per
count (a new shape costs ~0.5 ms to build)."""

Product = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""``product(rows, weight, bias)``: ``rows @ weight.T (+ bias)``."""


def _blas(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(rows, weight, bias)


def _onednn(rows: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    return out


@dataclass(frozen=True, slots=True)
class RowProducts:
    """The forward's projections: one kernel, one padding, decode rows shared or alone.

    Attributes:
        kernel: "onednn" or "blas".
        padding: the row count a shared product of n rows is padded to.
        shares_decode_rows: decode (and logits) rows go into the shared product; otherwise each
            is a matrix-vector product of its own.
    """

    kernel: Literal["onednn", "blas"]
    padding: RowPadding
    shares_decode_rows: bool

    @property
    def label(self) -> str:
        """Its part of the block namespace (empty for the CPU's BLAS, the earliest numerics)."""
        if self.kernel == "onednn":
            return f"dnnl-{self.padding.label}"
        return self.padding.label

    @property
    def product(self) -> Product:
        return _onednn if self.kernel == "onednn" else _blas

    def project(self, linear: Any, rows: torch.Tensor, num_shared: int) -> torch.Tensor:
        """``linear`` of ``rows``: the first ``num_shared`` in one product, each other row alone.

        ``num_shared`` is zero or a padded row count, so the shared rows keep their bits; a row
        alone is a matrix-vector product, which no other row can change."""
        weight: torch.Tensor = linear.weight
        bias: torch.Tensor | None = linear.bias
        if num_shared == rows.shape[0]:
            return self.product(rows, weight, bias)
        out = rows.new_empty(rows.shape[0], weight.shape[0])
        if num_shared:
            out[:num_shared] = self.product(rows[:num_shared], weight, bias)
        for row in range(num_shared, rows.shape[0]):
            torch.mv(weight, rows[row], out=out[row])
        if bias is not None:
            out[num_shared:] += bias
        return out


BLAS_CPU_PRODUCTS = RowProducts(kernel="blas", padding=CPU_ROW_PADDING, shares_decode_rows=False)
"""``F.linear`` on the CPU: prefill rows padded to 4, 8 or 12+, decode rows alone."""


def onednn_problem(device: torch.device) -> str | None:
    """Why oneDNN's inner product cannot run on ``device`` here, or None."""
    if device.type != "cpu":
        return f"oneDNN's inner product serves the CPU, not {device.type}"
    try:
        _onednn(torch.ones(2, 8), torch.ones(4, 8), None)
    except (AttributeError, RuntimeError) as exc:
        return f"oneDNN's inner product is unavailable: {exc}"
    return None


def _onednn_products(weights: Sequence[torch.Tensor], head: torch.Tensor, *, max_rows: int,
                     max_logit_rows: int) -> RowProducts | None:
    """oneDNN products, if every count they use keeps a row's bits for these weights."""
    def product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _onednn(rows, weight, None)

    padding = ONEDNN_ROW_PADDING
    for group, most in ((weights, max_rows), ([head], max_logit_rows)):
        found = find_row_padding(group, max_rows=most, candidates=(padding.minimum,),
                                 multiple=padding.multiple, product=product,
                                 counts=sampled_counts)
        if found != padding:
            return None
    return RowProducts(kernel="onednn", padding=padding, shares_decode_rows=True)


def candidate_row_products(device: torch.device, weights: Sequence[torch.Tensor],
                           head: torch.Tensor, *, max_rows: int, max_logit_rows: int,
                           kernel: LinearKernel = "auto") -> list[RowProducts]:
    """The products the batched forward may use on ``device``, best first; the engine probes
    each on the real weights and takes the first that passes (none: the serial route runs).

    Args:
        device: where the model runs.
        weights: one layer's projection weights (every shape the shared products use).
        head: the output projection (``lm_head``) weight.
        max_rows: the most rows one step's shared product can have.
        max_logit_rows: the most logits rows one step wants (one per running request).
        kernel: "auto" (oneDNN where it keeps a row's bits, then BLAS), "onednn" (BLAS only
            where oneDNN cannot, with a warning) or "blas".
    """
    candidates: list[RowProducts] = []
    if kernel != "blas":
        problem = onednn_problem(device)
        if problem is None:
            products = _onednn_products(weights, head, max_rows=max_rows,
                                        max_logit_rows=max(2, max_logit_rows))
            if products is not None:
                candidates.append(products)
            else:
                problem = "a row's bits change with the row count on these weights"
        if problem is not None and kernel == "onednn":
            logger.warning("linear_kernel = onednn, but %s: using BLAS (F.linear)", problem)
    padding = row_padding_for(device, weights, max_rows=max_rows)
    if padding is not None:
        candidates.append(RowProducts(kernel="blas", padding=padding, shares_decode_rows=False))
    return candidates
