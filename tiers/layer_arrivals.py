"""Host-tier hits copied into the page pool layer by layer, beside the step that reads them.

Why: on a GPU a host-tier hit of an 8k-token prefix of an 8B model moves 1 GiB from pinned
memory (~20 ms on an H100) before the step that reads it, whose 40-token suffix takes ~45 ms.
Queued on the step's own stream, the copy and the step add up. Here each layer's part of
every page of the chain is copied on a stream of its own, an event recorded after each layer,
and a step waits for layer ``i``'s event only just before layer ``i`` reads its pages
(``await_layer``): the copies of the later layers run while the earlier ones compute.

How a layer's part moves: a host slot holds one block as ``[layers, 2, kv_heads, tokens,
head_dim]``, contiguous; the pool keeps one layer's K or V of every page together
(``tiers.page_pool``). One layer of N pages is N pieces spread over the slots: one gather per
slab reads them straight from page-locked memory through a device view of the slab (a GPU
reads pinned host memory in place, by unified addressing), and one ``index_copy_`` writes them
into their pages: two launches per layer and slab, not 2 x N copies.

Who reads a page before its bytes have arrived waits for them first: a step, per layer and at
its end (``gateway.engine.forward.batched``); a captured step before its replay; a tier a page's
bytes are written to (``TierHierarchy.write`` and ``write_remote``: demotions, disk and Redis
writes); the pool's own copies out of a page (copy-on-write, gathers). Handing a page out as a
block reads nothing: the load path serves the device tier's copy of what it promoted, and the
step that reads it waits per layer. A page whose last holder lets go while copies are pending
is not handed out again until a step has waited for them (``park``). Every copy waits for the
work queued before it on the step's stream (the page's earlier owner, its slot's writer).

On a CPU the same gathers and copies run at once, in the calling thread, and nothing is
pending: the CPU tests check the indexing of the path the GPU runs, bit for bit.

Off unless ``[cache] layered_host_loads``: not yet timed on a GPU (docs/gpu.md).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tiers.copy_fence import CopyFence, CudaFence
from tiers.page_pool import PagePool


class LayeredLoadsUnavailable(RuntimeError):
    """This device cannot read pinned host memory in place; the message says why."""


@dataclass(frozen=True, slots=True)
class SlabRun:
    """The blocks of one chain that sit in one slab: ``slots[j]`` of ``slab`` goes to page
    ``pages[j]``.

    ``slab`` is the slab's typed view ``[slots, layers, 2, kv_heads, tokens, head_dim]`` in
    host memory (pinned where the pool is on a GPU)."""

    slab: torch.Tensor
    slots: Sequence[int]
    pages: Sequence[int]


class _PinnedAsDevice:
    """Pinned host bytes offered as device memory (``__cuda_array_interface__``): a CUDA tensor
    made from it reads the host bytes in place over the bus. Holds the host tensor, so the
    memory outlives every view made from it."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": (host.numel() * host.element_size(),), "typestr": "|u1",
            "data": (host.data_ptr(), False), "version": 3, "strides": None}


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (pinned, contiguous) as a tensor on the CUDA ``device`` over the same bytes.

    Raises:
        LayeredLoadsUnavailable: the tensor is not pinned, or torch refuses the view.
    """
    if not host.is_pinned():
        raise LayeredLoadsUnavailable("the host tier's memory is not pinned")
    try:
        flat = torch.as_tensor(_PinnedAsDevice(host), device=device)
    except Exception as error:
        raise LayeredLoadsUnavailable(f"no device view of pinned memory: {error}") from error
    return flat.view(host.dtype).view(host.shape)


class LayerArrivals:
    """The copies into one pool's pages still in flight, by layer (the pool's
    ``PageArrivals``).

    Args:
        pool: the pages the copies fill (the device tier's, and the running requests').

    Raises:
        LayeredLoadsUnavailable: on a GPU, a pinned test slab read in place did not give its
            bytes back (``device_view``).
    """

    def __init__(self, pool: PagePool) -> None:
        self._pool = pool
        self._device = pool.device
        self._is_cuda = pool.device.type == "cuda"
        self._stream: Any = None
        self._views: dict[int, torch.Tensor] = {}  # slab address -> its device view
        self._pending: dict[int, Any] = {}  # layer -> the event after its latest copies
        self._last: Any = None  # the event after the latest copies of every layer
        self._parked: deque[int] = deque()
        self._lock = threading.Lock()
        if self._is_cuda:
            self._stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
            self._check_reads_in_place()

    def _check_reads_in_place(self) -> None:
        probe = torch.arange(256, dtype=torch.uint8).pin_memory()
        read = device_view(probe, self._device).index_select(
            0, torch.arange(255, -1, -1, device=self._device))
        if not torch.equal(read.cpu(), probe.flip(0)):
            raise LayeredLoadsUnavailable("a read of pinned memory in place gave other bytes")

    @property
    def is_pending(self) -> bool:
        """Whether copies may still be writing pages (never on a CPU)."""
        return self._last is not None

    def fill(self, runs: Sequence[SlabRun]) -> CopyFence | None:
        """Copy every run's slots into its pages, layer by layer; on a GPU queued on this
        object's stream after the work queued so far on the current one, with the fence the
        slots' reads end at (None on a CPU: done on return)."""
        runs = [run for run in runs if run.slots]
        if not runs:
            return None
        if not self._is_cuda:
            indexed = [(run.slab, torch.tensor(run.slots), torch.tensor(run.pages))
                       for run in runs]
            for layer in range(self._pool.layout.num_layers):
                for slab, slots, pages in indexed:
                    self._copy_layer(layer, slab, slots, pages)
            return None
        with self._lock:
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(stream):
                moves = [(self._view_of(run.slab), self._indices(run.slots),
                          self._indices(run.pages)) for run in runs]
                for layer in range(self._pool.layout.num_layers):
                    for slab, slots, pages in moves:
                        self._copy_layer(layer, slab, slots, pages)
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record(stream)
                    self._pending[layer] = event
                self._last = self._pending[self._pool.layout.num_layers - 1]
                return CudaFence(self._device)

    def _copy_layer(self, layer: int, slab: torch.Tensor, slots: torch.Tensor,
                    pages: torch.Tensor) -> None:
        picked = slab[:, layer].index_select(0, slots)  # [n, 2, kv_heads, tokens, head_dim]
        self._pool.storage[layer].index_copy_(2, pages, picked.permute(1, 2, 0, 3, 4))

    def _view_of(self, slab: torch.Tensor) -> torch.Tensor:
        view = self._views.get(slab.data_ptr())
        if view is None:
            view = self._views[slab.data_ptr()] = device_view(slab, self._device)
        return view

    def _indices(self, values: Sequence[int]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.long).pin_memory()
        return host.to(self._device, non_blocking=True)

    def await_layer(self, layer: int) -> None:
        """Make the current stream wait for the copies into ``layer`` queued so far."""
        if self._last is None:
            return
        with self._lock:
            event = self._pending.pop(layer, None)
        if event is not None:
            torch.cuda.current_stream(self._device).wait_event(event)

    def await_all(self) -> None:
        """Make the current stream wait for every copy queued so far; pages parked while
        they were pending go back to the pool."""
        if self._last is not None:
            with self._lock:
                last, self._last = self._last, None
                self._pending.clear()
            if last is not None:
                torch.cuda.current_stream(self._device).wait_event(last)
        while self._parked:  # also one parked just as the last wait ended
            self._pool.release_parked(self._parked.popleft())

    def park(self, page_id: int) -> bool:
        """Keep ``page_id`` from being handed out until a step has waited for the copies in
        flight; False (nothing kept) when none are. Lock-free: a page's last handle may go in
        any thread, also in the middle of a call here."""
        if self._last is None:
            return False
        self._parked.append(page_id)
        return True
