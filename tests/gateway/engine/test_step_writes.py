"""A step's K/V go into the pool in one scatter per layer and kind, to exactly the places and
with exactly the bits that writing each sequence on its own gives; attention rows are joined
in their spans with zeros for padding."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.engine.kv.sequence import KVSequence
from gateway.engine.kv.step_writes import StepWrites, join_rows
from tests.gateway.engine.test_kv_sequence import BLOCK, LAYOUT, cached_pages, new_pool

HEADS, DIM = LAYOUT.kv_heads, LAYOUT.head_dim


def step_kv(num_rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_rows, HEADS, DIM, generator=g),
            torch.randn(num_rows, HEADS, DIM, generator=g))


def test_a_claim_names_the_pool_slots_of_the_next_positions_across_pages() -> None:
    pool = new_pool()
    seq = KVSequence(pool, 4 * BLOCK)
    slots = seq.claim(BLOCK + 2)
    pages = seq.page_ids
    want = [pages[p // BLOCK] * BLOCK + p % BLOCK for p in range(BLOCK + 2)]
    assert slots.tolist() == want
    assert seq.length == 0  # claimed, not yet counted: ``advance`` does that


def test_a_claim_into_a_shared_page_copies_it_first() -> None:
    pool = new_pool()
    shared = cached_pages(pool, 1)[0]
    seq = KVSequence.from_blocks(pool, [shared], 2 * BLOCK)
    seq.truncate(BLOCK - 1)  # the next position falls inside the shared page
    original = pool.page_of(shared)
    assert original is not None
    slots = seq.claim(1)
    assert seq.page_ids[0] != original.id
    assert slots.tolist() == [seq.page_ids[0] * BLOCK + BLOCK - 1]


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 2 * BLOCK + 1), min_size=1, max_size=5),
       held=st.lists(st.integers(0, 2 * BLOCK), min_size=5, max_size=5),
       padding=st.integers(0, 3), seed=st.integers(0, 1000))
def test_one_scatter_writes_what_each_sequence_writing_alone_writes(
        lengths: list[int], held: list[int], padding: int, seed: int) -> None:
    results = []
    for batched in (True, False):
        pool = new_pool(64)
        seqs = []
        for n, already in zip(lengths, held, strict=False):
            seq = KVSequence(pool, already + n)
            if already:
                seq.claim(already)
                seq.advance(already)
            seqs.append(seq)
        spans, at = [], 0
        for n in lengths:
            spans.append((at, at + n))
            at += n
        keys, values = step_kv(at + padding, seed)
        if batched:
            writes = StepWrites.claim(seqs, spans, torch.device("cpu"))
            assert writes is not None
            for layer in range(LAYOUT.num_layers):
                writes.write(layer, keys, values)
        else:
            for layer in range(LAYOUT.num_layers):
                for seq, (start, end) in zip(seqs, spans, strict=True):
                    seq.write(layer, keys[start:end].transpose(0, 1),
                              values[start:end].transpose(0, 1))
        for seq, n in zip(seqs, lengths, strict=True):
            seq.advance(n)
        # Only what this step wrote: the held positions were claimed, never written.
        results.append([torch.stack([seq.keys(i)[:, already:] for i in range(2)]
                                    + [seq.values(i)[:, already:] for i in range(2)])
                        for seq, already in zip(seqs, held, strict=False)])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_rows_that_are_not_consecutive_are_picked_by_index() -> None:
    pool = new_pool()
    seqs = [KVSequence(pool, BLOCK), KVSequence(pool, BLOCK)]
    spans = [(0, 2), (4, 5)]  # rows 2 and 3 are padding
    keys, values = step_kv(5, 7)
    writes = StepWrites.claim(seqs, spans, torch.device("cpu"))
    assert writes is not None and isinstance(writes.rows, torch.Tensor)
    for layer in range(LAYOUT.num_layers):
        writes.write(layer, keys, values)
    seqs[0].advance(2)
    seqs[1].advance(1)
    assert torch.equal(seqs[0].keys(0)[:, :2], keys[0:2].transpose(0, 1))
    assert torch.equal(seqs[1].keys(1)[:, :1], keys[4:5].transpose(0, 1))


def test_sequences_of_different_pools_write_on_their_own() -> None:
    seqs = [KVSequence(new_pool(), BLOCK), KVSequence(new_pool(), BLOCK)]
    assert StepWrites.claim(seqs, [(0, 1), (1, 2)], torch.device("cpu")) is None


def test_joined_rows_sit_in_their_spans_with_zeros_for_padding() -> None:
    like = torch.empty(6, HEADS, DIM)
    a, b = torch.ones(2, HEADS, DIM), 2 * torch.ones(3, HEADS, DIM)
    joined = join_rows([b, a], [(2, 5), (0, 2)], like)
    assert torch.equal(joined[0:2], a) and torch.equal(joined[2:5], b)
    assert not joined[5].any()


def test_joined_rows_with_a_gap_leave_the_gap_zero() -> None:
    like = torch.empty(5, HEADS, DIM)
    a, b = torch.ones(2, HEADS, DIM), 2 * torch.ones(1, HEADS, DIM)
    joined = join_rows([a, b], [(0, 2), (4, 5)], like)
    assert torch.equal(joined[0:2], a) and torch.equal(joined[4:5], b)
    assert not joined[2:4].any()


def test_one_item_filling_the_step_is_its_own_output() -> None:
    like = torch.empty(3, HEADS, DIM)
    out = torch.ones(3, HEADS, DIM)
    assert join_rows([out], [(0, 3)], like) is out
