"""Which route the engine computes on, found on this machine: every candidate forward is tried
on the real weights, best first, and the first the start-up probe finds invariant serves.

Why a search and not a table: whether a row's bits survive batching depends on the kernels
torch picks for these shapes, in this dtype, on this CPU or GPU (docs/design.md, "Parity"); a table
measured on one machine was wrong on the next (an Intel Xeon with AMX needed other row counts
than the AMD EPYC it was measured on; an AVX2 CPU has no bfloat16 inner product in oneDNN).
The candidates are the linear kernels with the padding their search found
(``gateway.engine.linear.row_products``) crossed with the attentions the device can run (the
fixed-shape flash kernel, then the tiled one). Where none passes, the serial exact route serves
and says why. ``RouteVerdict`` is what the search decided, small enough to be remembered
(``gateway.engine.parity.verdicts``) so that a second start on the same machine skips it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gateway.engine.attention.flash import WINDOW_PROBLEM as FLASH_WINDOW_PROBLEM
from gateway.engine.attention.flash import FlashBlockAttention, flash_kernel_problem
from gateway.engine.attention.paged import PagedAttention, paged_kernel_problem
from gateway.engine.attention.tiled import SequenceAttention, TiledAttention
from gateway.engine.attention.triton_paged import TritonPagedAttention, triton_attention_problem
from gateway.engine.forward.batched import (
    ATTENTION_PROJECTIONS,
    MLP_PROJECTIONS,
    BatchedForward,
    StepForward,
    projection_weights,
)
from gateway.engine.forward.features import DecoderFeatures
from gateway.engine.linear.joined_panels import join_panels, unjoin_panels
from gateway.engine.linear.packed_weights import (
    LAYOUTS,
    PANEL_LAYOUT,
    PackedLinear,
    Projection,
    embedding_problem,
    pack_projections,
    pack_tied_head,
    packing_problem,
    plain_weights,
    unpack_projections,
    unpack_tied_head,
    walk_projections,
)
from gateway.engine.linear.panel_products import Panels, coding_summary
from gateway.engine.linear.row_norms import swap_in_row_norms, swap_out_row_norms
from gateway.engine.linear.row_padding import CPU_ROW_PADDING, RowPadding, sampled_counts
from gateway.engine.linear.row_products import (
    KERNELS,
    LinearKernel,
    Product,
    RowProducts,
    Wider,
    each_candidate_row_products,
)
from gateway.engine.models.loading import LoadedModel, SerialForward, UnservableModel
from gateway.engine.parity.probe import ProbeCancelled, ProbeResult, probe_invariance
from tiers.payload import KVLayout

logger = logging.getLogger(__name__)

ATTENTIONS: Mapping[str, Callable[[bool], SequenceAttention]] = {
    "paged": lambda decode_as_prefill: PagedAttention(),
    "flash": lambda decode_as_prefill: FlashBlockAttention(decode_as_prefill=decode_as_prefill),
    "triton": lambda decode_as_prefill: TritonPagedAttention(),
    "tiled": lambda decode_as_prefill: TiledAttention(),
}
"""The batched forward's attentions by name, best first (each probed where it can run)."""

LATENT_PROBLEM = ("the pages hold latents (multi-head latent attention), which only the tiled "
                  "attention reads, from the pages gathered")


class SearchCancelled(Exception):
    """The search was asked to stop (the process is shutting down) before it had a verdict."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRoute:
    """How this engine computes, and why.

    Attributes:
        name: "batched" (the invariant batched forward) or "serial" (transformers, one
            request at a time, block-aligned chunks).
        reason: why this route (the probe's finding, the configuration, the architecture).
        probe_s: seconds the start-up search and probe took (0 when they did not run).
        decode_kv_is_prefill_kv: decoding writes the K/V a prefill writes (the probe found), so
            an answer's blocks are stored as decoded; otherwise they are recomputed first.
        attention: the batched forward's numerics (attention and products); empty on the
            serial route.
    """

    name: str
    reason: str
    probe_s: float = 0.0
    decode_kv_is_prefill_kv: bool = False
    attention: str = ""

    @property
    def numerics(self) -> str:
        """The route's part of the block namespace (its K/V differ from the other's)."""
        return f"{self.name}-{self.attention}" if self.name == "batched" else self.name


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteVerdict:
    """What the search decided: enough to rebuild the forward without searching again.

    Attributes:
        name: "batched" or "serial".
        reason: why (as ``EngineRoute.reason``).
        kernel: the linear kernel (batched only).
        padding: its padding (batched only).
        wider: the weight shapes padded further, each with its padding (batched on CUDA).
        attention: the attention's name in ``ATTENTIONS`` (batched only).
        decode_kv_is_prefill_kv: the probe's finding.
        packed: the projections' weights are packed for the kernel (``packed_weights``): for
            oneDNN checked to give the plain weights' bits, so no part of the namespace; the
            panel kernel reads only its panels (a tied logits head with its table).
        seconds: what the search and probe took when they ran.
    """

    name: str
    reason: str
    kernel: str = ""
    padding: RowPadding | None = None
    wider: Wider = ()
    attention: str = ""
    decode_kv_is_prefill_kv: bool = False
    packed: bool = False
    seconds: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchSettings:
    """What the search depends on besides the model and the machine.

    Attributes:
        route: "auto", "batched" (even where the probe fails, warned) or "serial".
        linear_kernel: "auto", "onednn" or "blas".
        max_rows: the most rows one step's shared product can have.
        max_logit_rows: the most logits rows one step wants.
        pack_weights: oneDNN's products may read weights packed in its own layout where that
            keeps every row's bits (``gateway.engine.linear.packed_weights``).
    """

    route: str = "auto"
    linear_kernel: LinearKernel = "auto"
    max_rows: int = 1024
    max_logit_rows: int = 16
    pack_weights: bool = True


def products_note(products: RowProducts) -> str:
    """What the route's reason says of the forward's projections."""
    padding = products.padding
    if padding == RowPadding(minimum=1, multiple=1) and not products.wider:
        return (f"projections through {products.kernel}, every row of a step in one product, "
                "unpadded (decode rows too)")
    rows = ("4, 8 or 12+ rows" if padding == CPU_ROW_PADDING else
            f"at least {padding.minimum} rows, in steps of {padding.multiple}"
            + (f", exact from {padding.exact_from}" if padding.exact_from else ""))
    if products.wider:
        rows += "; " + ", ".join(f"{out}x{in_} weights from {more.minimum}"
                                 for (out, in_), more in products.wider)
    if products.shares_decode_rows:
        return (f"projections through {products.kernel}, every row of a step in one product "
                f"padded to {rows} (decode rows too)")
    return (f"projections through {products.kernel}, prefill rows padded to {rows}, decode rows "
            "alone")


def attention_problem(name: str, device: torch.device, dtype: torch.dtype,
                      head_dim: int = 64, *, windowed: bool = False,
                      latent: bool = False) -> str | None:
    """Why attention ``name`` cannot run on ``device`` in ``dtype`` for heads of ``head_dim``
    (and, ``windowed``, layers with a sliding window; ``latent``, pages holding latents), or
    None."""
    if latent and name != "tiled":
        return LATENT_PROBLEM
    if name == "flash" and windowed:
        return FLASH_WINDOW_PROBLEM
    if name == "paged":
        return paged_kernel_problem(device, dtype, head_dim)
    if name == "flash":
        return flash_kernel_problem(device)
    if name == "triton":  # CUDA only: interpreted on a CPU it is far too slow to try
        return triton_attention_problem(device) if device.type == "cuda" else "CUDA only"
    return None


def attention_names(device: torch.device, dtype: torch.dtype, head_dim: int = 64, *,
                    windowed: bool = False, latent: bool = False) -> list[str]:
    """The attentions ``device`` can run in ``dtype`` for heads of ``head_dim`` (and,
    ``windowed``, sliding windows; ``latent``, latent pages), best first (one log line for each
    it cannot)."""
    names = []
    for name in ATTENTIONS:
        problem = attention_problem(name, device, dtype, head_dim, windowed=windowed,
                                    latent=latent)
        if problem is None:
            names.append(name)
        else:
            logger.info("attention %s dropped: %s", name, problem)
    return names


def features_problem(name: str, device: torch.device, layout: KVLayout,
                     features: DecoderFeatures | None) -> str | None:
    """``attention_problem`` of attention ``name`` for a model's layout and features."""
    return attention_problem(name, device, layout.dtype, layout.head_dim,
                             windowed=features is not None and features.masks_or_scales,
                             latent=features is not None and features.has_latent)


def _parts(verdict: RouteVerdict,
           kernels: Mapping[str, Product]) -> tuple[RowProducts, SequenceAttention]:
    """The products and attention a batched verdict names."""
    assert verdict.padding is not None
    products = RowProducts.of(verdict.kernel, verdict.padding, kernels, wider=verdict.wider)
    return products, ATTENTIONS[verdict.attention](products.shares_decode_rows)


def build_forward(loaded: LoadedModel, verdict: RouteVerdict,
                  kernels: Mapping[str, Product] = KERNELS) -> StepForward:
    """The forward ``verdict`` names, on ``loaded``'s weights (packed in place where it says,
    plain again where it does not)."""
    projections = list(packable_projections(loaded.model))
    layout = LAYOUTS.get(verdict.kernel)
    if verdict.name != "batched" or not verdict.packed or layout is None:
        unpack_model(loaded)
    if verdict.name != "batched":
        if loaded.keeps_states:  # the serial route's transformers cache is not the blocks'
            raise UnservableModel(f"cannot serve {loaded.name} exactly: its recurrent layers' "
                                  f"states are kept on the batched route only ({verdict.reason})")
        return SerialForward(loaded)
    if verdict.packed and layout is not None:
        if any(isinstance(where.module, PackedLinear) and where.module.layout is not layout
               for where in projections):
            unpack_model(loaded)  # packed for another kernel by an earlier candidate
        started = time.perf_counter()
        count = pack_projections(projections, layout)
        if layout.looks_up_rows and pack_tied_head(loaded.model, layout):
            count += 1
        if count:
            logger.info("packed %d projection weights for %s in %.1f s", count, layout.name,
                        time.perf_counter() - started)
        if count and layout is PANEL_LAYOUT:
            modules: list[Any] = [where.module for where in packable_projections(loaded.model)]
            modules.append(getattr(loaded.model, "lm_head", None))  # a tied head too
            logger.info("panels: %s", coding_summary(
                w for w in (getattr(m, "weight", None) for m in modules)
                if isinstance(w, Panels)))
        if layout is PANEL_LAYOUT and (groups := join_panels(loaded.model)):
            logger.info("joined %d groups of projections of the same rows (q|k|v, gate|up) "
                        "into one product each", groups)
        if layout is PANEL_LAYOUT and (norms := swap_in_row_norms(loaded.model)):
            logger.info("%d RMSNorms computed by the row kernel", norms)
    products, attention = _parts(verdict, kernels)
    return BatchedForward(loaded.model, attention, products, loaded.features)


def unpack_model(loaded: LoadedModel) -> None:
    """Put ``loaded``'s projection weights back plain, as it was loaded."""
    unjoin_panels(loaded.model)
    swap_out_row_norms(loaded.model)
    unpack_projections(packable_projections(loaded.model))
    unpack_tied_head(loaded.model)


def packable_projections(model: Any) -> list[Projection]:
    """The projections the batched forward multiplies through ``RowProducts.project`` by
    their module, which may be packed for oneDNN."""
    return list(walk_projections(model, ATTENTION_PROJECTIONS, MLP_PROJECTIONS))


def packing_verdict(loaded: LoadedModel, products: RowProducts, settings: SearchSettings,
                    kernels: Mapping[str, Product]) -> str | None:
    """Why ``products`` cannot multiply packed weights here (for oneDNN: with the plain weights'
    bits), or None (it can: for oneDNN every weight shape, every sampled row count, checked)."""
    if (products.kernel not in LAYOUTS or products.wider
            or KERNELS.get(products.kernel) is not kernels.get(products.kernel)):
        return f"{products.kernel}'s products read plain weights"
    if not settings.pack_weights:
        return "configured off (pack_weights = false)"
    if not loaded.owns_its_weights:
        return ("its weights are mapped from the checkpoint's file (loaded through "
                "transformers): each packed copy would sit beside the mapped one")
    if products.kernel == "panels":
        return embedding_problem(loaded.model, LAYOUTS["panels"])
    by_shape: dict[tuple[int, ...], torch.Tensor] = {}
    for weight in plain_weights(packable_projections(loaded.model)):
        by_shape.setdefault(tuple(weight.shape), weight)
    if not by_shape:
        return None  # packed already (a verdict rebuilt): checked when it was packed
    product = KERNELS["onednn"]
    return packing_problem(list(by_shape.values()),
                           sampled_counts(products.padding, settings.max_rows),
                           lambda rows, weight: product(rows, weight, None))


def _packed_note(kernel: str) -> str:
    if kernel == "panels":
        return "; weights laid out in its panels"
    return "; weights packed (same bits as plain)"


def route_of(verdict: RouteVerdict, kernels: Mapping[str, Product] = KERNELS) -> EngineRoute:
    """The ``EngineRoute`` a verdict serves as (its namespace part included)."""
    numerics = ""
    if verdict.name == "batched":
        products, attention = _parts(verdict, kernels)
        numerics = "-".join(part for part in (attention.numerics, products.label) if part)
    return EngineRoute(name=verdict.name, reason=verdict.reason, probe_s=verdict.seconds,
                       decode_kv_is_prefill_kv=verdict.decode_kv_is_prefill_kv,
                       attention=numerics)


def search_route(loaded: LoadedModel, settings: SearchSettings, *,
                 kernels: Mapping[str, Product] = KERNELS,
                 cancelled: Callable[[], bool] = lambda: False) -> RouteVerdict:
    """Try every candidate forward on ``loaded``'s weights here; the first invariant one wins.

    Raises:
        SearchCancelled: ``cancelled()`` said so before a verdict.
    """
    if settings.route == "serial":
        return RouteVerdict(name="serial", reason="configured (route = serial)")
    model = loaded.model
    if loaded.batched_problem is not None or loaded.features is None:
        return RouteVerdict(name="serial", reason="the batched forward cannot run this model: "
                                                  f"{loaded.batched_problem}")
    unpack_model(loaded)  # the search reads plain weights
    started = time.perf_counter()
    device = loaded.device
    logger.info("searching the row padding of each linear kernel in turn (%s, %s)", device,
                str(loaded.layout.dtype).removeprefix("torch."))

    def plain_weights_now() -> tuple[list[torch.Tensor], torch.Tensor]:
        unpack_model(loaded)  # a candidate before may have laid them out for its kernel
        return projection_weights(model), model.lm_head.weight

    candidates = each_candidate_row_products(
        device, plain_weights_now, max_rows=settings.max_rows,
        max_logit_rows=settings.max_logit_rows, kernel=settings.linear_kernel, kernels=kernels,
        cancelled=cancelled)
    attentions = attention_names(device, loaded.layout.dtype, loaded.layout.head_dim,
                                 windowed=loaded.features.masks_or_scales,
                                 latent=loaded.features.has_latent)
    first_failure: RouteVerdict | None = None
    for products in candidates:
        if cancelled():
            break
        logger.info("row padding of %s searched (%.1f s into the search): %s", products.kernel,
                    time.perf_counter() - started,
                    (products.padding.label or "r4x4e12")
                    + "".join(f" ({out}x{in_}: {more.label})"
                              for (out, in_), more in products.wider))
        packing_problem_here = packing_verdict(loaded, products, settings, kernels)
        packed = packing_problem_here is None
        if products.kernel == "panels" and not packed:  # it reads only its panels
            logger.info("linear kernel panels not tried: %s", packing_problem_here)
            continue
        if products.kernel == "onednn" and not packed:
            logger.info("projection weights left plain: %s", packing_problem_here)
        for attention_name in attentions:
            verdict = RouteVerdict(name="batched", reason="", kernel=products.kernel,
                                   padding=products.padding, wider=products.wider,
                                   attention=attention_name, packed=packed)
            forward = build_forward(loaded, verdict, kernels)
            assert isinstance(forward, BatchedForward)
            what = (f"{loaded.features.family} layers; {products_note(products)}"
                    f"{_packed_note(products.kernel) if packed else ''}; "
                    f"{attention_name} attention")
            result = _probe(forward, loaded, what, cancelled)
            seconds = time.perf_counter() - started
            if result.is_invariant:
                return RouteVerdict(
                    name="batched", kernel=products.kernel, padding=products.padding,
                    wider=products.wider, packed=packed,
                    attention=attention_name, seconds=seconds,
                    decode_kv_is_prefill_kv=result.decode_kv_is_prefill_kv,
                    reason=f"start-up probe: {result.num_checks} chunked/batched variants "
                           f"equal one-shot bit for bit; {what}")
            logger.info("the batched forward with %s is not invariant here: %s", what,
                        result.failure)
            if first_failure is None:
                first_failure = RouteVerdict(
                    name="batched", kernel=products.kernel, padding=products.padding,
                    wider=products.wider, packed=packed,
                    attention=attention_name, seconds=seconds,
                    reason=f"configured, probe FAILED: {result.failure}")
    if cancelled():
        raise SearchCancelled("the start-up search was stopped before its verdict")
    unpack_model(loaded)
    seconds = time.perf_counter() - started
    if first_failure is None:
        failure = ("no linear kernel keeps a projection row's bits whatever the row count "
                   "under any padding tried on this device")
    else:
        failure = first_failure.reason.removeprefix("configured, probe FAILED: ")
    if settings.route == "batched" and first_failure is not None:
        logger.warning("route = batched although the probe failed (%s): warm may differ "
                       "from cold", failure)
        return first_failure
    logger.warning("the batched forward is not invariant here (%s): serving one request at "
                   "a time on the serial exact route", failure)
    return RouteVerdict(name="serial", seconds=seconds,
                        reason=f"start-up probe failed: {failure}")


def _probe(forward: BatchedForward, loaded: LoadedModel, what: str,
           cancelled: Callable[[], bool]) -> ProbeResult:
    """The probe's verdict on ``forward``; a candidate that raises is not invariant (logged),
    never the end of start-up: the next candidate is tried."""
    try:
        return _run_probe(forward, loaded, what, cancelled)
    except (RuntimeError, ValueError, MemoryError, OSError) as exc:
        logger.warning("the batched forward with %s raised in the start-up probe: %s: %s",
                       what, type(exc).__name__, exc)
        return ProbeResult(is_invariant=False, num_checks=0, seconds=0.0,
                           failure=f"it raised {type(exc).__name__}: {exc}")


def _run_probe(forward: BatchedForward, loaded: LoadedModel, what: str,
               cancelled: Callable[[], bool]) -> ProbeResult:
    started = time.perf_counter()
    last_said = [started]

    def progress(done: int, total: int) -> None:
        now = time.perf_counter()
        if now - last_said[0] >= 1.0:
            logger.info("start-up probe: %d/%d checks passed (%.1f s)", done, total,
                        now - started)
            last_said[0] = now

    logger.info("start-up probe of the batched forward with %s", what)
    try:
        result = probe_invariance(forward, loaded.layout, int(loaded.model.config.vocab_size),
                                  cancelled=cancelled, on_check=progress)
    except ProbeCancelled as exc:
        raise SearchCancelled(str(exc)) from None
    logger.info("start-up probe done in %.1f s: %s", time.perf_counter() - started,
                "invariant" if result.is_invariant else "not invariant")
    return result
