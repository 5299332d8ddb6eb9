"""GPU coherence of the memory tiers (issue 11, item 3): no host slot is recycled while a copy
from it is in flight, and the tiers live where the model runs.

The slot rule is proven on any machine: ``SlabPool`` is given fences that a test completes by
hand (``HandFence``, standing in for a CUDA event). The tests marked ``gpu`` run the same rule,
and the pinned, asynchronous copies, on a real GPU (``make test-gpu``).
"""

from __future__ import annotations

import pytest
import torch

from tests.tiers.test_memory import BLOCK_TOKENS, LAYOUT, identical, make_block, make_meta
from tiers.copy_fence import CopyFence, CudaFence, record_fence
from tiers.kinds.host import HOST
from tiers.memory import DeviceStore, HostStore, SlabPool
from tiers.page_pool import PagePool
from tiers.payload import KVBlock


class HandFence:
    """A copy in flight until ``finish``; ``wait`` finishes it (as the GPU eventually would)
    and counts that someone had to wait."""

    def __init__(self) -> None:
        self.done = False
        self.num_waits = 0

    def is_done(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.num_waits += 1
        self.done = True

    def finish(self) -> None:
        self.done = True


def test_a_slot_with_a_copy_in_flight_is_not_handed_out_while_another_is_free() -> None:
    pool = SlabPool(slot_bytes=8, max_slots=2, slab_bytes=16)
    first, second = pool.take(), pool.take()
    assert first is not None and second is not None
    fence = HandFence()
    pool.give_back(first, [fence])  # a get queued a copy from it, then the block was deleted
    pool.give_back(second)
    again = pool.take()
    assert again is second and fence.num_waits == 0  # not the slot still being read


def test_a_slot_comes_back_once_its_copies_have_finished() -> None:
    pool = SlabPool(slot_bytes=8, max_slots=1)
    slot = pool.take()
    assert slot is not None
    fence = HandFence()
    pool.give_back(slot, [fence])
    assert pool.num_fenced == 1
    fence.finish()
    assert pool.take() is slot and fence.num_waits == 0  # no waiting: it had finished


def test_with_every_slot_fenced_a_take_waits_for_the_oldest_copy_first() -> None:
    pool = SlabPool(slot_bytes=8, max_slots=2, slab_bytes=16)
    old, new = pool.take(), pool.take()
    assert old is not None and new is not None
    old_fence, new_fence = HandFence(), HandFence()
    pool.give_back(old, [old_fence])
    pool.give_back(new, [new_fence])
    assert pool.take() is old  # the pool is full: wait, but for the copy issued first
    assert (old_fence.num_waits, new_fence.num_waits, pool.num_waits) == (1, 0, 1)


def test_the_cpu_records_no_fence_its_copies_are_synchronous() -> None:
    assert record_fence(torch.device("cpu")) is None


# ---- on a GPU -----------------------------------------------------------------------------


def host_on_gpu(budget_blocks: int) -> HostStore:
    return HostStore(name=HOST, layout=LAYOUT, block_tokens=BLOCK_TOKENS,
                     budget_bytes=budget_blocks * LAYOUT.block_nbytes(BLOCK_TOKENS),
                     pin=True, serve_device="cuda")


def on_cpu(block: KVBlock) -> KVBlock:
    return KVBlock(keys=tuple(t.cpu() for t in block.keys),
                   values=tuple(t.cpu() for t in block.values))


@pytest.mark.gpu
def test_a_cuda_fence_completes_after_the_copy_it_follows() -> None:
    big = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    on_gpu = big.to("cuda", non_blocking=True)
    fence = CudaFence(torch.device("cuda"))
    fence.wait()
    assert fence.is_done() and on_gpu.numel() == big.numel()


@pytest.mark.gpu
def test_a_deleted_block_slot_is_not_overwritten_under_a_copy_still_reading_it() -> None:
    """get (asynchronous copy out of the slot), delete, put another block: the put must land
    in another slot or wait, so the first get still delivers the first block's bytes."""
    for round_ in range(50):
        host = host_on_gpu(budget_blocks=1)  # one slot: the put can only reuse it
        first, second = make_block(2 * round_), make_block(2 * round_ + 1)
        host.put(make_meta(1), first)
        served = host.get(make_meta(1))
        host.delete(make_meta(1).key)
        host.put(make_meta(2), second)
        assert served is not None
        torch.cuda.synchronize()
        assert identical(on_cpu(served), first), f"round {round_}: the slot was overwritten"
        assert int(host.stats().notes["waits_for_copies"]) <= 1


@pytest.mark.gpu
def test_a_chain_read_from_the_pinned_tier_records_one_fence_for_every_slot_it_read() -> None:
    recorded: list[CopyFence] = []

    def counting(device: torch.device) -> CopyFence | None:
        fence = record_fence(device)
        if fence is not None:
            recorded.append(fence)
        return fence

    host = HostStore(name=HOST, layout=LAYOUT, block_tokens=BLOCK_TOKENS,
                     budget_bytes=8 * LAYOUT.block_nbytes(BLOCK_TOKENS), pin=True,
                     serve_device="cuda", fences=counting)
    blocks = [make_block(i) for i in range(4)]
    for i, block in enumerate(blocks):
        host.put(make_meta(i), block)
    pool = PagePool(LAYOUT, page_tokens=BLOCK_TOKENS, num_pages=4, device="cuda")
    pages = [pool.block(pool.allocate()) for _ in range(4)]
    got = host.get_many([make_meta(i) for i in range(4)], into=pages)
    assert len(recorded) == 1  # one fence after the last copy, not one per block
    for i in range(4):
        host.delete(make_meta(i).key)  # each slot waits for that fence before its reuse
    assert host.stats().notes["slots_awaiting_copies"] in (0, 4)  # 0: it had finished
    torch.cuda.synchronize()
    for block, page in zip(blocks, got, strict=True):
        assert page is not None and identical(on_cpu(page), block)


@pytest.mark.gpu
def test_a_block_put_from_the_gpu_is_readable_at_once_from_the_pinned_tier() -> None:
    host = host_on_gpu(budget_blocks=4)
    block = make_block(7)
    on_gpu = KVBlock(keys=tuple(t.cuda() for t in block.keys),
                     values=tuple(t.cuda() for t in block.values))
    host.put(make_meta(7), on_gpu)  # device -> pinned host, left in flight: reads queue after it
    served = host.get(make_meta(7))
    assert served is not None and served.keys[0].is_cuda
    torch.cuda.synchronize()
    assert identical(on_cpu(served), block)


@pytest.mark.gpu
def test_a_slot_still_being_written_from_the_gpu_is_not_reused_by_a_put_from_the_cpu() -> None:
    """put from the GPU (left in flight), delete, put another block from the CPU into the one
    slot: the CPU's copy must wait for the GPU's, or the GPU's lands on top of it."""
    for round_ in range(50):
        host = host_on_gpu(budget_blocks=1)
        first, second = make_block(2 * round_), make_block(2 * round_ + 1)
        host.put(make_meta(1), KVBlock(keys=tuple(t.cuda() for t in first.keys),
                                       values=tuple(t.cuda() for t in first.values)))
        host.delete(make_meta(1).key)
        host.put(make_meta(2), second)
        served = host.get(make_meta(2))
        assert served is not None
        torch.cuda.synchronize()
        assert identical(on_cpu(served), second), f"round {round_}: the slot was overwritten"


@pytest.mark.gpu
def test_a_block_put_from_the_gpu_and_served_at_once_holds_what_was_put() -> None:
    for round_ in range(50):
        host = host_on_gpu(budget_blocks=2)
        block = make_block(round_)
        host.put(make_meta(round_), KVBlock(keys=tuple(t.cuda() for t in block.keys),
                                            values=tuple(t.cuda() for t in block.values)))
        served = host.get(make_meta(round_))
        assert served is not None
        torch.cuda.synchronize()
        assert identical(on_cpu(served), block), f"round {round_}"


@pytest.mark.gpu
def test_the_device_tier_keeps_gpu_blocks_on_the_gpu_without_copying() -> None:
    store = DeviceStore(device="cuda")
    block = make_block(3)
    on_gpu = KVBlock(keys=tuple(t.cuda() for t in block.keys),
                     values=tuple(t.cuda() for t in block.values))
    store.put(make_meta(3), on_gpu)
    got = store.get(make_meta(3))
    assert got is not None and got.keys[0].data_ptr() == on_gpu.keys[0].data_ptr()
