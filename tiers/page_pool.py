"""One preallocated pool of KV pages per device, shared by the device tier and every request.

Why a pool: a cached prefix used to be copied into buffers of each request that read it (~10 ms
and ~78 MB for 1.7k tokens of SmolLM2 in float32, per request), so eight users under one system
prompt held eight copies of it. Here a page is one cache block (``page_tokens`` tokens) of K
and V for every layer, and the device tier's blocks *are* pages: a request that hits them puts
their ids in its block table (``gateway.engine.kv.sequence``) and copies nothing.

Layout: one tensor ``[layers, 2, kv_heads, pages, page_tokens, head_dim]`` (2: K then V), so that
one layer's K (or V) is one contiguous ``[kv_heads, pages, page_tokens, head_dim]``: attention
gathers a sequence's pages of a layer with one ``index_select`` straight into the
``[kv_heads, positions, head_dim]`` its kernels take (``gather``), and a GPU kernel reads them in
place through the block table with these strides. Each layer's K or V of a page is a
``[kv_heads, page_tokens, head_dim]`` view, the shape a ``KVBlock`` holds. NOTE: the issue that
asked for the pool preferred a page to be one contiguous region holding all layers (one copy
between host and device); measured on this CPU, gathering 27 pages of one layer out of such a
page-major tensor took 18-28 ms against 0.03 ms here, for every layer of every step, so a page
moves between tiers as one copy per layer and K/V instead.

Lifetime: a page is held by ``Page`` handles -- the device tier's block, every running request
whose table lists it, a tail, a queued disk write, a shadow sample -- and goes back to the free
list when the last handle is gone (CPython frees it at once: reference counting), so it is
never reused while anything can still read it. Page 0 is never handed out: it stays zero and
pads a gather to whole attention tiles.

Pages still being filled: with ``[cache] layered_host_loads`` a host-tier hit is copied into
its pages layer by layer on a stream of its own (``tiers.layer_arrivals``, the pool's
``arrivals``); whoever reads a page waits first (``await_layer``, ``await_all``), and a page let
go meanwhile is parked rather than handed out.

NOTE: on a CPU the tensor is allocated with ``torch.empty``: the operating system commits its
memory page by page as pages are first written, so a large budget costs nothing until used. A
page is zeroed when handed out unless its taker writes all of it at once (positions not yet
written must be finite: attention weighs them by exactly 0, and 0 * NaN is NaN).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, overload

import torch

from tiers.payload import KVBlock, KVLayout


class PageArrivals(Protocol):
    """Copies into a pool's pages still in flight (``tiers.layer_arrivals.LayerArrivals``):
    the seam the pool and its readers wait through, so the pool knows nothing of how they
    are made."""

    def await_layer(self, layer: int) -> None:
        """Make the current stream wait for the copies into ``layer`` queued so far."""
        ...

    def await_all(self) -> None:
        """Make the current stream wait for every copy queued so far; parked pages return."""
        ...

    def park(self, page_id: int) -> bool:
        """Keep ``page_id`` from being handed out while copies are in flight; False if none
        are (the page is free at once)."""
        ...


class PoolExhausted(RuntimeError):
    """Every page of the pool is held: the message says how many and of what size."""


class Page:
    """A handle on one page: the page is free again when the last handle is dropped.

    Handles are shared (a block view, a block table, a tail all hold the same one); a new
    handle is never made for a page that is still held.
    """

    __slots__ = ("__weakref__", "id", "pool")

    def __init__(self, pool: PagePool, page_id: int) -> None:
        self.pool = pool
        self.id = page_id

    def __del__(self) -> None:
        self.pool._give_back(self.id)


class LayerViews(Sequence[torch.Tensor]):
    """K (``kind`` 0) or V (1) of every layer of a page, as views made on first use.

    A block is made for every page a load fills, and most are only ever read whole (a copy
    into the page, the page id in a block table): making its 2 x layers views up front was
    52 us a block for SmolLM2's 30 layers on a 2-core AMD EPYC, and 65 us for the 1B shape's
    16 on an H100's host, per block of every 8k-token chain loaded there."""

    __slots__ = ("_kind", "_layers", "_views")

    def __init__(self, layers: torch.Tensor, kind: int) -> None:
        self._layers = layers  # [layers, 2, kv_heads, tokens, head_dim]
        self._kind = kind
        self._views: tuple[torch.Tensor, ...] | None = None

    def _made(self) -> tuple[torch.Tensor, ...]:
        views = self._views
        if views is None:  # two threads may both make them: the same views either way
            views = self._views = self._layers[:, self._kind].unbind(0)
        return views

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[torch.Tensor, ...]: ...

    def __getitem__(self, index: int | slice) -> torch.Tensor | tuple[torch.Tensor, ...]:
        return self._made()[index]

    def __len__(self) -> int:
        return int(self._layers.shape[0])

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._made())


@dataclass(frozen=True, slots=True)
class PagedBlock(KVBlock):
    """A block whose K/V are views of a pool page (shared and read-only, like every block)."""

    page: Page | None = None


class PagePool:
    """Fixed-size pages of K/V for every layer, in one tensor on one device.

    Args:
        layout: the model's KV layout.
        page_tokens: tokens per page (the cache's block size).
        num_pages: pages that can be handed out (page 0, always zero, comes on top).
        device: where the pages live (where the model runs).
    """

    def __init__(self, layout: KVLayout, *, page_tokens: int, num_pages: int,
                 device: torch.device | str = "cpu") -> None:
        if page_tokens < 1 or num_pages < 1:
            raise ValueError(f"page_tokens and num_pages must be >= 1, got {page_tokens} "
                             f"and {num_pages}")
        self.layout = layout
        self.page_tokens = page_tokens
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.storage = torch.empty(
            (layout.num_layers, 2, layout.kv_heads, num_pages + 1, page_tokens, layout.head_dim),
            dtype=layout.dtype, device=self.device)
        self.storage[:, :, :, 0].zero_()
        self.layer_views: tuple[tuple[torch.Tensor, torch.Tensor], ...] = tuple(
            (self.storage[layer, 0], self.storage[layer, 1])
            for layer in range(layout.num_layers))
        """Each layer's K and V storage ``[kv_heads, pages, page_tokens, head_dim]``, views made
        once (a step asks for them per sequence and layer: hundreds of indexing calls a step)."""
        self._free: deque[int] = deque(range(num_pages, 0, -1))
        self._lock = threading.Lock()
        self.arrivals: PageArrivals | None = None
        """Copies into pages still in flight (``tiers.layer_arrivals``); None: every copy into
        a page is queued on the stream that reads it."""

    def await_layer(self, layer: int) -> None:
        """Make the current stream wait for copies into ``layer`` of any page still in flight
        (a step, before the layer reads its pages)."""
        if self.arrivals is not None:
            self.arrivals.await_layer(layer)

    def await_all(self) -> None:
        """Make the current stream wait for every copy into a page still in flight."""
        if self.arrivals is not None:
            self.arrivals.await_all()

    @classmethod
    def for_budget(cls, layout: KVLayout, *, page_tokens: int, budget_bytes: int,
                   device: torch.device | str = "cpu") -> PagePool:
        """A pool of as many pages as ``budget_bytes`` holds (at least one)."""
        return cls(layout, page_tokens=page_tokens, device=device,
                   num_pages=max(1, budget_bytes // layout.block_nbytes(page_tokens)))

    @property
    def page_nbytes(self) -> int:
        return self.layout.block_nbytes(self.page_tokens)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, *, zeroed: bool = True) -> Page:
        """A page of one's own, zeroed unless the caller is about to write all of it.

        Raises:
            PoolExhausted: every page is held.
        """
        if not self._free and self.arrivals is not None:
            self.arrivals.await_all()  # the pages parked meanwhile come back
        with self._lock:
            try:
                page_id = self._free.pop()
            except IndexError:
                raise PoolExhausted(
                    f"all {self.num_pages} KV pages ({self.page_nbytes} bytes each) are held "
                    "by cached blocks and running requests") from None
        if zeroed:
            self.storage[:, :, :, page_id].zero_()
        return Page(self, page_id)

    def _give_back(self, page_id: int) -> None:
        # NOTE: no lock: a handle can die in any thread, also one inside ``allocate`` (its
        # last reference dropped by the collector), and deque.append is atomic.
        arrivals = self.arrivals
        if arrivals is None or not arrivals.park(page_id):
            self._free.append(page_id)

    def release_parked(self, page_id: int) -> None:
        """Hand out ``page_id`` again: the copies in flight when it was parked are waited for."""
        self._free.append(page_id)

    def block(self, page: Page) -> PagedBlock:
        """The block view of ``page``: every layer's K and V, views of the pool (no copy)."""
        self._check(page)
        layers = self.storage[:, :, :, page.id]  # [layers, 2, kv_heads, tokens, head_dim]
        return PagedBlock(keys=LayerViews(layers, 0), values=LayerViews(layers, 1),
                          packed=layers, page=page)

    def page_of(self, block: KVBlock) -> Page | None:
        """The page ``block`` is a whole view of, if it is one of this pool's; else None."""
        if (isinstance(block, PagedBlock) and block.page is not None
                and block.page.pool is self and block.num_tokens == self.page_tokens):
            return block.page
        return None

    def fill(self, page: Page, block: KVBlock, start: int = 0) -> None:
        """Copy ``block``'s tokens into ``page`` from token ``start`` on."""
        self._check(page)
        n = block.num_tokens
        if start + n > self.page_tokens:
            raise ValueError(f"{n} tokens from {start} do not fit a page of {self.page_tokens}")
        layers = self.storage[:, :, :, page.id, start:start + n]
        if isinstance(block, PagedBlock) and block.page is not None and block.page.pool is self:
            self.await_all()  # a page of this pool may still be arriving
        if block.packed is not None:
            layers.copy_(block.packed)  # one copy (launch) for the whole block
            return
        for i in range(self.layout.num_layers):
            layers[i, 0].copy_(block.keys[i])
            layers[i, 1].copy_(block.values[i])

    def copy_page(self, source: Page, num_tokens: int) -> Page:
        """A new page holding the first ``num_tokens`` tokens of ``source`` (copy-on-write)."""
        page = self.allocate(zeroed=num_tokens < self.page_tokens)
        self.await_all()  # ``source`` may still be arriving
        self.storage[:, :, :, page.id, :num_tokens].copy_(
            self.storage[:, :, :, source.id, :num_tokens])
        return page

    def scatter(self, layer: int, slots: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> None:
        """Write one layer's K and V ``[kv_heads, n, head_dim]`` of ``n`` tokens into ``slots``
        (page id * page_tokens + offset, on the pool's device): one scatter per kind however
        many sequences and pages the tokens belong to (a GPU step pays per launch)."""
        for kind, tensor in ((0, keys), (1, values)):
            part = self.storage[layer, kind]
            part.view(part.shape[0], -1, part.shape[-1]).index_copy_(1, slots,
                                                                      tensor.to(part.dtype))

    def gather(self, layer: int, kind: int, page_ids: torch.Tensor) -> torch.Tensor:
        """K (``kind`` 0) or V (1) of ``layer`` for ``page_ids`` in order, as one
        ``[kv_heads, len(page_ids) * page_tokens, head_dim]`` tensor (a copy)."""
        self.await_layer(layer)
        return gather_pages(self.storage[layer, kind], page_ids)

    def _check(self, page: Page) -> None:
        if page.pool is not self:
            raise ValueError("the page belongs to another pool")


def await_arrival(block: KVBlock) -> None:
    """Make the current stream wait for any copy still filling ``block``'s page, where it is a
    page (``tiers.layer_arrivals``): before its bytes are read into another tier."""
    if isinstance(block, PagedBlock) and block.page is not None:
        block.page.pool.await_all()


def gather_pages(pages: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """One layer's K or V ``pages`` (``[kv_heads, pages, page_tokens, head_dim]``) of
    ``page_ids`` in order, as one ``[kv_heads, len(page_ids) * page_tokens, head_dim]`` copy."""
    kv_heads, _, _, head_dim = pages.shape
    return torch.index_select(pages, 1, page_ids).view(kv_heads, -1, head_dim)
