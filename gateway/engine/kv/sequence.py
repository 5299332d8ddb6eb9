"""A request's KV as a block table: pages of the pool, shared where cached, its own where new.

Why a table (``tiers.page_pool``): a cached prefix is held once, in the pool, however many
requests read it. A request admitted on a hit lists the device tier's pages in its table and
copies nothing; its new tokens are written in place into pages of its own, allocated as it goes
(so it holds only what it has written); when a full page of its own becomes a cached block it
hands the page over (``block``) instead of copying it.

Copy-on-write: a page the table shares (a cached block, a page handed to the cache) is never
written. A write that lands in one -- a request continuing a shared, partly filled page, or one
that recomputes positions it already handed over -- copies that one page first. Blocks from a
slower tier, or a conversation tail, are copied into pages of the request's own (one copy, the
load itself).

Attention reads a layer through ``layer`` (``LayerPages``): the paged attention
(``gateway.engine.attention.paged``) reads the pages in place through the table; the others
take the table's pages gathered in order into one ``[kv_heads, positions, head_dim]`` tensor,
whole attention tiles long (padded with the pool's zero page).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from gateway.engine.kv.stateful_tail import StatefulTail
from tiers.page_pool import Page, PagedBlock, PagePool, gather_pages
from tiers.payload import KVBlock, KVLayout

CAPACITY_ALIGNMENT = 512
"""KV buffers hold a multiple of this many positions: what every attention backend needs (a
multiple of ``gateway.engine.attention.tiled.TILE``, and of
``gateway.engine.attention.flash.KEY_BLOCK``; each backend checks its own)."""


def pool_bytes_for(running_bytes: int) -> int:
    """A pool's bytes for ``running_bytes`` of running requests' pages, with room on top for
    pages held past a request's end for a moment (a queued disk write, a shadow sample)."""
    return running_bytes + running_bytes // 16


def distinct_held(tables: Iterable[tuple[Sequence[int], int]], page_tokens: int
                  ) -> tuple[int, int]:
    """The distinct pages of ``tables`` (each a block table's page ids and its length in
    tokens) and the tokens in them, a page several tables list counted once with the most
    tokens any of them has in it.

    The tokens are the floor of any cache that keeps each distinct token once; the pages add
    their unfilled slots (a table's last page, a partial block copied to write into). Called
    every turn of the engine: a table's full pages go into a set at once, and only its last,
    partly filled ones (and any reserved ahead) are looked at one by one.
    """
    full: set[int] = set()
    partial: dict[int, int] = {}  # page -> the most tokens a table has in it
    for ids, length in tables:
        num_full = min(len(ids), length // page_tokens)
        full.update(ids[:num_full])
        for i in range(num_full, len(ids)):
            partial[ids[i]] = max(partial.get(ids[i], 0), length - i * page_tokens)
    rest = [tokens for page, tokens in partial.items() if page not in full]
    return len(full) + len(rest), len(full) * page_tokens + sum(rest)


class LayerPages:
    """One layer of one sequence's K/V: the pool's storage of the layer and the block table.

    An attention that walks block tables reads ``key_pages``/``value_pages`` through ``table``
    in place; one that takes contiguous tensors calls ``keys``/``values``, which gather the
    pages once (a copy, kept for this step's layer only).

    Attributes:
        key_pages: the layer's K of every page, ``[kv_heads, pages, page_tokens, head_dim]``.
        value_pages: like ``key_pages``, for V.
        table: the sequence's page ids in order (int64), padded with the zero page to whole
            ``CAPACITY_ALIGNMENT`` spans.
    """

    __slots__ = ("_keys", "_values", "key_pages", "table", "value_pages")

    def __init__(self, key_pages: torch.Tensor, value_pages: torch.Tensor,
                 table: torch.Tensor) -> None:
        self.key_pages = key_pages
        self.value_pages = value_pages
        self.table = table
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    @property
    def page_tokens(self) -> int:
        return int(self.key_pages.shape[2])

    def keys(self) -> torch.Tensor:
        """``[kv_heads, len(table) * page_tokens, head_dim]`` (a gathered copy)."""
        if self._keys is None:
            self._keys = gather_pages(self.key_pages, self.table)
        return self._keys

    def values(self) -> torch.Tensor:
        if self._values is None:
            self._values = gather_pages(self.value_pages, self.table)
        return self._values


class KVSequence:
    """One request's block table over ``pool``, up to ``capacity`` tokens.

    Args:
        pool: where its pages come from.
        capacity: the most tokens this request can hold (prompt + max new tokens).
    """

    def __init__(self, pool: PagePool, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.pool = pool
        self.layout = pool.layout
        self.capacity = capacity
        self._pages: list[Page] = []
        self._own: list[bool] = []  # written in place (not shared with anything)
        self._length = 0
        self._ids: torch.Tensor | None = None  # the table padded to whole tiles, for gathers
        # (start, count, pages) -> the pool slots of positions start..start+count (CUDA writes)
        self._slots: tuple[int, int, tuple[int, ...], torch.Tensor] | None = None
        self.states: dict[int, object] = {}
        """Each recurrent layer's state at ``length`` (the slot a running sequence holds; opaque
        here, ``gateway.engine.forward.recurrent_step`` reads and writes it); a layer missing
        here is read from the last block, where it was kept."""

    @classmethod
    def alone(cls, layout: KVLayout, capacity: int, *, page_tokens: int = 64,
              device: torch.device | str = "cpu") -> KVSequence:
        """A sequence over a pool of its own, just large enough (benchmarks, oracles)."""
        pool = PagePool(layout, page_tokens=page_tokens, device=device,
                        num_pages=-(-max(1, capacity) // page_tokens))
        return cls(pool, capacity)

    @staticmethod
    def pages_for(pool: PagePool, num_tokens: int) -> int:
        """Pages a sequence of ``num_tokens`` tokens writes at most."""
        return -(-max(1, num_tokens) // pool.page_tokens)

    @staticmethod
    def nbytes_for(layout: KVLayout, num_tokens: int, *, page_tokens: int) -> int:
        """The bytes of the pages a sequence of ``num_tokens`` tokens writes at most."""
        return -(-max(1, num_tokens) // page_tokens) * layout.block_nbytes(page_tokens)

    @classmethod
    def from_blocks(cls, pool: PagePool, blocks: Sequence[KVBlock],
                    capacity: int) -> KVSequence:
        """A sequence starting with ``blocks`` (the cached prefix): the pool's own pages are
        shared, anything else is copied into pages of the sequence's own. A conversation tail
        with recurrent states last (``StatefulTail``) gives the sequence its states."""
        seq = cls(pool, capacity)
        for block in blocks:
            seq._reserve(block.num_tokens)
            page = pool.page_of(block)
            if page is not None and seq._length % pool.page_tokens == 0:
                seq._pages.append(page)
                seq._own.append(False)
                seq._ids = None
                seq._length += block.num_tokens
            else:
                seq._append_copy(block)
        if blocks and isinstance(blocks[-1], StatefulTail):  # the states at its end
            seq.states = dict(blocks[-1].states)
        return seq

    @classmethod
    def unallocated(cls, pool: PagePool) -> KVSequence:
        """A sequence with no room: a request's until its own is built."""
        seq = cls(pool, 1)
        seq.capacity = 0
        return seq

    def release(self) -> None:
        """Let go of the pages (the request has ended): the sequence is empty and has no room
        afterwards, so a late write fails loudly."""
        self._pages, self._own, self._ids = [], [], None
        self._length = 0
        self.capacity = 0
        self.states = {}

    @property
    def length(self) -> int:
        """Tokens whose K/V are complete in every layer."""
        return self._length

    @property
    def num_pages(self) -> int:
        """Pages in the table (shared and own)."""
        return len(self._pages)

    @property
    def num_own_pages(self) -> int:
        """Pages of the table that no one else holds through it (allocated or copied here)."""
        return sum(self._own)

    @property
    def page_ids(self) -> list[int]:
        return [page.id for page in self._pages]

    def _reserve(self, num_tokens: int) -> None:
        if self._length + num_tokens > self.capacity:
            raise ValueError(
                f"{num_tokens} more tokens do not fit: {self._length} held, "
                f"capacity {self.capacity}"
            )

    def _writable(self, start: int, end: int) -> None:
        """Make the pages of positions ``start..end`` the sequence's own (allocating new ones,
        copying a shared one first)."""
        bt = self.pool.page_tokens
        for index in range(start // bt, -(-end // bt)):
            if index == len(self._pages):
                # Zeroed unless these positions cover it: attention reads whole pages.
                covered = start <= index * bt and (index + 1) * bt <= end
                self._pages.append(self.pool.allocate(zeroed=not covered))
                self._own.append(True)
                self._ids = None
            elif not self._own[index]:
                kept = min(bt, max(0, start - index * bt))
                self._pages[index] = self.pool.copy_page(self._pages[index], kept)
                self._own[index] = True
                self._ids = None

    def _append_copy(self, block: KVBlock) -> None:
        """Copy ``block``'s tokens in after the held ones, into pages of the sequence's own."""
        n = block.num_tokens
        start = self._length
        self._writable(start, start + n)
        bt = self.pool.page_tokens
        if block.packed is not None and start % bt + n <= bt:  # one page: one copy
            self.pool.fill(self._pages[start // bt], block, start % bt)
            self._length += n
            return
        for layer in range(self.layout.num_layers):
            self._put(layer, start, block.keys[layer], block.values[layer])
        self._length += n

    def _put(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write one layer's K and V ``[kv_heads, n, head_dim]`` at positions ``start..start + n``.

        On CUDA a write across pages is one ``PagePool.scatter`` (launches are what a GPU step
        pays for; the slots are computed once for every layer of a step), elsewhere a copy per
        page."""
        bt = self.pool.page_tokens
        storage = self.pool.storage
        n = int(keys.shape[1])
        if storage.device.type == "cuda" and start // bt != (start + n - 1) // bt:
            self.pool.scatter(layer, self._device_slots(start, n), keys, values)
            return
        at = 0
        while at < n:
            position = start + at
            offset = position % bt
            count = min(n - at, bt - offset)
            page = self._pages[position // bt].id
            storage[layer, 0, :, page, offset:offset + count].copy_(keys[:, at:at + count])
            storage[layer, 1, :, page, offset:offset + count].copy_(values[:, at:at + count])
            at += count

    def _device_slots(self, start: int, n: int) -> torch.Tensor:
        """``_slots_of`` on the pool's device; the last answer is kept while the pages stay the
        same (every layer of a step writes the same positions)."""
        bt = self.pool.page_tokens
        pages = tuple(page.id for page in self._pages[start // bt:(start + n - 1) // bt + 1])
        cached = self._slots
        if cached is not None and cached[:3] == (start, n, pages):
            return cached[3]
        slots = self._slots_of(start, start + n).to(self.pool.device)
        self._slots = (start, n, pages, slots)
        return slots

    def _slots_of(self, start: int, end: int) -> torch.Tensor:
        """The pool slots (page id * page_tokens + offset) of positions ``start..end``, on the
        CPU; the pages must be held."""
        bt = self.pool.page_tokens
        if start // bt == (end - 1) // bt:  # one page (every decode row)
            first = self._pages[start // bt].id * bt + start % bt
            return torch.arange(first, first + end - start)
        positions = torch.arange(start, end)
        ids = torch.tensor([page.id for page in self._pages[start // bt:(end - 1) // bt + 1]],
                           dtype=torch.long)
        return ids[positions // bt - start // bt] * bt + positions % bt

    def prepare(self, num_tokens: int) -> None:
        """Hold the pages the next ``num_tokens`` tokens are written into (allocated, or copied
        where shared), so that a full pool fails this request before a step, not during it.

        Raises:
            PoolExhausted: no page is free.
        """
        end = min(self.capacity, self._length + num_tokens)
        if end > self._length:
            self._writable(self._length, end)

    def claim(self, num_tokens: int) -> torch.Tensor:
        """Make the next ``num_tokens`` positions writable (pages allocated, or copied where
        shared) and return their pool slots (page id * page_tokens + offset) on the CPU: a step
        writes every sequence's K/V of a layer in one ``PagePool.scatter`` through them, then
        ``advance``.

        Raises:
            ValueError: the tokens do not fit the sequence's capacity.
        """
        self._reserve(num_tokens)
        start = self._length
        end = start + num_tokens
        self._writable(start, end)
        return self._slots_of(start, end)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write one layer's K/V for the next ``keys.shape[1]`` tokens (after ``length``).

        Every layer must be written for the same tokens before ``advance`` makes them count.
        """
        n = int(keys.shape[1])
        self._reserve(n)
        start = self._length
        self._writable(start, start + n)
        self._put(layer, start, keys, values)

    def advance(self, num_tokens: int) -> None:
        """Count the tokens just written in every layer."""
        self._reserve(num_tokens)
        self._length += num_tokens

    def truncate(self, num_tokens: int) -> None:
        """Forget every token from ``num_tokens`` on (to recompute them, block-aligned)."""
        if not 0 <= num_tokens <= self._length:
            raise ValueError(f"cannot truncate {self._length} tokens to {num_tokens}")
        self._length = num_tokens
        self.states = {}  # read again from the blocks kept up to there

    def put_state(self, layer: int, start: int, keys: torch.Tensor,
                  values: torch.Tensor) -> None:
        """Write a recurrent layer's state, laid as K/V ``[kv_heads, rows, head_dim]``
        (``gateway.engine.forward.kept_states``), at the held positions ``start..start + rows`` of
        the page they are in, which this step writes (so its own)."""
        if not self._own[start // self.pool.page_tokens]:
            raise ValueError(f"the page of position {start} is shared: a state is kept only in "
                             "a page the sequence writes")
        self._put(layer, start, keys, values)

    def layer_state(self, layer: int, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V ``[kv_heads, rows, head_dim]`` at positions ``start..start +
        rows`` of one held page (a copy): where a block keeps a recurrent layer's state."""
        bt = self.pool.page_tokens
        if start % bt + rows > bt or start + rows > len(self._pages) * bt:
            raise ValueError(f"positions {start}..{start + rows} are not in one held page")
        page = self._pages[start // bt].id
        storage = self.pool.storage
        at = start % bt
        return (storage[layer, 0, :, page, at:at + rows].clone(),
                storage[layer, 1, :, page, at:at + rows].clone())

    def _table(self) -> torch.Tensor:
        """The page ids, padded with the zero page to whole ``CAPACITY_ALIGNMENT`` spans."""
        if self._ids is None:
            bt = self.pool.page_tokens
            span = -(-max(1, len(self._pages) * bt) // CAPACITY_ALIGNMENT) * CAPACITY_ALIGNMENT
            num = -(-span // bt)
            ids = [page.id for page in self._pages] + [0] * (num - len(self._pages))
            self._ids = torch.tensor(ids, dtype=torch.long, device=self.pool.device)
        return self._ids

    def layer(self, layer: int) -> LayerPages:
        """One layer's K/V as attention reads them: the pool's pages and this table."""
        key_pages, value_pages = self.pool.layer_views[layer]
        return LayerPages(key_pages, value_pages, self._table())

    def key_buffer(self, layer: int) -> torch.Tensor:
        """One layer's K for every page in the table, whole attention tiles long (a gathered
        copy; positions not written are zero)."""
        return self.pool.gather(layer, 0, self._table())

    def value_buffer(self, layer: int) -> torch.Tensor:
        return self.pool.gather(layer, 1, self._table())

    def keys(self, layer: int) -> torch.Tensor:
        """One layer's K for the tokens held ``[kv_heads, length, head_dim]`` (a copy)."""
        return self.key_buffer(layer)[:, : self._length]

    def values(self, layer: int) -> torch.Tensor:
        return self.value_buffer(layer)[:, : self._length]

    def block(self, index: int, block_tokens: int) -> KVBlock:
        """Full block ``index`` for storage in a tier: its page itself where blocks are pages
        (handed over: the sequence never writes it again), else a fresh copy."""
        start, end = index * block_tokens, (index + 1) * block_tokens
        if end > self._length:
            raise ValueError(f"block {index} is not complete ({self._length} tokens held)")
        if block_tokens != self.pool.page_tokens:
            return self.span(start, end)
        self._own[index] = False
        block: PagedBlock = self.pool.block(self._pages[index])
        return block

    def span(self, start: int, end: int) -> KVBlock:
        """A fresh, contiguous copy of the K/V of positions ``start`` to ``end`` (held ones)."""
        if not 0 <= start < end <= self._length:
            raise ValueError(f"positions {start}..{end} are not held ({self._length} tokens)")
        bt = self.pool.page_tokens
        first = start // bt
        ids = torch.tensor(self.page_ids[first:-(-end // bt)], dtype=torch.long,
                           device=self.pool.device)
        at, to = start - first * bt, end - first * bt
        layers = range(self.layout.num_layers)
        return KVBlock(
            keys=tuple(self.pool.gather(i, 0, ids)[:, at:to].clone() for i in layers),
            values=tuple(self.pool.gather(i, 1, ids)[:, at:to].clone() for i in layers),
        )
