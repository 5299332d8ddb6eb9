"""Memory tiers: the device tier (where the model runs) and the host tier (CPU memory).

Device tier: payloads on the model's device (CUDA when present, else CPU). With a page pool
(``tiers.page_pool``, the engine's), every block it holds is a page of that pool: a page a
request hands over is kept as it is (no copy), a block from elsewhere (a promotion from a slower
tier) is copied into a new page, and a request that hits the block reads the page in place.
Without a pool it keeps tensors of its own (a pool page handed to it is copied out, so that the
pool never holds memory a budget does not count). Either way, blocks handed to a store are never
written again (``BlockStore``). One exception to "no copy": a payload whose memory the tier
already holds under another key (a tenant re-storing, under its own key, a block it was served
from the shared scope) is copied, so that every key the tier's budget charges is memory of its
own -- a budget charged twice for one copy would let the tier hold less than it says while it
reports more.

Host tier: CPU memory, carved out of a slab pool. With CUDA present the slabs are pinned (page-
locked) so device <-> host copies run asynchronously at full bandwidth; pinning is expensive per
allocation, so the pool allocates large slabs once and reuses fixed-size slots, never one
pinned allocation per block. Without CUDA the same pool still saves allocator churn.

NOTE: a slot is reused once its block leaves the tier, so ``HostStore.get`` never hands out
views of a slot: it copies the block to the device it serves (one copy, pinned -> GPU when
CUDA is present), and what it returns stays valid however long the caller keeps it (a disk
write queue, the device tier).

CUDA: copies from a pinned slot to the GPU are queued with ``non_blocking=True`` on the serving
device's current stream, so ``get`` returns before the bytes have moved. The returned tensors
are ready for any later work on that stream (the engine's worker uses one stream throughout);
work on another stream must ``wait_stream`` first. The slot, meanwhile, is still being read: a
fence is recorded after each such copy (``tiers.copy_fence``), and a deleted block's slot is
not handed to another block until its fences have completed (``SlabPool.give_back``). A copy
*into* a slot from the GPU the tier serves (a demotion from the device tier, on the request's
path when a hit makes room) is not waited for either: every read of the slot is a copy back to
that GPU, queued on the same stream after it, and its fence joins the slot's, so the slot is not
reused before it has been written. A copy from any other device is waited for before the block
becomes readable (an event on the source's stream, not a whole-device synchronisation).
"""

from __future__ import annotations

from abc import abstractmethod
from collections import deque
from collections.abc import Sequence

import torch

from policies.base import BlockKey
from tiers.accounting import AccountedStore, EntryT
from tiers.base import BlockMeta, StoreCounters, TierConfigError
from tiers.copy_fence import CopyFence, FenceFactory, record_fence
from tiers.layer_arrivals import LayerArrivals, SlabRun
from tiers.page_pool import PagedBlock, PagePool, PoolExhausted
from tiers.payload import KVBlock, KVLayout
from tiers.payload_format import packed_of

MAX_UNPRUNED_READS = 4
"""Fences a host slot keeps before the finished ones are dropped (``HostStore._add_read``)."""


def default_device() -> torch.device:
    """CUDA when torch sees a GPU, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class DeviceStore(AccountedStore[KVBlock]):
    """Block payloads as tensors on one device."""

    def __init__(self, *, device: torch.device | str | None = None, name: str = "device",
                 pool: PagePool | None = None) -> None:
        super().__init__(name=name)
        self.pool = pool
        if pool is not None:
            device = pool.device
        self.device = torch.device(device) if device is not None else default_device()
        self._storage_refs: dict[object, int] = {}  # page or storage address -> keys holding it

    def put(self, meta: BlockMeta, block: KVBlock) -> None:
        try:
            on_device = self._own_copy(block)
        except PoolExhausted:
            with self._lock:
                count_dropped_put(self._stats)
            return
        with self._lock:
            previous = self._entries.get(meta.key)
            if previous is not None and _storage_of(previous) == _storage_of(on_device):
                self._stats.puts += 1
                return
            if _storage_of(on_device) in self._storage_refs:
                # Held under another key already: a copy of its own.
                on_device = self._copy(on_device)
            self._hold_storage(on_device)
            if previous is None:
                self._add(meta.key, on_device)
            else:  # the same block again, in other memory: the same bytes counted
                self._entries[meta.key] = on_device
                self._release_storage(previous)
            self._stats.puts += 1

    def _own_copy(self, block: KVBlock) -> KVBlock:
        """``block`` as this tier keeps it: the pool's page itself, or a copy."""
        if self.pool is not None:
            return block if self.pool.page_of(block) is not None else self._copy(block)
        if isinstance(block, PagedBlock) or not _is_on(block, self.device):
            return _copy_to(block, self.device)
        return block

    def _copy(self, block: KVBlock) -> KVBlock:
        """A copy of ``block`` in memory of this tier's own (a new page, with a pool)."""
        if self.pool is None:
            return _copy_to(block, self.device)
        page = self.pool.allocate(zeroed=block.num_tokens < self.pool.page_tokens)
        self.pool.fill(page, block)  # every token of a full block: no zeroing first
        return self.pool.block(page)

    def _hold_storage(self, block: KVBlock) -> None:
        storage = _storage_of(block)
        self._storage_refs[storage] = self._storage_refs.get(storage, 0) + 1

    def _release_storage(self, block: KVBlock) -> None:
        storage = _storage_of(block)
        left = self._storage_refs.get(storage, 0) - 1
        if left > 0:
            self._storage_refs[storage] = left
        else:
            self._storage_refs.pop(storage, None)

    def get(self, meta: BlockMeta) -> KVBlock | None:
        with self._lock:
            return self._count_lookup(self._entries.get(meta.key))

    def _entry_bytes(self, entry: KVBlock) -> int:
        return entry.nbytes

    def _release(self, key: BlockKey, entry: KVBlock) -> None:
        self._release_storage(entry)


class SlabPool:
    """Fixed-size slots carved from large slabs allocated once (pinned when CUDA is present).

    Args:
        slot_bytes: bytes of one slot (one block's payload).
        max_slots: the most slots the pool may hold (its byte budget / slot_bytes).
        slab_bytes: bytes allocated at a time; slots never straddle slabs.
        pin: page-lock the slabs (only meaningful with CUDA).
    """

    def __init__(self, *, slot_bytes: int, max_slots: int, slab_bytes: int = 64 << 20,
                 pin: bool = False) -> None:
        if slot_bytes < 1 or max_slots < 0:
            raise TierConfigError("slot_bytes must be >= 1 and max_slots >= 0")
        self.slot_bytes = slot_bytes
        self.max_slots = max_slots
        self.slots_per_slab = max(1, slab_bytes // slot_bytes)
        self.pin = pin
        self._slabs: list[torch.Tensor] = []
        self._where: dict[int, tuple[int, int]] = {}  # slot address -> (slab, index in it)
        self._free: list[torch.Tensor] = []
        self._fenced: deque[tuple[torch.Tensor, list[CopyFence]]] = deque()  # oldest first
        self._num_slots = 0
        self.num_waits = 0
        """Times a take had to wait for a copy still reading a given-back slot."""

    @property
    def num_allocated_bytes(self) -> int:
        return sum(s.numel() for s in self._slabs)

    @property
    def num_fenced(self) -> int:
        """Slots given back whose copies are (or were, at the last look) still in flight."""
        return len(self._fenced)

    def take(self) -> torch.Tensor | None:
        """A free slot (flat uint8 tensor), or None when the pool is at ``max_slots``.

        A slot given back with copies in flight is never returned before they finish: free
        slots first, then new ones, then the oldest fenced slot once its copies are done
        (waiting for them only when nothing else is left).
        """
        self._reclaim()
        if not self._free:
            self._grow()
        if not self._free and self._fenced:
            slot, fences = self._fenced.popleft()
            self.num_waits += 1
            for fence in fences:
                fence.wait()
            return slot
        return self._free.pop() if self._free else None

    def give_back(self, slot: torch.Tensor, fences: Sequence[CopyFence] = ()) -> None:
        """Return ``slot``; with ``fences``, only for reuse once every one of them is done."""
        pending = [f for f in fences if not f.is_done()]
        if pending:
            self._fenced.append((slot, pending))
        else:
            self._free.append(slot)

    def _reclaim(self) -> None:
        """Move fenced slots whose copies have all finished to the free list."""
        still: deque[tuple[torch.Tensor, list[CopyFence]]] = deque()
        for slot, fences in self._fenced:
            pending = [f for f in fences if not f.is_done()]
            if pending:
                still.append((slot, pending))
            else:
                self._free.append(slot)
        self._fenced = still

    def _grow(self) -> None:
        count = min(self.slots_per_slab, self.max_slots - self._num_slots)
        if count <= 0:
            return
        slab = torch.empty(count * self.slot_bytes, dtype=torch.uint8, pin_memory=self.pin)
        self._slabs.append(slab)
        slots = [slab.narrow(0, i * self.slot_bytes, self.slot_bytes) for i in range(count)]
        self._where.update((slot.data_ptr(), (len(self._slabs) - 1, i))
                           for i, slot in enumerate(slots))
        self._free.extend(slots)
        self._num_slots += count

    def locate(self, slot: torch.Tensor) -> tuple[int, int]:
        """The slab ``slot`` was carved from (its number) and the slot's index in it."""
        return self._where[slot.data_ptr()]

    def slab(self, number: int) -> torch.Tensor:
        """Slab ``number``: flat bytes, ``slot_bytes`` a slot."""
        return self._slabs[number]


def count_dropped_put(stats: StoreCounters) -> None:
    """A put dropped because the tier's memory is full: an error, and ``dropped_pool_full``.
    Hold the store's lock."""
    stats.errors += 1
    stats.notes["dropped_pool_full"] = int(stats.notes.get("dropped_pool_full", 0)) + 1


def _is_same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` alike (an index left out is the current device's)."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def take_slot(pool: SlabPool, stats: StoreCounters) -> torch.Tensor | None:
    """A free slot of ``pool`` for a put; None (the put dropped, counted in ``stats``) when
    the tier's budget is full. Hold the store's lock."""
    slot = pool.take()
    if slot is None:
        count_dropped_put(stats)
    return slot


class SlabStore(AccountedStore[EntryT]):
    """An ``AccountedStore`` whose entries are slots of a ``SlabPool``: a slot left is given
    back for reuse only once the copies still reading it are done (its fences in ``_reads``).
    ``HostStore`` and ``QuantizedHostStore`` differ only in what a slot holds."""

    _pool: SlabPool
    _slot_bytes: int
    is_pinned: bool

    def __init__(self, *, name: str) -> None:
        super().__init__(name=name)
        self._reads: dict[BlockKey, list[CopyFence]] = {}  # copies from a slot in flight

    @abstractmethod
    def _slot_of(self, entry: EntryT) -> torch.Tensor:
        """The slot ``entry`` lives in."""

    def _entry_bytes(self, entry: EntryT) -> int:
        return self._slot_bytes

    def _release(self, key: BlockKey, entry: EntryT) -> None:
        self._pool.give_back(self._slot_of(entry), self._reads.pop(key, ()))

    def _notes(self) -> dict[str, int | float | str]:
        return {"pool_bytes": self._pool.num_allocated_bytes, "pinned": int(self.is_pinned),
                "slots_awaiting_copies": self._pool.num_fenced,
                "waits_for_copies": self._pool.num_waits}


class HostStore(SlabStore[tuple[torch.Tensor, KVBlock]]):
    """Block payloads in CPU memory, in slots of a slab pool.

    Args:
        layout: the model's KV layout (every block has the same size).
        block_tokens: tokens per block.
        budget_bytes: the most payload bytes held.
        pin: use pinned memory; default: whether CUDA is available.
        serve_device: where ``get`` delivers blocks (the model's device by default).
        fences: records a fence after a queued copy (``tiers.copy_fence``; tests inject
            their own).
        slab_bytes: memory allocated (and pinned) at a time.
    """

    def __init__(
        self,
        *,
        layout: KVLayout,
        block_tokens: int,
        budget_bytes: int,
        pin: bool | None = None,
        serve_device: torch.device | str | None = None,
        name: str,
        fences: FenceFactory = record_fence,
        slab_bytes: int = 64 << 20,
    ) -> None:
        super().__init__(name=name)
        self.serve_device = (
            torch.device(serve_device) if serve_device is not None else default_device()
        )
        self.layout = layout
        self.block_tokens = block_tokens
        self._layer_elems = layout.kv_heads * block_tokens * layout.head_dim
        itemsize = layout.dtype.itemsize
        self._slot_bytes = 2 * layout.num_layers * self._layer_elems * itemsize
        self.is_pinned = torch.cuda.is_available() if pin is None else pin
        self._pool = SlabPool(
            slot_bytes=self._slot_bytes,
            max_slots=budget_bytes // self._slot_bytes,
            slab_bytes=slab_bytes,
            pin=self.is_pinned,
        )
        self._fences = fences

    def _slot_of(self, entry: tuple[torch.Tensor, KVBlock]) -> torch.Tensor:
        return entry[0]

    def _views(self, slot: torch.Tensor) -> KVBlock:
        layout = self.layout
        typed = slot.view(layout.dtype).narrow(0, 0, 2 * layout.num_layers * self._layer_elems)
        return KVBlock.of_packed(typed.view(layout.num_layers, 2, layout.kv_heads,
                                            self.block_tokens, layout.head_dim))

    def put(self, meta: BlockMeta, block: KVBlock) -> None:
        with self._lock:
            if meta.key in self._entries:
                self._stats.puts += 1
                return
            slot = take_slot(self._pool, self._stats)
            if slot is None:
                return
        # The copy runs outside the lock; the block becomes readable once it is complete, or
        # at once from the GPU it serves (its readers queue after it there: see below).
        views = self._views(slot)
        source = block.any_tensor.device
        non_blocking = self.is_pinned and source.type == "cuda"
        if block.packed is not None and views.packed is not None:
            views.packed.copy_(block.packed, non_blocking=non_blocking)  # one copy
        else:
            for dst, src in zip((*views.keys, *views.values), (*block.keys, *block.values),
                                strict=True):
                dst.copy_(src, non_blocking=non_blocking)
        done = self._fences(source) if self.is_pinned else None
        in_flight: list[CopyFence] = []
        if done is not None and _is_same_device(source, self.serve_device):
            # Left in flight: every read of the slot is a copy back up queued on that device's
            # stream, after this one; the fence stays with the slot, so that it is not reused
            # before the copy has written it.
            in_flight.append(done)
        elif done is not None:
            done.wait()  # this copy only: the source device's stream, up to here
        with self._lock:
            if meta.key in self._entries:  # a concurrent put of the same block won
                self._pool.give_back(slot, in_flight)
            else:
                self._add(meta.key, (slot, views))
                if in_flight:
                    self._reads[meta.key] = in_flight
            self._stats.puts += 1

    def get(self, meta: BlockMeta, *, into: KVBlock | None = None) -> KVBlock | None:
        """A copy of the block on ``serve_device``; with ``into`` (a page of the pool the
        block is meant for, on that device), copied into it and returned as it: one copy, no
        buffer of its own."""
        return self.get_many([meta], into=() if into is None else (into,))[0]

    def get_many(self, metas: Sequence[BlockMeta], *,
                 into: Sequence[KVBlock] = ()) -> list[KVBlock | None]:
        """``get`` for a chain: block ``i`` copied into ``into[i]`` where there is one. One
        lock and, from pinned memory, one fence after the last copy for every slot read: on an
        H100 a host-tier hit of 128 blocks spent 88 us a block in ``get`` (a fence recorded
        and the slot's earlier fences queried per block), more than its copy.

        The copies are queued under the lock, each slot's fence recorded after them: a delete
        that follows hands a slot back only for reuse once the copy has read it (see the module
        docstring)."""
        out: list[KVBlock | None] = []
        arrivals = _arrivals_of(into)
        runs: dict[int, tuple[list[int], list[int]]] = {}  # slab -> (slots, pages)
        with self._lock:
            read: list[BlockKey] = []
            layered: list[BlockKey] = []
            for i, meta in enumerate(metas):
                entry = self._count_lookup(self._entries.get(meta.key))
                if entry is None:
                    out.append(None)
                    continue
                if i < len(into) and arrivals is not None:
                    slab, index = self._pool.locate(entry[0])
                    slots, pages = runs.setdefault(slab, ([], []))
                    slots.append(index)
                    pages.append(_page_id_of(into[i]))
                    out.append(into[i])
                    layered.append(meta.key)
                    continue
                if i < len(into):
                    target = packed_of(into[i])
                    target.copy_(packed_of(entry[1]), non_blocking=self.is_pinned
                                 and target.device.type == "cuda")
                    out.append(into[i])
                else:
                    out.append(_copy_to(entry[1], self.serve_device))
                read.append(meta.key)
            fence = self._fences(self.serve_device) if self.is_pinned and read else None
            if fence is not None:
                for key in read:
                    self._add_read(key, fence)
            if arrivals is not None and runs:
                # Layer by layer on the pool's own stream (``tiers.layer_arrivals``).
                fence = arrivals.fill([SlabRun(self._typed_slab(slab), slots, pages)
                                       for slab, (slots, pages) in runs.items()])
                if fence is not None:
                    for key in layered:
                        self._add_read(key, fence)
        return out

    def _typed_slab(self, number: int) -> torch.Tensor:
        """Slab ``number`` as ``[slots, layers, 2, kv_heads, tokens, head_dim]``."""
        layout = self.layout
        slab = self._pool.slab(number)
        return slab.view(layout.dtype).view(
            slab.numel() // self._slot_bytes, layout.num_layers, 2, layout.kv_heads,
            self.block_tokens, layout.head_dim)

    def _add_read(self, key: BlockKey, fence: CopyFence) -> None:
        """Keep ``fence`` with ``key``'s slot; the finished ones are dropped only once a few
        have gathered (a query is a call into the driver). Hold the lock."""
        reads = self._reads.setdefault(key, [])
        if len(reads) >= MAX_UNPRUNED_READS:
            reads[:] = [f for f in reads if not f.is_done()]
        reads.append(fence)


def _arrivals_of(into: Sequence[KVBlock]) -> LayerArrivals | None:
    """The layered copies of the pool every page of ``into`` belongs to, where that pool
    takes them (``[cache] layered_host_loads``); None: copy each block whole."""
    pools = set()
    for block in into:
        if not isinstance(block, PagedBlock) or block.page is None:
            return None
        pools.add(block.page.pool)
    if len(pools) != 1:
        return None
    arrivals = pools.pop().arrivals
    return arrivals if isinstance(arrivals, LayerArrivals) else None


def _page_id_of(block: KVBlock) -> int:
    """The id of the pool page ``block`` is."""
    assert isinstance(block, PagedBlock) and block.page is not None
    return block.page.id


def _storage_of(block: KVBlock) -> object:
    """What identifies the memory behind a block: its page (every page is a view of one pool
    tensor), else the address of its first tensor's storage. Blocks that share it are one copy
    (a block's tensors are views of one buffer, or of buffers owned by that block)."""
    if isinstance(block, PagedBlock) and block.page is not None:
        return block.page
    return int(block.any_tensor.untyped_storage().data_ptr())


def _is_on(block: KVBlock, device: torch.device) -> bool:
    return _is_same_device(block.any_tensor.device, device)


def _copy_to(block: KVBlock, device: torch.device) -> KVBlock:
    """Fresh tensors on ``device`` (asynchronous from pinned memory to a GPU): one copy where
    the block is packed, else one per tensor."""
    non_blocking = (
        device.type == "cuda"
        and block.any_tensor.device.type == "cpu"
        and block.any_tensor.is_pinned()
    )
    if block.packed is not None:
        return KVBlock.of_packed(block.packed.to(device, non_blocking=non_blocking, copy=True),
                                 block.quantization)
    return KVBlock(
        keys=tuple(k.to(device, non_blocking=non_blocking, copy=True) for k in block.keys),
        values=tuple(v.to(device, non_blocking=non_blocking, copy=True) for v in block.values),
    )
