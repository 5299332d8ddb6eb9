"""A request's block table: cached pages shared without a copy, its own written in place,
copy-on-write wherever a page is shared, pages back to the pool when the last holder lets go."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.engine.kv.sequence import KVSequence, distinct_held
from tests.copy_count import CountCopies
from tiers.page_pool import PagedBlock, PagePool, PoolExhausted
from tiers.payload import KVBlock, KVLayout, PayloadError

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32)
BLOCK = 3


def new_pool(num_pages: int = 32) -> PagePool:
    return PagePool(LAYOUT, page_tokens=BLOCK, num_pages=num_pages)


def plain_block(seed: int, tokens: int = BLOCK) -> KVBlock:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.kv_heads, tokens, LAYOUT.head_dim)
    return KVBlock(
        keys=tuple(torch.randn(shape, generator=g) for _ in range(LAYOUT.num_layers)),
        values=tuple(torch.randn(shape, generator=g) for _ in range(LAYOUT.num_layers)),
    )


def cached_pages(pool: PagePool, *seeds: int) -> list[PagedBlock]:
    """Blocks as the device tier holds them: pages of ``pool``."""
    blocks = []
    for seed in seeds:
        page = pool.allocate()
        pool.fill(page, plain_block(seed))
        blocks.append(pool.block(page))
    return blocks


def snapshot(block: KVBlock) -> KVBlock:
    return KVBlock(keys=tuple(t.clone() for t in block.keys),
                   values=tuple(t.clone() for t in block.values))


def same(a: KVBlock, b: KVBlock) -> bool:
    return all(torch.equal(x, y) for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values),
                                                 strict=True))


def fill(seq: KVSequence, n: int, value: float) -> None:
    shape = (LAYOUT.kv_heads, n, LAYOUT.head_dim)
    for layer in range(LAYOUT.num_layers):
        seq.write(layer, torch.full(shape, value), torch.full(shape, -value))
    seq.advance(n)


def test_a_hit_lists_the_cached_pages_and_copies_nothing() -> None:
    pool = new_pool()
    prefix = cached_pages(pool, 1, 2)
    in_use = pool.num_in_use
    seq = KVSequence.from_blocks(pool, prefix, capacity=4 * BLOCK)
    assert seq.page_ids == [b.page.id for b in prefix if b.page is not None]
    assert (seq.length, seq.num_own_pages, pool.num_in_use) == (2 * BLOCK, 0, in_use)


def test_concurrent_extenders_of_one_shared_prefix_never_see_each_other() -> None:
    pool = new_pool()
    prefix = cached_pages(pool, 1, 2)
    before = [snapshot(b) for b in prefix]
    both_listed = threading.Barrier(2)
    both_written = threading.Barrier(2)
    results: dict[float, KVSequence] = {}
    errors: list[BaseException] = []

    def extend(value: float) -> None:
        try:
            seq = KVSequence.from_blocks(pool, prefix, capacity=4 * BLOCK)
            both_listed.wait(timeout=10)  # both hold the prefix before either writes
            fill(seq, BLOCK, value)
            both_written.wait(timeout=10)  # both have written before either is checked
            results[value] = seq
        except BaseException as exc:  # reported by the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=extend, args=(v,)) for v in (1.0, 2.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not errors
    for value, seq in results.items():
        for layer in range(LAYOUT.num_layers):
            held = seq.keys(layer)
            assert torch.equal(held[:, :BLOCK], prefix[0].keys[layer])
            assert torch.equal(held[:, BLOCK : 2 * BLOCK], prefix[1].keys[layer])
            assert torch.all(held[:, 2 * BLOCK :] == value)
            assert torch.all(seq.values(layer)[:, 2 * BLOCK :] == -value)
    assert all(same(a, b) for a, b in zip(prefix, before, strict=True))


def test_writing_into_a_shared_partly_filled_page_copies_that_page_first() -> None:
    pool = new_pool()
    seq = KVSequence(pool, capacity=3 * BLOCK)
    fill(seq, 2 * BLOCK, 5.0)
    stored = seq.block(1, BLOCK)  # handed to the cache
    assert isinstance(stored, PagedBlock) and stored.page is not None
    kept = snapshot(stored)
    seq.truncate(BLOCK + 1)  # positions of the handed-over page are written again
    fill(seq, 2, 9.0)
    assert same(stored, kept)
    assert seq.page_ids[1] != stored.page.id
    assert torch.all(seq.keys(0)[:, BLOCK:BLOCK + 1] == 5.0)  # the copy kept what came before
    assert torch.all(seq.keys(0)[:, BLOCK + 1:BLOCK + 3] == 9.0)


def test_a_block_taken_for_storage_is_the_page_itself_not_a_copy() -> None:
    pool = new_pool()
    seq = KVSequence(pool, capacity=2 * BLOCK)
    fill(seq, BLOCK, 5.0)
    in_use = pool.num_in_use
    stored = seq.block(0, BLOCK)
    assert isinstance(stored, PagedBlock) and pool.page_of(stored) is not None
    assert stored.page is not None and stored.page.id == seq.page_ids[0]
    assert pool.num_in_use == in_use
    assert torch.all(stored.keys[0] == 5.0)
    stored.check(LAYOUT, BLOCK)


def test_blocks_from_a_slower_tier_are_copied_into_pages_of_the_sequences_own() -> None:
    pool = new_pool()
    loaded = plain_block(3)
    before = snapshot(loaded)
    seq = KVSequence.from_blocks(pool, [loaded], capacity=2 * BLOCK)
    assert seq.num_own_pages == 1
    seq.truncate(0)
    fill(seq, BLOCK, 7.0)
    assert same(loaded, before)


def test_a_tail_shorter_than_a_page_is_continued_in_a_page_of_its_own() -> None:
    pool = new_pool()
    prefix = cached_pages(pool, 1)
    tail = plain_block(4, tokens=2)
    seq = KVSequence.from_blocks(pool, [*prefix, tail], capacity=3 * BLOCK)
    fill(seq, 2, 8.0)
    keys = seq.keys(1)
    assert torch.equal(keys[:, :BLOCK], prefix[0].keys[1])
    assert torch.equal(keys[:, BLOCK:BLOCK + 2], tail.keys[1])
    assert torch.all(keys[:, BLOCK + 2:] == 8.0)


def test_a_page_goes_back_to_the_pool_only_when_its_last_holder_lets_go() -> None:
    pool = new_pool()
    seq = KVSequence(pool, capacity=2 * BLOCK)
    fill(seq, BLOCK + 1, 1.0)
    assert pool.num_in_use == 2
    stored = seq.block(0, BLOCK)  # the cache holds page 0 now too
    seq.release()
    assert pool.num_in_use == 1
    del stored
    assert pool.num_in_use == 0


def test_a_full_pool_refuses_a_page_with_a_message_naming_it() -> None:
    pool = new_pool(num_pages=2)
    seq = KVSequence(pool, capacity=4 * BLOCK)
    fill(seq, 2 * BLOCK, 1.0)
    with pytest.raises(PoolExhausted, match="all 2 KV pages"):
        seq.prepare(1)
    assert seq.length == 2 * BLOCK


def test_an_incomplete_block_cannot_be_taken() -> None:
    seq = KVSequence(new_pool(), capacity=2 * BLOCK)
    fill(seq, BLOCK - 1, 1.0)
    with pytest.raises(ValueError, match="not complete"):
        seq.block(0, BLOCK)


def test_writing_past_capacity_is_refused() -> None:
    seq = KVSequence(new_pool(), capacity=BLOCK)
    fill(seq, BLOCK, 1.0)
    with pytest.raises(ValueError, match="do not fit"):
        fill(seq, 1, 1.0)


def test_payload_check_rejects_wrong_shapes_and_dtypes() -> None:
    block = plain_block(4)
    with pytest.raises(PayloadError, match="expected"):
        block.check(LAYOUT, BLOCK + 1)
    half = KVLayout(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float16)
    with pytest.raises(PayloadError, match="float16"):
        block.check(half, BLOCK)
    three_layers = KVLayout(num_layers=3, kv_heads=2, head_dim=4, dtype=torch.float32)
    with pytest.raises(PayloadError, match="layers"):
        block.check(three_layers, BLOCK)


def test_layout_sizes() -> None:
    assert LAYOUT.bytes_per_token == 2 * 2 * 2 * 4 * 4
    assert LAYOUT.block_nbytes(BLOCK) == plain_block(0).nbytes
    two_pages = 2 * LAYOUT.block_nbytes(BLOCK)
    assert KVSequence.nbytes_for(LAYOUT, BLOCK + 1, page_tokens=BLOCK) == two_pages


def test_the_gathered_buffers_hold_the_blocks_then_zeros_to_whole_tiles() -> None:
    pool = new_pool()
    pool.fill(pool.allocate(), plain_block(9))  # a page another request wrote, freed again
    blocks = [plain_block(1), plain_block(2)]
    seq = KVSequence.from_blocks(pool, blocks, capacity=3 * BLOCK)
    fill(seq, 1, 3.0)
    for layer in range(LAYOUT.num_layers):
        buffer = seq.key_buffer(layer)
        assert buffer.shape[1] >= 512  # attention reads whole key blocks
        assert torch.equal(buffer[:, :BLOCK], blocks[0].keys[layer])
        assert torch.equal(buffer[:, BLOCK:2 * BLOCK], blocks[1].keys[layer])
        assert not buffer[:, 2 * BLOCK + 1:].any()  # finite: never another request's data
        assert not seq.value_buffer(layer)[:, 2 * BLOCK + 1:].any()


def test_an_ended_requests_sequence_lets_go_of_its_pages_and_refuses_writes() -> None:
    pool = new_pool()
    seq = KVSequence(pool, 10)
    fill(seq, 3, 1.0)
    seq.release()
    assert (seq.length, pool.num_in_use) == (0, 0)
    with pytest.raises(ValueError, match="do not fit"):
        seq.advance(1)


def test_an_unallocated_sequence_holds_nothing_and_has_no_room() -> None:
    seq = KVSequence.unallocated(new_pool())
    assert (seq.length, seq.capacity, seq.num_pages) == (0, 0, 0)
    with pytest.raises(ValueError, match="do not fit"):
        seq.advance(1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["write", "store", "truncate"]),
                          st.integers(min_value=1, max_value=7)), max_size=14))
def test_a_table_reads_back_what_a_flat_buffer_would_hold_and_stored_blocks_never_change(
        ops: list[tuple[str, int]]) -> None:
    pool = new_pool(num_pages=64)
    capacity = 40
    seq = KVSequence(pool, capacity)
    flat = torch.zeros(LAYOUT.kv_heads, capacity, LAYOUT.head_dim)  # the reference model
    stored: list[tuple[KVBlock, KVBlock]] = []
    value = 0.0
    for op, n in ops:
        if op == "write" and seq.length + n <= capacity:
            value += 1.0
            flat[:, seq.length:seq.length + n] = value
            fill(seq, n, value)
        elif op == "store" and seq.length >= BLOCK:
            index = min(n, seq.length // BLOCK) - 1
            block = seq.block(index, BLOCK)
            stored.append((block, snapshot(block)))
        elif op == "truncate":
            seq.truncate(max(0, seq.length - n))
    assert torch.equal(seq.keys(0), flat[:, :seq.length])
    assert torch.equal(seq.values(1), -flat[:, :seq.length])
    assert all(same(block, kept) for block, kept in stored)


@pytest.mark.gpu
def test_a_write_across_pages_on_cuda_lands_where_the_cpus_page_copies_put_it() -> None:
    """On CUDA a write spanning pages is one scatter; it must fill the same slots as the
    CPU's copy per page, from a position inside a page."""
    pools = [PagePool(LAYOUT, page_tokens=BLOCK, num_pages=16, device=device)
             for device in ("cpu", "cuda")]
    seqs = [KVSequence(pool, 20) for pool in pools]
    generator = torch.Generator().manual_seed(3)
    shape = (LAYOUT.kv_heads, 11, LAYOUT.head_dim)
    for n in (2, 11, 1):  # within a page, across four, then one more
        keys, values = (torch.randn(shape, generator=generator)[:, :n] for _ in range(2))
        for seq in seqs:
            for layer in range(LAYOUT.num_layers):
                seq.write(layer, keys.to(seq.pool.device), values.to(seq.pool.device))
            seq.advance(n)
    for layer in range(LAYOUT.num_layers):
        assert torch.equal(seqs[1].keys(layer).cpu(), seqs[0].keys(layer))
        assert torch.equal(seqs[1].values(layer).cpu(), seqs[0].values(layer))


def test_a_packed_block_from_a_slower_tier_is_copied_into_its_page_in_one_copy() -> None:
    pool = new_pool()
    blocks = [plain_block(seed) for seed in (1, 2, 3)]
    packed = [KVBlock.of_packed(torch.stack([torch.stack(kv) for kv in zip(b.keys, b.values,
                                                                           strict=True)]))
              for b in blocks]
    with CountCopies() as counted:
        seq = KVSequence.from_blocks(pool, packed, 4 * BLOCK)
    assert counted.copies == len(packed)  # not one per layer and kind
    for index, block in enumerate(blocks):
        assert same(seq.block(index, BLOCK), block)


def test_pages_shared_by_tables_are_held_once_with_their_tokens() -> None:
    prefix = [1, 2]  # two full pages of 3 tokens, listed by both tables
    tables = [(prefix + [3, 4], 11), (prefix + [5], 7), (prefix, 6)]
    # pages 1, 2 full; 3 full (6..9); 4 holds 2 tokens; 5 holds 1
    assert distinct_held(tables, page_tokens=BLOCK) == (5, 3 * 3 + 2 + 1)


def test_a_page_reserved_ahead_is_held_without_tokens() -> None:
    assert distinct_held([([1, 2, 3], 4)], page_tokens=BLOCK) == (3, 4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(1, 12), max_size=6, unique=True),
                          st.integers(0, 20)), max_size=5))
def test_what_is_held_matches_a_count_page_by_page(
        tables: list[tuple[list[int], int]]) -> None:
    """Against the reference: each page of each table with the tokens the table has in it,
    the most any table has kept per page."""
    filled: dict[int, int] = {}
    for ids, length in tables:
        for i, page in enumerate(ids):
            filled[page] = max(filled.get(page, 0), min(BLOCK, max(0, length - i * BLOCK)))
    assert distinct_held(tables, page_tokens=BLOCK) == (len(filled), sum(filled.values()))
