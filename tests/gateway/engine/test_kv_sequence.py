"""Copy-on-write: requests extending a shared cached prefix never see each other's data."""

from __future__ import annotations

import threading

import pytest
import torch

from gateway.engine.kv_sequence import KVSequence
from tiers.payload import KVBlock, KVLayout, PayloadError

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32)
BLOCK = 3


def shared_block(seed: int) -> KVBlock:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.kv_heads, BLOCK, LAYOUT.head_dim)
    return KVBlock(
        keys=tuple(torch.randn(shape, generator=g) for _ in range(LAYOUT.num_layers)),
        values=tuple(torch.randn(shape, generator=g) for _ in range(LAYOUT.num_layers)),
    )


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


def test_concurrent_extenders_of_one_shared_prefix_never_see_each_other() -> None:
    prefix = [shared_block(1), shared_block(2)]
    before = [snapshot(b) for b in prefix]
    both_copied = threading.Barrier(2)
    both_written = threading.Barrier(2)
    results: dict[float, KVSequence] = {}
    errors: list[BaseException] = []

    def extend(value: float) -> None:
        try:
            seq = KVSequence.from_blocks(LAYOUT, prefix, capacity=4 * BLOCK)
            both_copied.wait(timeout=10)  # both hold the prefix before either writes
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


def test_writing_over_the_copied_prefix_never_changes_the_shared_block() -> None:
    block = shared_block(3)
    before = snapshot(block)
    seq = KVSequence.from_blocks(LAYOUT, [block], capacity=2 * BLOCK)
    seq.key_buffer(0).fill_(7.0)
    assert same(block, before)


def test_a_block_taken_for_storage_does_not_alias_the_buffer() -> None:
    seq = KVSequence(LAYOUT, capacity=2 * BLOCK)
    fill(seq, BLOCK, 5.0)
    stored = seq.block(0, BLOCK)
    seq.key_buffer(0).fill_(0.0)
    assert torch.all(stored.keys[0] == 5.0)
    assert stored.keys[0].is_contiguous()
    stored.check(LAYOUT, BLOCK)


def test_an_incomplete_block_cannot_be_taken() -> None:
    seq = KVSequence(LAYOUT, capacity=2 * BLOCK)
    fill(seq, BLOCK - 1, 1.0)
    with pytest.raises(ValueError, match="not complete"):
        seq.block(0, BLOCK)


def test_writing_past_capacity_is_refused() -> None:
    seq = KVSequence(LAYOUT, capacity=BLOCK)
    fill(seq, BLOCK, 1.0)
    with pytest.raises(ValueError, match="do not fit"):
        fill(seq, 1, 1.0)


def test_payload_check_rejects_wrong_shapes_and_dtypes() -> None:
    block = shared_block(4)
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
    assert LAYOUT.block_nbytes(BLOCK) == shared_block(0).nbytes


def test_a_sequence_from_blocks_holds_them_and_zeros_after_them() -> None:
    blocks = [shared_block(1), shared_block(2)]
    seq = KVSequence.from_blocks(LAYOUT, blocks, capacity=3 * BLOCK)
    for layer in range(LAYOUT.num_layers):
        buffer = seq.key_buffer(layer)
        assert torch.equal(buffer[:, :BLOCK], blocks[0].keys[layer])
        assert torch.equal(buffer[:, BLOCK:2 * BLOCK], blocks[1].keys[layer])
        assert not buffer[:, 2 * BLOCK:].any()  # attention reads whole key blocks: finite
        assert not seq.value_buffer(layer)[:, 2 * BLOCK:].any()


def test_an_ended_requests_sequence_lets_go_of_its_buffers_and_refuses_writes() -> None:
    seq = KVSequence(LAYOUT, 10)
    fill(seq, 3, 1.0)
    seq.release()
    assert seq.length == 0
    with pytest.raises(ValueError, match="do not fit"):
        seq.advance(1)


def test_an_unallocated_sequence_holds_nothing_and_has_no_room() -> None:
    seq = KVSequence.unallocated(LAYOUT)
    assert (seq.length, seq.capacity) == (0, 0)
    with pytest.raises(ValueError, match="do not fit"):
        seq.advance(1)
