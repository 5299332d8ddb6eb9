"""The lossy host tier: the lossy codec's bits in a quarter of the bytes, under HostStore's rules.

A block read back is exactly what a lossy disk or Redis blob of it decodes to (so which lossy
tier serves a block does not change the answer), a slot is one block's quantized payload, and
the budget, slot reuse and counters behave as ``tests/tiers/test_memory.py`` specifies them
for ``HostStore``.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from gateway.core.quantization import Quantization
from tests.tiers.conftest import TEST_SECRET, blocks_equal, seeded_block_meta, seeded_kv_block
from tiers.base import BlockMeta, BlockStore, CodecError, TierConfigError
from tiers.codec import BlockCodec, derive_mac_key
from tiers.kinds.host import HOST
from tiers.kv_quant import dequantize, quantize, quantized_bytes_per_token, supported
from tiers.page_pool import PagePool
from tiers.payload import KVBlock, KVLayout
from tiers.quantized_host import QuantizedHostStore

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float32)
BLOCK_TOKENS = 4
FORMATS: list[Quantization] = ["int8", "fp8"] if supported("fp8", "cpu") else ["int8"]
SLOT_BYTES = BLOCK_TOKENS * quantized_bytes_per_token(2, 2, 8)


def store(budget_blocks: int = 8, *, layout: KVLayout = LAYOUT,
          quantization: Quantization = "int8",
          block_tokens: int = BLOCK_TOKENS) -> QuantizedHostStore:
    slot = block_tokens * quantized_bytes_per_token(layout.num_layers, layout.kv_heads,
                                                    layout.head_dim)
    return QuantizedHostStore(name=HOST, layout=layout, block_tokens=block_tokens,
                              budget_bytes=budget_blocks * slot, quantization=quantization,
                              serve_device="cpu")


def block(seed: int, layout: KVLayout = LAYOUT) -> KVBlock:
    return seeded_kv_block(seed, layout, BLOCK_TOKENS)


def meta(seed: int) -> BlockMeta:
    return seeded_block_meta(seed, block_tokens=BLOCK_TOKENS)


def codec_round_trip(kv: KVBlock, quantization: Quantization, layout: KVLayout) -> KVBlock:
    """What the disk and Redis tiers' lossy blob of ``kv`` decodes to."""
    codec = BlockCodec(mac_key=derive_mac_key(TEST_SECRET), layout=layout,
                       block_tokens=BLOCK_TOKENS, quantize=quantization)
    return codec.decode(codec.encode(meta(0), kv), meta(0))


def dequantized(kv: KVBlock, quantization: Quantization) -> list[torch.Tensor]:
    """Each K and V tensor quantized and dequantized on its own (scales are per row)."""
    return [dequantize(*quantize(t, quantization), t.dtype) for t in (*kv.keys, *kv.values)]


def test_the_quantized_host_store_implements_the_block_store_protocol() -> None:
    assert isinstance(store(), BlockStore)


@pytest.mark.parametrize("quantization", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_reads_back_as_the_lossy_codec_decodes_it_bit_for_bit(
        quantization: Quantization, dtype: torch.dtype) -> None:
    layout = KVLayout(num_layers=2, kv_heads=2, head_dim=8, dtype=dtype)
    host = store(layout=layout, quantization=quantization)
    kv = block(1, layout)
    host.put(meta(1), kv)
    got = host.get(meta(1))
    assert got is not None and got.packed is not None
    assert got.quantization == quantization and got.keys[0].dtype == dtype
    assert blocks_equal(got, codec_round_trip(kv, quantization, layout))
    assert not blocks_equal(got, kv)  # lossy indeed: the test compares something


@pytest.mark.parametrize("quantization", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_read_into_a_page_is_dequantized_there_with_the_same_bits(
        quantization: Quantization, dtype: torch.dtype) -> None:
    layout = KVLayout(num_layers=2, kv_heads=2, head_dim=8, dtype=dtype)
    host = store(layout=layout, quantization=quantization)
    host.put(meta(1), block(1, layout))
    pool = PagePool(layout, page_tokens=BLOCK_TOKENS, num_pages=2)
    page = pool.block(pool.allocate())
    got = host.get(meta(1), into=page)
    assert got is not None and pool.page_of(got) is page.page
    assert got.quantization == quantization
    plain = host.get(meta(1))
    assert plain is not None and blocks_equal(got, plain)


def test_a_block_takes_its_quantized_payload_bytes() -> None:
    host = store()
    for i in range(3):
        host.put(meta(i), block(i))
    stats = host.stats()
    assert host.slot_bytes == SLOT_BYTES
    assert (stats.num_blocks, stats.num_bytes) == (3, 3 * SLOT_BYTES)
    assert stats.notes["quantization"] == "int8"


def test_a_block_takes_at_most_0_27_of_float32_at_head_dim_64() -> None:
    layout = KVLayout(num_layers=2, kv_heads=2, head_dim=64, dtype=torch.float32)
    host = store(layout=layout)
    host.put(meta(1), block(1, layout))
    assert host.stats().num_bytes <= 0.27 * layout.block_nbytes(BLOCK_TOKENS)


def test_puts_beyond_the_budget_are_dropped_and_counted() -> None:
    host = store(budget_blocks=2)
    for i in range(3):
        host.put(meta(i), block(i))
    stats = host.stats()
    assert stats.num_blocks == 2 and host.get(meta(2)) is None
    assert stats.notes["dropped_pool_full"] == 1 and stats.errors == 1


def test_the_budget_holds_as_many_blocks_as_whole_slots_fit() -> None:
    host = QuantizedHostStore(name=HOST, layout=LAYOUT, block_tokens=BLOCK_TOKENS,
                              budget_bytes=3 * SLOT_BYTES - 1, quantization="int8",
                              serve_device="cpu")
    for i in range(3):
        host.put(meta(i), block(i))
    assert host.stats().num_blocks == 2


def test_delete_frees_the_block_and_its_slot_for_another() -> None:
    host = store(budget_blocks=1)
    host.put(meta(1), block(1))
    host.delete(meta(1).key)
    assert not host.contains(meta(1).key)
    assert (host.stats().num_blocks, host.stats().num_bytes) == (0, 0)
    host.put(meta(2), block(2))  # the only slot, again
    assert host.contains(meta(2).key) and host.stats().notes.get("dropped_pool_full") is None


def test_freed_slots_are_reused_instead_of_allocating() -> None:
    host = store(budget_blocks=2)
    for i in range(10):
        host.put(meta(i), block(i))
        host.delete(meta(i).key)
    assert host.stats().notes["pool_bytes"] == 2 * SLOT_BYTES


def test_a_missing_block_is_a_counted_miss() -> None:
    host = store()
    assert host.get(meta(9)) is None
    assert host.stats().misses == 1


def test_a_second_put_of_a_key_keeps_the_first_block() -> None:
    host = store()
    host.put(meta(1), block(1))
    host.put(meta(1), block(2))
    got = host.get(meta(1))
    assert got is not None and blocks_equal(got, codec_round_trip(block(1), "int8", LAYOUT))
    assert (host.stats().puts, host.stats().num_blocks) == (2, 1)


def test_the_store_keeps_its_own_copy_of_a_block() -> None:
    host = store()
    kv = block(4)
    host.put(meta(4), kv)
    kv.keys[0].fill_(0.0)  # the caller's tensors are not the stored ones
    got = host.get(meta(4))
    assert got is not None and not torch.all(got.keys[0] == 0.0)


def test_a_block_read_stays_valid_after_its_slot_is_reused() -> None:
    host = store(budget_blocks=1)
    host.put(meta(6), block(6))
    got = host.get(meta(6))
    host.delete(meta(6).key)
    host.put(meta(7), block(7))  # reuses the only slot
    assert got is not None and blocks_equal(got, codec_round_trip(block(6), "int8", LAYOUT))


def test_a_block_dequantized_from_another_format_is_refused() -> None:
    if "fp8" not in FORMATS:
        pytest.skip("torch has no fp8 on the CPU")
    host = store(budget_blocks=1, quantization="int8")
    kv = block(1)
    marked = KVBlock(keys=kv.keys, values=kv.values, quantization="fp8")
    with pytest.raises(CodecError) as raised:
        host.put(meta(1), marked)
    assert raised.value.reason == "shape" and not host.contains(meta(1).key)


def test_a_block_of_another_shape_is_refused() -> None:
    other = KVLayout(num_layers=2, kv_heads=2, head_dim=16, dtype=torch.float32)
    with pytest.raises(CodecError) as raised:
        store().put(meta(1), block(1, other))
    assert raised.value.reason == "shape"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_block_that_is_not_finite_is_refused_and_its_slot_given_back(bad: float) -> None:
    host = store(budget_blocks=1)
    kv = block(1)
    kv.values[1][0, 2, 3] = bad
    with pytest.raises(CodecError) as raised:
        host.put(meta(1), kv)
    assert raised.value.reason == "shape" and not host.contains(meta(1).key)
    host.put(meta(2), block(2))  # the slot it took is free again
    assert host.contains(meta(2).key)


@pytest.mark.parametrize("quantization", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_read_back_and_put_again_does_not_drift(quantization: Quantization,
                                                         dtype: torch.dtype) -> None:
    layout = KVLayout(num_layers=2, kv_heads=2, head_dim=8, dtype=dtype)
    host = store(layout=layout, quantization=quantization)
    host.put(meta(1), block(1, layout))
    first = host.get(meta(1))
    assert first is not None
    host.put(meta(2), first)  # marked with this store's own format: accepted
    again = host.get(meta(2))
    assert again is not None and blocks_equal(again, first)


def test_an_unknown_quantization_is_a_config_error() -> None:
    with pytest.raises(TierConfigError):
        QuantizedHostStore(name=HOST, layout=LAYOUT, block_tokens=BLOCK_TOKENS,
                           budget_bytes=1 << 20, quantization="int4", serve_device="cpu")  # type: ignore[arg-type]


# ---- against a reference model -----------------------------------------------------------

CAPACITY = 3
OPS = st.lists(st.tuples(st.sampled_from(["put", "get", "delete"]),
                         st.integers(0, 5), st.integers(0, 3)), max_size=30)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, quantization=st.sampled_from(FORMATS))
def test_put_get_delete_behave_as_a_dict_of_dequantized_blocks(
        ops: list[tuple[str, int, int]], quantization: Quantization) -> None:
    """Key ``k`` names seed ``k``'s identity; a put carries block ``k * 4 + variant``, so a
    second put of a key brings other values (which the store must ignore)."""
    host = store(budget_blocks=CAPACITY, quantization=quantization)
    model: dict[int, list[torch.Tensor]] = {}
    dropped = 0
    for op, k, variant in ops:
        if op == "put":
            host.put(meta(k), block(k * 4 + variant))
            if k not in model and len(model) == CAPACITY:
                dropped += 1
            elif k not in model:
                model[k] = dequantized(block(k * 4 + variant), quantization)
        elif op == "delete":
            host.delete(meta(k).key)
            model.pop(k, None)
        else:
            got = host.get(meta(k))
            if k not in model:
                assert got is None
            else:
                assert got is not None and got.quantization == quantization
                assert all(torch.equal(g, w) for g, w in
                           zip((*got.keys, *got.values), model[k], strict=True))
    stats = host.stats()
    assert (stats.num_blocks, stats.num_bytes) == (len(model), len(model) * SLOT_BYTES)
    assert int(stats.notes.get("dropped_pool_full", 0)) == dropped
    assert all(host.contains(meta(k).key) == (k in model) for k in range(6))


# ---- on a GPU (the pinned paths, as tests/tiers/test_gpu_coherence.py runs HostStore's) -----


def on_gpu_store(budget_blocks: int) -> QuantizedHostStore:
    return QuantizedHostStore(name=HOST, layout=LAYOUT, block_tokens=BLOCK_TOKENS,
                              budget_bytes=budget_blocks * SLOT_BYTES, quantization="int8",
                              pin=True, serve_device="cuda")


def on_cpu(kv: KVBlock) -> KVBlock:
    return KVBlock(keys=tuple(t.cpu() for t in kv.keys),
                   values=tuple(t.cpu() for t in kv.values))


@pytest.mark.gpu
def test_a_block_put_from_the_gpu_reads_back_at_once_as_the_codec_decodes_it() -> None:
    host = on_gpu_store(budget_blocks=4)
    kv = block(7)
    host.put(meta(7), KVBlock(keys=tuple(t.cuda() for t in kv.keys),
                              values=tuple(t.cuda() for t in kv.values)))
    served = host.get(meta(7))
    assert served is not None and served.keys[0].is_cuda
    torch.cuda.synchronize()
    assert blocks_equal(on_cpu(served), codec_round_trip(kv, "int8", LAYOUT))


@pytest.mark.gpu
def test_a_deleted_block_slot_is_not_overwritten_under_a_copy_still_reading_it() -> None:
    for round_ in range(50):
        host = on_gpu_store(budget_blocks=1)  # one slot: the put can only reuse it
        first, second = block(2 * round_), block(2 * round_ + 1)
        host.put(meta(1), first)
        served = host.get(meta(1))
        host.delete(meta(1).key)
        host.put(meta(2), second)
        assert served is not None
        torch.cuda.synchronize()
        want = codec_round_trip(first, "int8", LAYOUT)
        assert blocks_equal(on_cpu(served), want), f"round {round_}: the slot was overwritten"
