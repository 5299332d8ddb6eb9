"""How many rows the shared product of a step is padded to, on the device that computes it.

A row of a matrix product keeps its bits whatever other rows share the product only once the
product has enough rows: below that, the library picks another kernel for the count, and another
kernel may reduce in another order. Where that count lies depends on the device:

- on this project's CPUs (DESIGN.md, "Parity"), ``nn.Linear`` rows are identical for every count
  from 4, while counts 1 and 2-3 each differ: products of up to 12 rows are padded to 4, 8 or 12
  (``CPU_ROW_PADDING``), larger ones run as they are;
- on CUDA, cuBLAS chooses kernels by the row count, and small counts split the reduction over the
  inner dimension (split-K). Measured on an H100 (torch 2.11, random weights): every projection
  of a SmolLM2-135M and a Llama-3.2-1B shape in bfloat16 gave the same rows for every count
  from 1 to 1,024 except the 1B shape's down projection (8,192 -> 2,048), which matched only
  from 256 rows; in float32 every count below 1,024 differed. There the forward pads to a
  multiple of ``ROW_STEP`` from a minimum found at start-up (``find_row_padding``) over the
  model's own weight shapes, and every count it can then use, up to the step budget, is checked
  against the same rows of the largest product. Padding rows on a GPU costs little: a product of
  a few hundred rows is bound by reading the weights, as one of four rows is.

With BLAS, decode and logits rows are matrix-vector products of their own; with oneDNN they join
the shared product, padded by ``ONEDNN_ROW_PADDING`` (``gateway.engine.row_products``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ROW_STEP = 64
"""On CUDA, shared products are padded to a multiple of this many rows (a finite set of row
counts, each of which the start-up search checks)."""

MINIMUM_CANDIDATES = (64, 128, 256, 512, 1024)
"""The padding minimums tried on CUDA, smallest first."""

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``product(rows, weight)``: what a projection computes (``F.linear`` without bias)."""

CountsToCheck = Callable[[int, int, int], list[int]]
"""``counts(minimum, max_rows, multiple)``: the row counts a search checks for a minimum."""


@dataclass(frozen=True, slots=True)
class RowPadding:
    """The row count a shared product of ``n`` rows is padded to.

    Attributes:
        minimum: no shared product has fewer rows (any count up to it becomes it).
        multiple: counts above the minimum are rounded up to a multiple of this.
        exact_from: counts from this one run unpadded (None: always rounded).
    """

    minimum: int
    multiple: int
    exact_from: int | None = None

    def rows_for(self, num_rows: int) -> int:
        """The padded count for ``num_rows`` shared rows (0 stays 0: nothing to compute)."""
        if num_rows <= 0:
            return 0
        if num_rows <= self.minimum:
            return self.minimum
        if self.exact_from is not None and num_rows >= self.exact_from:
            return num_rows
        return -(-num_rows // self.multiple) * self.multiple

    @property
    def label(self) -> str:
        """Its part of the block namespace: K/V computed under another padding may differ.
        Empty for ``CPU_ROW_PADDING`` (the padding every earlier CPU namespace was made with)."""
        if self == CPU_ROW_PADDING:
            return ""
        return f"r{self.minimum}x{self.multiple}"


CPU_ROW_PADDING = RowPadding(minimum=4, multiple=4, exact_from=12)
"""4, 8 or 12 rows below 12, then the count itself (measured on this project's CPUs)."""


def _linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(rows, weight)


def checked_counts(minimum: int, max_rows: int, multiple: int = ROW_STEP) -> list[int]:
    """Every count a padding of ``minimum`` and ``multiple`` can produce up to ``max_rows``:
    the minimum, then each multiple above it up to ``max_rows`` rounded up."""
    top = -(-max_rows // multiple) * multiple
    return [minimum, *range(minimum // multiple * multiple + multiple, top + 1, multiple)]


def sampled_counts(minimum: int, max_rows: int, multiple: int = ROW_STEP) -> list[int]:
    """Some of ``checked_counts``, for a device where checking every one costs seconds (a CPU):
    the minimum, every multiple up to 16 multiples, then about 1.5x apart, and the largest."""
    every = checked_counts(minimum, max_rows, multiple)
    dense = [count for count in every if count <= 16 * multiple]
    sparse, count = [], 16 * multiple
    while count < every[-1]:
        count = -(-(count * 3 // 2) // multiple) * multiple
        sparse.append(min(count, every[-1]))
    return sorted({*dense, *sparse, every[-1]})


def find_row_padding(weights: Iterable[torch.Tensor], *, max_rows: int,
                     candidates: Sequence[int] = MINIMUM_CANDIDATES,
                     multiple: int = ROW_STEP, product: Product = _linear,
                     counts: CountsToCheck = checked_counts,
                     seed: int = 0) -> RowPadding | None:
    """The smallest padding under which each weight's product rows do not depend on the count.

    For each candidate minimum, every count the padding can produce up to ``max_rows`` (rounded
    up to the multiple) must give, for every weight, the rows the largest count gives for the
    same inputs, bit for bit.

    Args:
        weights: the ``[out, in]`` weights of the model's projections (one per distinct shape is
            enough: the kernel choice depends on the shapes, not on the values).
        max_rows: the most rows a step's shared product can have (its token budget).
        candidates: minimums to try, smallest first.
        multiple: counts are rounded up to a multiple of this.
        product: the projection (``F.linear`` of rows and weight).
        counts: which counts up to ``max_rows`` to check (``checked_counts``: all of them).
        seed: of the random rows.

    Returns:
        The padding, or None when no candidate holds (the batched forward is then not
        invariant on this device: the probe will say so and the serial route runs).
    """
    largest = -(-max_rows // multiple) * multiple
    unique = list({(tuple(w.shape), w.dtype, w.device): w for w in weights}.values())
    generator = torch.Generator().manual_seed(seed)
    references: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    with torch.inference_mode():
        for weight in unique:
            rows = torch.randn(largest, weight.shape[1], generator=generator).to(
                device=weight.device, dtype=weight.dtype)
            references.append((weight, rows, product(rows, weight)))
        for minimum in candidates:
            if minimum > largest:
                break
            if all(torch.equal(product(rows[:count], weight), expected[:count])
                   for weight, rows, expected in references
                   for count in counts(minimum, largest, multiple)):
                return RowPadding(minimum=minimum, multiple=multiple)
    return None


def row_padding_for(device: torch.device, weights: Iterable[torch.Tensor], *,
                    max_rows: int) -> RowPadding | None:
    """The padding the batched forward uses on ``device``: the measured CPU table there, the
    searched one on CUDA (None: none found; the serial route runs). Either way the start-up
    probe then checks the whole forward on the real weights."""
    if device.type != "cuda":
        return CPU_ROW_PADDING
    return find_row_padding(weights, max_rows=max_rows)
