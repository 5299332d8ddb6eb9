"""BlockCodec with ``quantize``: lossy blobs that say so, and never pass for exact ones.

docs/design.md, "Lossy tiers": a quantized blob decodes to the dequantized K/V, marked with
its format; an exact codec refuses it (and a quantizing codec refuses an exact blob), an exact
codec refuses to store a dequantized block, and a lossy chain's keys and namespace differ from
the exact chain's over the same tokens, so an exact request can neither name nor verify a
lossy block -- through a real disk tier too.
"""

from __future__ import annotations

from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from gateway.core.fingerprint import (
    BlockFingerprinter,
    NamespaceSpec,
    Scope,
    derive_namespace,
    lossy_namespace,
)
from gateway.core.quantization import Quantization
from gateway.core.tokens import as_token_ids
from tests.tiers.conftest import TEST_SECRET, seeded_block_meta, seeded_kv_block
from tiers.base import BlockMeta, CodecError, TierConfigError
from tiers.codec import BlockCodec, derive_mac_key
from tiers.disk import DiskStore
from tiers.kv_quant import dequantize, quantize, supported
from tiers.payload import KVBlock, KVLayout

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float32)
BLOCK_TOKENS = 4
MAC_KEY = derive_mac_key(TEST_SECRET)
FORMATS: list[Quantization] = ["int8", "fp8"] if supported("fp8", "cpu") else ["int8"]


def codec(quantize: Quantization | None = None, *, layout: KVLayout = LAYOUT,
          block_tokens: int = BLOCK_TOKENS, compression: str = "raw") -> BlockCodec:
    return BlockCodec(mac_key=MAC_KEY, layout=layout, block_tokens=block_tokens,
                      quantize=quantize, compression=compression)  # type: ignore[arg-type]


def reason_of(call: object) -> str:
    with pytest.raises(CodecError) as raised:
        call()  # type: ignore[operator]
    return raised.value.reason


def expected_round_trip(block: KVBlock, quantization: Quantization) -> list[torch.Tensor]:
    out = []
    for tensor in (*block.keys, *block.values):
        q, scales = quantize(tensor, quantization)
        out.append(dequantize(q, scales, tensor.dtype))
    return out


def page_of_a_pool() -> KVBlock:
    """Page 1 of a ``[layers, 2, kv_heads, pages, tokens, head_dim]`` pool, as a block."""
    pool = torch.zeros((LAYOUT.num_layers, 2, LAYOUT.kv_heads, 3, BLOCK_TOKENS, LAYOUT.head_dim),
                       dtype=LAYOUT.dtype)
    return KVBlock.of_packed(pool[:, :, :, 1])


@pytest.mark.parametrize("quantization", FORMATS)
@pytest.mark.parametrize("compression", ["raw", "lz4"])
@pytest.mark.parametrize("into_a_page", [False, True], ids=["own buffer", "into a page"])
def test_a_quantized_blob_decodes_to_the_dequantized_block_marked_lossy(
        quantization: Quantization, compression: str, into_a_page: bool) -> None:
    lossy = codec(quantization, compression=compression)
    block, meta = seeded_kv_block(3), seeded_block_meta(3)
    page = page_of_a_pool() if into_a_page else None
    header, back = lossy.decode_with_header(lossy.encode(meta, block), meta, into=page)
    if page is not None:  # the page itself, its storage written in place
        assert back.packed is page.packed and back.keys is page.keys
    assert back.quantization == quantization == header.quantization == lossy.quantization
    assert header.dtype == LAYOUT.dtype
    for got, want in zip((*back.keys, *back.values), expected_round_trip(block, quantization),
                         strict=True):
        assert got.dtype == LAYOUT.dtype and got.shape == want.shape
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_round_trip_error_is_within_the_stated_bound(dtype: torch.dtype) -> None:
    layout = KVLayout(num_layers=2, kv_heads=3, head_dim=64, dtype=dtype)
    block = seeded_kv_block(5, layout, 16)
    meta = seeded_block_meta(5, block_tokens=16)
    back = codec("int8", layout=layout, block_tokens=16).decode(
        codec("int8", layout=layout, block_tokens=16).encode(meta, block), meta)
    own_rounding = 0.0 if dtype == torch.float32 else 2**-7
    for got, exact in zip((*back.keys, *back.values), (*block.keys, *block.values), strict=True):
        want = exact.float()
        amax = want.abs().amax(-1, keepdim=True)
        error = (got.float() - want).abs()
        assert bool((error <= amax / 254 * (1 + 2**-16) + want.abs() * own_rounding).all())


def test_an_int8_blob_is_at_most_0_27x_the_float32_blob_of_a_smollm2_block() -> None:
    """SmolLM2-135M's layout (30 layers, 3 KV heads, head_dim 64), 64-token blocks, headers
    included."""
    layout = KVLayout(num_layers=30, kv_heads=3, head_dim=64, dtype=torch.float32)
    block = seeded_kv_block(1, layout, 64)
    meta = seeded_block_meta(1, block_tokens=64)
    exact = len(codec(layout=layout, block_tokens=64).encode(meta, block))
    lossy = len(codec("int8", layout=layout, block_tokens=64).encode(meta, block))
    assert lossy / exact <= 0.27


# ----------------------------------------------------------------------------- separation


@pytest.mark.parametrize("quantization", FORMATS)
def test_an_exact_codec_refuses_a_quantized_blob_and_the_other_way_round(
        quantization: Quantization) -> None:
    block, meta = seeded_kv_block(2), seeded_block_meta(2)
    lossy_blob = codec(quantization).encode(meta, block)
    exact_blob = codec().encode(meta, block)
    assert reason_of(lambda: codec().decode(lossy_blob, meta)) == "shape"
    assert reason_of(lambda: codec().read_header(lossy_blob)) == "shape"
    assert reason_of(lambda: codec(quantization).decode(exact_blob, meta)) == "shape"


@pytest.mark.skipif(len(FORMATS) < 2, reason="no fp8 casts on this CPU")
def test_one_lossy_format_is_not_read_as_another() -> None:
    block, meta = seeded_kv_block(2), seeded_block_meta(2)
    assert reason_of(lambda: codec("int8").decode(codec("fp8").encode(meta, block), meta)) \
        == "shape"


@pytest.mark.parametrize("quantization", FORMATS)
def test_a_dequantized_block_is_never_stored_by_an_exact_codec(
        quantization: Quantization) -> None:
    meta = seeded_block_meta(4)
    lossy = codec(quantization)
    back = lossy.decode(lossy.encode(meta, seeded_kv_block(4)), meta)
    assert reason_of(lambda: codec().encode(meta, back)) == "shape"
    lossy.encode(meta, back)  # its own tier may store it again


def test_an_int8_block_is_not_stored_as_fp8() -> None:
    meta = seeded_block_meta(4)
    back = codec("int8").decode(codec("int8").encode(meta, seeded_kv_block(4)), meta)
    if supported("fp8", "cpu"):
        assert reason_of(lambda: codec("fp8").encode(meta, back)) == "shape"


def test_a_tampered_quantized_payload_fails_its_mac() -> None:
    meta = seeded_block_meta(6)
    blob = bytearray(codec("int8").encode(meta, seeded_kv_block(6)))
    blob[-1] ^= 1
    assert reason_of(lambda: codec("int8").decode(blob, meta)) == "payload_mac"


def test_an_unknown_or_unsupported_quantization_is_a_config_error() -> None:
    with pytest.raises(TierConfigError, match="unknown quantize"):
        codec("int4")  # type: ignore[arg-type]
    with pytest.raises(TierConfigError, match="cannot quantize"):
        BlockCodec(mac_key=MAC_KEY, layout=LAYOUT, block_tokens=BLOCK_TOKENS, quantize="fp8",
                   device_type="no-such-device")


def spec(tenant: str = "alice") -> NamespaceSpec:
    return NamespaceSpec(deployment_secret=TEST_SECRET, model_fingerprint="model-a",
                         kv_dtype="float32", device_kind="cpu/batched",
                         scope=Scope.of_tenant(tenant))


def chain_metas(fingerprinter: BlockFingerprinter, tokens: list[int]) -> list[BlockMeta]:
    ids = as_token_ids(tokens)
    keys = fingerprinter.block_keys(ids)
    parents = [fingerprinter.root_parent, *keys[:-1]]
    return [BlockMeta(key=key, parent_key=parent,
                      namespace_digest=fingerprinter.namespace.digest, owner="alice",
                      tokens=fingerprinter.block_token_bytes(ids, i))
            for i, (key, parent) in enumerate(zip(keys, parents, strict=True))]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=BLOCK_TOKENS, max_size=6 * BLOCK_TOKENS),
       st.sampled_from(FORMATS))
def test_an_exact_request_can_neither_name_nor_verify_a_lossy_block(
        tokens: list[int], quantization: Quantization) -> None:
    exact_ns = derive_namespace(spec())
    lossy_ns = lossy_namespace(exact_ns, quantization)
    exact = chain_metas(BlockFingerprinter(exact_ns, BLOCK_TOKENS), tokens)
    lossy = chain_metas(BlockFingerprinter(lossy_ns, BLOCK_TOKENS), tokens)
    assert not {m.key for m in exact} & {m.key for m in lossy}
    lossy_codec = codec(quantization)
    for want, stored in zip(exact, lossy, strict=True):
        blob = lossy_codec.encode(stored, seeded_kv_block(1))
        # Read by an exact tier: another format. Read by the lossy tier's codec under the
        # exact identity (a bug that asked with exact keys): another key, another namespace.
        assert reason_of(lambda b=blob, w=want: codec().decode(b, w)) == "shape"
        forged = BlockMeta(key=stored.key, parent_key=stored.parent_key,
                           namespace_digest=want.namespace_digest, owner=want.owner,
                           tokens=want.tokens)
        assert reason_of(lambda b=blob, w=want: lossy_codec.decode(b, w)) == "key"
        assert reason_of(lambda b=blob, f=forged: lossy_codec.decode(b, f)) == "namespace"


def test_a_disk_tier_of_int8_blocks_serves_them_lossy_and_an_exact_disk_drops_them(
        tmp_path: Path) -> None:
    """The same directory opened by an exact tier (quantize switched off) drops the lossy
    files at start -- as a restart with another ``--dtype`` drops that dtype's blocks."""
    root = tmp_path / "kv"
    lossy_ns = lossy_namespace(derive_namespace(spec()), "int8")
    metas = [seeded_block_meta(seed, namespace_digest=lossy_ns.digest) for seed in range(3)]
    with DiskStore(root, codec("int8"), fsync=False) as store:
        for seed, meta in enumerate(metas):
            store.put(meta, seeded_kv_block(seed))
        assert store.flush(timeout_s=10)
    with DiskStore(root, codec("int8"), fsync=False) as store:
        assert len(store.take_recovered()) == 3
        back = store.get(metas[0])
        assert back is not None and back.quantization == "int8"
        assert torch.equal(back.keys[0], expected_round_trip(seeded_kv_block(0), "int8")[0])
    with DiskStore(root, codec(), fsync=False) as store:
        assert store.take_recovered() == []
        assert store.get(metas[0]) is None
        assert store.stats().verification_failures.get("shape", 0) == 3


def test_a_lossy_chain_is_per_tenant_and_per_format() -> None:
    tokens = as_token_ids(list(range(2 * BLOCK_TOKENS)))
    alice = derive_namespace(spec("alice"))
    bob = derive_namespace(spec("bob"))
    keys = {
        (name, q): tuple(BlockFingerprinter(lossy_namespace(ns, q), BLOCK_TOKENS)
                         .block_keys(tokens))
        for name, ns in (("alice", alice), ("bob", bob)) for q in ("int8", "fp8")
    }
    assert len(set(keys.values())) == 4
    assert lossy_namespace(alice, "int8").scope == alice.scope
    assert lossy_namespace(alice, "int8") == lossy_namespace(alice, "int8")
    assert not lossy_namespace(alice, "int8").exact and alice.exact
    with pytest.raises(ValueError, match="already lossy"):
        lossy_namespace(lossy_namespace(alice, "int8"), "fp8")

