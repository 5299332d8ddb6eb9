"""How many rows the shared product of a step is padded to, found on the machine that computes.

A row of a matrix product keeps its bits whatever other rows share the product only once the
product has enough rows: below that, the library picks another kernel for the count, and another
kernel may reduce in another order. Where that count lies depends on the library, the CPU's
instruction set (an AVX2 machine, an AVX-512 one and one with AMX each take other MKL and oneDNN
paths), the dtype and the device, so it is never assumed: at start-up the engine searches, over
the model's own weight shapes and dtype, for the first of a few candidate paddings under which
every row count it can produce gives a row the bits the largest count gives
(``find_row_padding``), and then probes the whole forward on the real weights
(``gateway.engine.parity.probe``). No candidate holds: that kernel is not used (the serial exact
route serves where none is).

- On a CPU the candidates are ``CPU_PADDINGS``, smallest first: 4, 8 or 12+ rows (what MKL's
  sgemm needed on this project's AMD EPYC), then multiples of 16, 32 and 64. Checking every
  count up to the step budget would cost seconds, so a sample is checked (``sampled_counts``:
  every count up to 64, the counts around each power of two, then ~1.5x apart, and the largest).
- On CUDA, cuBLAS chooses kernels by the row count, and small counts split the reduction over
  the inner dimension (split-K). Measured on an H100 (torch 2.11, random weights): in bfloat16
  every projection of SmolLM2-135M and Llama-3.2-1B shapes kept its rows from 1 to 1,024 rows but
  the 1B shape's down projection (from 256 only); in float32 every count below 1,024 differed.
  There candidates pad to a multiple of ``ROW_STEP`` from a minimum in ``MINIMUM_CANDIDATES`` and
  every count is checked (a few hundred rows on a GPU cost what four do). Each weight shape
  gets the first that holds for it (``find_shape_paddings``): a step is padded as its cheapest
  shape needs, and a shape that needs more pads its own product further
  (``gateway.engine.linear.row_products``), so a one-row decode step multiplies one row through
  every projection that keeps a row's bits at one row (on an H100 the 8B shape's decode step
  multiplied 256 rows through every projection: 2.42x the time its weights take to read).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ROW_STEP = 64
"""On CUDA, shared products are padded to a multiple of this many rows (a finite set of row
counts, each of which the start-up search checks)."""

MINIMUM_CANDIDATES = (1, 64, 128, 256, 512, 1024)
"""The padding minimums tried on CUDA, smallest first (1: a one-row product runs as it is,
two rows and more are padded to a multiple of ``ROW_STEP``)."""

Shape = tuple[int, int]
"""A projection weight's ``(out, in)``: what the kernel choice depends on, with the dtype."""

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``product(rows, weight)``: what a projection computes (``F.linear`` without bias)."""


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

    def __post_init__(self) -> None:
        if self.minimum < 1 or self.multiple < 1:
            raise ValueError(f"a padding needs minimum and multiple >= 1, got {self}")

    def rows_for(self, num_rows: int) -> int:
        """The padded count for ``num_rows`` shared rows (0 stays 0: nothing to compute)."""
        if num_rows <= 0:
            return 0
        if num_rows <= self.minimum:
            return self.minimum
        if self.exact_from is not None and num_rows >= self.exact_from:
            return num_rows
        return -(-num_rows // self.multiple) * self.multiple

    def counts(self, max_rows: int) -> list[int]:
        """Every count ``rows_for`` gives for 1..``max_rows`` rows, ascending."""
        return sorted({self.rows_for(n) for n in range(1, max(1, max_rows) + 1)})

    @property
    def label(self) -> str:
        """Its part of the block namespace: K/V computed under another padding may differ.
        Empty for ``CPU_ROW_PADDING`` (the padding every earlier CPU namespace was made with)."""
        if self == CPU_ROW_PADDING:
            return ""
        exact = f"e{self.exact_from}" if self.exact_from is not None else ""
        return f"r{self.minimum}x{self.multiple}{exact}"


CPU_ROW_PADDING = RowPadding(minimum=4, multiple=4, exact_from=12)
"""4, 8 or 12 rows below 12, then the count itself: what MKL's sgemm needed on the AMD EPYC this
project started on (its first CPU namespaces were made with it)."""

CPU_PADDINGS = (CPU_ROW_PADDING, RowPadding(minimum=16, multiple=16),
                RowPadding(minimum=32, multiple=32), RowPadding(minimum=64, multiple=64))
"""The paddings a CPU's BLAS products may use, cheapest first (each searched at start-up)."""

CountsToCheck = Callable[[RowPadding, int], list[int]]
"""``counts(padding, max_rows)``: the row counts a search checks for a padding."""


def every_count(padding: RowPadding, max_rows: int) -> list[int]:
    """Every count the padding can produce up to ``max_rows`` (what a GPU can afford)."""
    return padding.counts(max_rows)


def sampled_counts(padding: RowPadding, max_rows: int) -> list[int]:
    """Some of the counts the padding can produce, for a device where checking every one costs
    seconds (a CPU): every count up to 64, those next to each power of two (where libraries
    switch kernels), then about 1.5x apart, and the largest."""
    every = padding.counts(max_rows)
    picked = {count for count in every if count <= 64}
    power = 64
    while power <= every[-1]:
        picked.update(count for count in every if power - 2 <= count <= power + 2)
        power *= 2
    target = 64
    for count in every:
        if count >= target:
            picked.add(count)
            target = count * 3 // 2
    picked.add(every[-1])
    return sorted(picked)


def checked_counts(minimum: int, max_rows: int, multiple: int = ROW_STEP) -> list[int]:
    """Every count a padding of ``minimum`` and ``multiple`` can produce up to ``max_rows``."""
    return every_count(RowPadding(minimum=minimum, multiple=multiple), max_rows)


def _linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(rows, weight)


def find_row_padding(weights: Iterable[torch.Tensor], *, max_rows: int,
                     candidates: Sequence[RowPadding] | None = None,
                     product: Product = _linear, counts: CountsToCheck = every_count,
                     seed: int = 0,
                     cancelled: Callable[[], bool] = lambda: False) -> RowPadding | None:
    """The first candidate padding under which each weight's product rows do not depend on the
    row count.

    For a candidate, every count it can produce up to ``max_rows`` (``counts`` picks which are
    checked) must give, for every weight, the rows the largest count gives for the same inputs,
    bit for bit.

    Args:
        weights: the ``[out, in]`` weights of the model's projections (one per distinct shape and
            dtype is enough: the kernel choice depends on those, not on the values).
        max_rows: the most rows a step's shared product can have (its token budget).
        candidates: paddings to try, cheapest first (default: multiples of ``ROW_STEP`` from
            each of ``MINIMUM_CANDIDATES``).
        product: the projection (``F.linear`` of rows and weight).
        counts: which counts to check for a candidate (``every_count``: all of them).
        seed: of the random rows.
        cancelled: polled between products; True ends the search (returns None).

    Returns:
        The padding, or None when no candidate holds.

    Raises:
        Exception: whatever ``product`` raises (a kernel the machine cannot run).
    """
    if candidates is None:
        candidates = [RowPadding(minimum=m, multiple=ROW_STEP) for m in MINIMUM_CANDIDATES]
    largest = max(padding.rows_for(max_rows) for padding in candidates)
    unique = list({(tuple(w.shape), w.dtype, w.device): w for w in weights}.values())
    generator = torch.Generator().manual_seed(seed)
    references: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    with torch.inference_mode():
        for weight in unique:
            rows = torch.randn(largest, weight.shape[1], generator=generator).to(
                device=weight.device, dtype=weight.dtype)
            references.append((weight, rows, product(rows, weight)))
        for padding in candidates:
            if _holds(padding, references, product, counts(padding, max_rows), cancelled):
                return padding
            if cancelled():
                return None
    return None


def _holds(padding: RowPadding,
           references: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
           product: Product, counts: list[int], cancelled: Callable[[], bool]) -> bool:
    for weight, rows, expected in references:
        for count in counts:
            if cancelled() or not torch.equal(product(rows[:count], weight), expected[:count]):
                return False
    return True


def find_shape_paddings(weights: Iterable[torch.Tensor], *, max_rows: int,
                        candidates: Sequence[RowPadding] | None = None,
                        product: Product = _linear, counts: CountsToCheck = every_count,
                        seed: int = 0, cancelled: Callable[[], bool] = lambda: False,
                        ) -> dict[Shape, RowPadding] | None:
    """For each weight shape, the first candidate under which its product rows do not depend
    on the row count (``find_row_padding`` of that shape alone); None when a shape has none.

    Why per shape: on an H100 a one-row product of most of a Llama's projections kept its bits
    (bfloat16), but one shape's kept them only from 256 rows, and a padding common to all made
    every one-row decode step multiply 256 rows through every projection."""
    found: dict[Shape, RowPadding] = {}
    for weight in {(tuple(w.shape), w.dtype, w.device): w for w in weights}.values():
        padding = find_row_padding([weight], max_rows=max_rows, candidates=candidates,
                                   product=product, counts=counts, seed=seed,
                                   cancelled=cancelled)
        if padding is None:
            return None
        shape = (int(weight.shape[0]), int(weight.shape[1]))
        found[shape] = max(found.get(shape, padding), padding, key=lambda p: p.minimum)
    return found


def row_padding_for(device: torch.device, weights: Iterable[torch.Tensor], *, max_rows: int,
                    product: Product = _linear,
                    cancelled: Callable[[], bool] = lambda: False) -> RowPadding | None:
    """The padding BLAS products (``product``) use on ``device``: searched over
    ``CPU_PADDINGS`` (sampled counts) on a CPU, over multiples of ``ROW_STEP`` (every count)
    on CUDA. None: none holds here; the start-up probe then checks the chosen one on the real
    weights.

    Raises:
        Exception: whatever ``product`` raises (a kernel the machine cannot run).
    """
    if device.type == "cuda":
        return find_row_padding(weights, max_rows=max_rows, product=product,
                                cancelled=cancelled)
    return find_row_padding(weights, max_rows=max_rows, candidates=CPU_PADDINGS,
                            product=product, counts=sampled_counts, cancelled=cancelled)
