"""How the batched forward multiplies a step's rows by a projection's weight: the kernel, how
many rows each product is padded to, and whether decode rows share the product.

Why a seam of its own: a row's bits depend on the kernel and on the row count it is called
with, and both differ between libraries, CPUs, dtypes and devices (docs/design.md, "Parity"). So
nothing here is assumed of the machine: each kernel of ``KERNELS`` is a candidate, tried in the
model's own dtype, whose padding is searched at start-up on the model's weight shapes
(``gateway.engine.linear.row_padding``); a kernel the machine cannot run at all (oneDNN without a
bfloat16 inner product on an AVX2 CPU, say) is dropped with one log line saying why. The engine
then probes each candidate on the real weights, best first (``gateway.engine.parity.route_search``).

- **panels** (kvgate's own C kernel, ``gateway.engine.linear.panel_products``): each output
  number summed in one fixed order whatever the row count, so no padding (one row is one row)
  and the same bits on every CPU; weights laid out in its panels once at start-up. On the CPU
  in float32, where the weights are the engine's own to lay out; tried first.
- **oneDNN** (``torch.ops.mkldnn._linear_pointwise``, the inner product behind inductor's CPU
  linears): on this project's AMD CPUs a row kept its bits for every count from 2 (float32), and
  it ran about twice as fast as MKL's sgemm there. Every row of a step, prefill and decode
  alike, goes into one product (decode rows share it): a decode row's numbers are then a
  prefill's, so the blocks an answer fills are stored as decoded (the probe checks it).
- **GEMM** (``F.linear`` on CUDA, cuBLAS): every row of a step, decode rows too, in one product
  padded as BLAS's below; a weight shape whose rows keep their bits only from more rows pads
  its own product further (``RowProducts.wider``, found per shape on CUDA). On a GPU a
  product of a few hundred rows costs what one row does (it reads the weights once), while a
  matrix-vector product per decode row reads them once per row: 32 users decoding would read
  the weights 32 times a step. Only on CUDA, and only where some padding keeps the logits
  head's rows (its rows join the product too); tried before BLAS.
- **BLAS** (``F.linear``): prefill rows share a padded product and each decode row is a
  matrix-vector product of its own (its numbers are then not a prefill's, and an answer's blocks
  are left for the next turn's prefill to store). On CUDA this is cuBLAS.

Logits rows follow the same rule as decode rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from gateway.engine.linear.panel_products import NUMERICS as PANEL_NUMERICS
from gateway.engine.linear.panel_products import Panels, panel_kernel_problem, panel_product
from gateway.engine.linear.row_norms import NUMERICS as NORM_NUMERICS
from gateway.engine.linear.row_padding import (
    CPU_ROW_PADDING,
    RowPadding,
    Shape,
    find_row_padding,
    find_shape_paddings,
    row_padding_for,
    sampled_counts,
)

logger = logging.getLogger(__name__)

LinearKernel = Literal["auto", "panels", "onednn", "blas"]
LINEAR_KERNELS: tuple[LinearKernel, ...] = ("auto", "panels", "onednn", "blas")

Product = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""``product(rows, weight, bias)``: ``rows @ weight.T (+ bias)``."""

ONEDNN_PADDINGS = (RowPadding(minimum=2, multiple=8), RowPadding(minimum=16, multiple=16),
                   RowPadding(minimum=64, multiple=64))
"""The paddings oneDNN products may use, cheapest first: at least 2 rows, larger counts rounded
up to a multiple of 8 (oneDNN builds and caches one primitive per shape, ~0.5 ms each), then
coarser ones for a CPU where small counts take other paths."""

ONEDNN_ROW_PADDING = ONEDNN_PADDINGS[0]
"""The oneDNN padding this project's CPUs use (its namespaces' label: dnnl-r2x8)."""


def _blas(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(rows, weight, bias)


def _onednn(rows: torch.Tensor, weight: torch.Tensor | Panels,
            bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, Panels):  # laid out for the panel kernel by another route's engine
        weight = weight.plain()
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    return out


KERNELS: Mapping[str, Product] = {"panels": panel_product, "onednn": _onednn, "gemm": _blas,
                                  "blas": _blas}
"""The kernels by name, best first where the machine can run them."""

PANEL_PADDINGS = (RowPadding(minimum=1, multiple=1),)
"""The panel kernel's only padding: none (its rows keep their bits by construction; the
start-up search checks it anyway)."""

SHARES_DECODE_ROWS = {"panels": True, "onednn": True, "gemm": True, "blas": False}
"""Whether a kernel's decode rows join the shared product (module docstring)."""

Wider = tuple[tuple[Shape, RowPadding], ...]
"""The weight shapes whose products need more rows than the step's padding gives, each with
its own padding (found per shape on CUDA: ``find_shape_paddings``)."""


@dataclass(frozen=True, slots=True)
class RowProducts:
    """The forward's projections: one kernel, one step padding (and further ones for the
    shapes in ``wider``), decode rows shared or alone.

    Attributes:
        kernel: "onednn" or "blas" (a key of ``KERNELS``).
        padding: the row count a shared product of n rows is padded to.
        shares_decode_rows: decode (and logits) rows go into the shared product; otherwise each
            is a matrix-vector product of its own.
        product_override: the kernel's function where it is not ``KERNELS[kernel]`` (a seam:
            tests pass products that vary with the row count).
        wider: weight shapes whose shared products are padded further, each to its own
            padding's count for the step's (zero rows added, their results dropped).
    """

    kernel: str
    padding: RowPadding
    shares_decode_rows: bool
    product_override: Product | None = field(default=None, compare=False, repr=False)
    wider: Wider = ()
    _wider_of: dict[Shape, RowPadding] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_wider_of", dict(self.wider))

    @classmethod
    def of(cls, kernel: str, padding: RowPadding,
           kernels: Mapping[str, Product] = KERNELS, wider: Wider = ()) -> RowProducts:
        """``kernel``'s products under ``padding`` (and ``wider``'s for its shapes), decode
        rows shared as ``SHARES_DECODE_ROWS`` says, computed by ``kernels[kernel]``."""
        return cls(kernel=kernel, padding=padding,
                   shares_decode_rows=SHARES_DECODE_ROWS.get(kernel, False),
                   product_override=None if kernels is KERNELS else kernels[kernel],
                   wider=wider)

    @property
    def label(self) -> str:
        """Its part of the block namespace (empty for the CPU's BLAS, the earliest numerics)."""
        wider = "".join(f"+{out}x{in_}{padding.label}" for (out, in_), padding in self.wider)
        if self.kernel == "panels":  # its products, and its norms (``row_norms``)
            return f"{PANEL_NUMERICS}+{NORM_NUMERICS}-{self.padding.label}{wider}"
        if self.kernel == "onednn":
            return f"dnnl-{self.padding.label}{wider}"
        if self.kernel == "gemm":
            return f"gemm-{self.padding.label}{wider}"
        return self.padding.label + wider

    @property
    def product(self) -> Product:
        return self.product_override or KERNELS[self.kernel]

    def project(self, linear: Any, rows: torch.Tensor,
                num_shared: int) -> torch.Tensor:
        """``linear`` of ``rows``: the first ``num_shared`` in one product, each other row alone.

        ``num_shared`` is zero or a padded row count, so the shared rows keep their bits; a row
        alone is a matrix-vector product, which no other row can change."""
        weight: torch.Tensor = linear.weight
        bias: torch.Tensor | None = getattr(linear, "bias", None)
        if num_shared == rows.shape[0]:
            return self._shared(rows, weight, bias)
        out = rows.new_empty(rows.shape[0], weight.shape[0])
        if num_shared:
            out[:num_shared] = self._shared(rows[:num_shared], weight, bias)
        for row in range(num_shared, rows.shape[0]):
            torch.mv(weight, rows[row], out=out[row])
        if bias is not None:
            out[num_shared:] += bias
        return out

    def _shared(self, rows: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        """One product of ``rows`` (a count of the step's padding), padded further with zero
        rows where ``weight``'s shape keeps its rows' bits only from more."""
        padding = self._wider_of.get((weight.shape[0], weight.shape[1])) if self.wider else None
        num_rows = rows.shape[0]
        if padding is None or padding.rows_for(num_rows) == num_rows:
            return self.product(rows, weight, bias)
        padded = torch.cat([rows, rows.new_zeros(padding.rows_for(num_rows) - num_rows,
                                                 rows.shape[1])])
        return self.product(padded, weight, bias)[:num_rows]


BLAS_CPU_PRODUCTS = RowProducts(kernel="blas", padding=CPU_ROW_PADDING, shares_decode_rows=False)
"""``F.linear`` on the CPU padded as on this project's first AMD EPYC (the forward's default
when nothing was searched; the engine always searches)."""


def kernel_problem(kernel: str, device: torch.device, dtype: torch.dtype,
                   kernels: Mapping[str, Product] = KERNELS) -> str | None:
    """Why ``kernel`` cannot multiply ``dtype`` rows on ``device`` here, or None."""
    if kernel == "panels" and kernels.get(kernel) is panel_product:
        problem = panel_kernel_problem(device, dtype)
        if problem is not None:
            return problem
    if kernel == "onednn" and device.type != "cpu":
        return f"oneDNN's inner product serves the CPU, not {device.type}"
    if kernel == "gemm" and device.type != "cuda":
        return (f"decode rows join the padded product on a GPU only (on {device.type} a "
                "padded product costs its rows)")
    try:
        kernels[kernel](torch.ones(2, 8, dtype=dtype, device=device),
                        torch.ones(4, 8, dtype=dtype, device=device), None)
    except (AttributeError, RuntimeError, NotImplementedError, TypeError) as exc:
        return f"it cannot compute {str(dtype).removeprefix('torch.')} here: {_first_line(exc)}"
    return None


def onednn_problem(device: torch.device, dtype: torch.dtype = torch.float32) -> str | None:
    """Why oneDNN's inner product cannot run on ``device`` in ``dtype`` here, or None."""
    return kernel_problem("onednn", device, dtype)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _search(kernel: str, product: Product, device: torch.device,
            weights: Sequence[torch.Tensor], head: torch.Tensor, *, max_rows: int,
            max_logit_rows: int, cancelled: Callable[[], bool],
            searched: dict[Product, object]) -> tuple[RowPadding, Wider] | None:
    """The padding ``kernel``'s shared products need on these weights, and the shapes that
    need more (None: none holds); ``searched`` keeps the BLAS-style search's answer by product
    (``gemm`` and ``blas`` are both ``F.linear``: searched once)."""
    laid_out: dict[int, Panels] = {}

    def unbiased(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if product is panel_product:  # each weight laid out once for the whole search
            if id(weight) not in laid_out:
                laid_out[id(weight)] = Panels.of(weight, coded=False)
            return panel_product(rows, laid_out[id(weight)], None)
        return product(rows, weight, None)

    if kernel in ("panels", "onednn"):
        # The logits head shares the padding: its rows join the product too.
        for padding in PANEL_PADDINGS if kernel == "panels" else ONEDNN_PADDINGS:
            if all(find_row_padding(group, max_rows=most, candidates=(padding,),
                                    product=unbiased, counts=sampled_counts,
                                    cancelled=cancelled) == padding
                   for group, most in ((weights, max_rows), ([head], max_logit_rows))):
                return padding, ()
            if cancelled():
                return None
        return None
    if device.type == "cuda":  # a padding of each shape's own
        if product not in searched:
            searched[product] = find_shape_paddings(weights, max_rows=max_rows,
                                                    product=unbiased, cancelled=cancelled)
        shapes = searched[product]
        assert shapes is None or isinstance(shapes, dict)
        return None if shapes is None else step_and_wider(
            kernel, shapes, head, unbiased, max_logit_rows=max_logit_rows, cancelled=cancelled)
    if product not in searched:
        searched[product] = row_padding_for(device, weights, max_rows=max_rows,
                                            product=unbiased, cancelled=cancelled)
    found = searched[product]
    assert found is None or isinstance(found, RowPadding)
    return None if found is None else (found, ())


def step_and_wider(kernel: str, shapes: Mapping[Shape, RowPadding], head: torch.Tensor,
                   product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                   max_logit_rows: int, cancelled: Callable[[], bool] = lambda: False,
                   ) -> tuple[RowPadding, Wider] | None:
    """CUDA's products from each weight shape's own padding (``find_shape_paddings``): the
    step is padded as the cheapest of them and every other shape pads its rows further, so a
    one-row decode step multiplies one row wherever the shape allows. With ``gemm`` the logits
    rows join the product too, so the head's shape is searched as well (None: no padding
    keeps its rows)."""
    step = min(shapes.values(), key=lambda padding: padding.minimum)
    every = dict(shapes)
    if kernel == "gemm":
        head_padding = find_row_padding([head], max_rows=max_logit_rows, product=product,
                                        cancelled=cancelled)
        if head_padding is None:
            return None  # logits rows join the product too: the head must keep them
        every[(int(head.shape[0]), int(head.shape[1]))] = head_padding
    return step, tuple(sorted((shape, padding) for shape, padding in every.items()
                              if padding != step))


def candidate_row_products(device: torch.device, weights: Sequence[torch.Tensor],
                           head: torch.Tensor, *, max_rows: int, max_logit_rows: int,
                           kernel: LinearKernel = "auto",
                           kernels: Mapping[str, Product] = KERNELS,
                           cancelled: Callable[[], bool] = lambda: False) -> list[RowProducts]:
    """Every product the batched forward may use on ``device`` for these weights (their
    dtype), best first: ``each_candidate_row_products`` run to its end.

    Args:
        device: where the model runs.
        weights: one layer's projection weights (every shape the shared products use).
        head: the output projection (``lm_head``) weight.
        max_rows: the most rows one step's shared product can have.
        max_logit_rows: the most logits rows one step wants (one per running request).
        kernel: "auto" or "panels" (every kernel, best first), "onednn" (oneDNN, BLAS only
            where oneDNN cannot, with a warning) or "blas".
        kernels: the kernels by name (a seam: tests pass products that vary with the row count
            or raise, as some machines' kernels do).
        cancelled: polled during the search; True ends it early (fewer or no candidates).
    """
    return list(each_candidate_row_products(
        device, lambda: (weights, head), max_rows=max_rows, max_logit_rows=max_logit_rows,
        kernel=kernel, kernels=kernels, cancelled=cancelled))


def each_candidate_row_products(
        device: torch.device,
        plain_weights: Callable[[], tuple[Sequence[torch.Tensor], torch.Tensor]], *,
        max_rows: int, max_logit_rows: int, kernel: LinearKernel = "auto",
        kernels: Mapping[str, Product] = KERNELS,
        cancelled: Callable[[], bool] = lambda: False) -> Iterator[RowProducts]:
    """The products the batched forward may use on ``device``, best first, each searched only
    when the one before it has been given up: the engine probes each on the real weights and
    takes the first that passes (none: the serial route runs). Each kernel the machine cannot
    run, or whose rows change with the row count under every padding tried, is dropped with one
    log line naming why.

    Why one at a time: searching a kernel multiplies the logits head at many row counts, and
    oneDNN's search left ~46 MB resident and ~70 MB more at the start-up peak on SmolLM2 that a
    start whose first candidate passes never needed. ``plain_weights`` gives (one layer's
    projection weights, the logits head's) as plain tensors, called before each kernel's search
    (the caller may have laid them out for the candidate before); no reference to them is held
    while a candidate is out.
    """
    names = list(kernels)
    if kernel in ("onednn", "blas") and kernel in names:  # that one, then what follows it
        names = names[names.index(kernel):] if kernel == "onednn" else [kernel]
    searched: dict[Product, object] = {}
    for name in names:
        if cancelled():
            return
        weights, head = plain_weights()
        problem = kernel_problem(name, device, weights[0].dtype, kernels)
        found: tuple[RowPadding, Wider] | None = None
        if problem is None:
            try:
                found = _search(name, kernels[name], device, weights, head,
                                max_rows=max_rows, max_logit_rows=max(2, max_logit_rows),
                                cancelled=cancelled, searched=searched)
            except (RuntimeError, NotImplementedError, TypeError) as exc:
                problem = f"it failed on these weights: {_first_line(exc)}"
            else:
                if found is None and not cancelled():
                    problem = ("a row's bits change with the row count under every padding "
                               "tried")
        del weights, head
        if found is not None:
            yield RowProducts.of(name, found[0], kernels, wider=found[1])
        elif problem is not None:
            level = logging.WARNING if kernel == name else logging.INFO
            logger.log(level, "linear kernel %s dropped: %s", name, problem)
