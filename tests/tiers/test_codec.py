"""BlockCodec: exact round trips, one test per refusal (with its reason), fuzzing.

Untrusted bytes (a half-written file, a value another deployment or an attacker wrote to
Redis) must only ever produce a ``CodecError`` -- never another exception, never a large
allocation, never code execution -- and an untouched blob must decode bit for bit.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import pickle
import struct
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import lz4.frame
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, example, given, settings

from gateway.core.fingerprint import NamespaceSpec, Scope, derive_namespace
from policies.base import BlockKey
from tests.tiers.xxh3_forgery import encode_format_1, forge_keeping_xxh3, format_1_accepts
from tiers import codec as codec_module
from tiers.base import BlockMeta, CodecError, TierConfigError
from tiers.block_format import TAGS_LEN, HeaderFields, pack_body
from tiers.block_mac import BlockMac
from tiers.codec import (
    FORMAT_VERSION,
    MAC_LEN,
    MAGIC,
    PREFIX_LEN,
    BlockCodec,
    DecodedHeader,
    derive_mac_key,
)
from tiers.payload import KVBlock, KVLayout

SECRET = b"deployment-secret-for-tests-0001"
MAC_KEY = derive_mac_key(SECRET)
OTHER_MAC_KEY = derive_mac_key(b"another-deployment-secret-00002")
LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32)
BLOCK_TOKENS = 3
FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- helpers


def make_codec(
    *,
    layout: KVLayout = LAYOUT,
    block_tokens: int = BLOCK_TOKENS,
    mac_key: bytes = MAC_KEY,
    compression: Any = "raw",
) -> BlockCodec:
    return BlockCodec(
        mac_key=mac_key, layout=layout, block_tokens=block_tokens, compression=compression
    )


def make_block(
    layout: KVLayout = LAYOUT, block_tokens: int = BLOCK_TOKENS, seed: int = 0
) -> KVBlock:
    gen = torch.Generator().manual_seed(seed)
    shape = (layout.kv_heads, block_tokens, layout.head_dim)

    def one() -> torch.Tensor:
        if layout.dtype in (torch.int8, torch.uint8):
            return torch.randint(
                -128 if layout.dtype == torch.int8 else 0,
                127,
                shape,
                generator=gen,
                dtype=layout.dtype,
            )
        return torch.randn(shape, generator=gen).to(layout.dtype)

    return KVBlock(
        keys=tuple(one() for _ in range(layout.num_layers)),
        values=tuple(one() for _ in range(layout.num_layers)),
    )


def make_meta(
    block_tokens: int = BLOCK_TOKENS,
    *,
    key: bytes = b"K" * 16,
    parent_key: bytes = b"P" * 16,
    namespace_digest: bytes = b"N" * 32,
    owner: str = "tenant-a",
    first_token: int = 7,
) -> BlockMeta:
    tokens = struct.pack(f"<{block_tokens}I", *range(first_token, first_token + block_tokens))
    return BlockMeta(
        key=BlockKey(key),
        parent_key=BlockKey(parent_key),
        namespace_digest=namespace_digest,
        owner=owner,
        tokens=tokens,
    )


def assert_bit_identical(got: KVBlock, want: KVBlock) -> None:
    assert got.num_layers == want.num_layers
    for a, b in zip((*got.keys, *got.values), (*want.keys, *want.values), strict=True):
        assert a.dtype == b.dtype
        assert a.shape == b.shape
        assert a.is_contiguous()
        assert torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8))


def refused(reason: str, call: Callable[[], object]) -> CodecError:
    with pytest.raises(CodecError) as info:
        call()
    assert info.value.reason == reason, str(info.value)
    return info.value


META = make_meta()
BLOCK = make_block()
CODEC = make_codec()
BLOB = CODEC.encode(META, BLOCK)
HEADER = CODEC.read_header(BLOB)
PAYLOAD = BLOB[HEADER.header_len :]
LZ4_CODEC = make_codec(compression="lz4")
LZ4_BLOB = LZ4_CODEC.encode(META, BLOCK)


def header_fields(**overrides: Any) -> HeaderFields:
    """The fields of BLOB's header, with some replaced (for forging with a valid MAC)."""
    fields = HeaderFields(
        dtype_code=1,
        compression_id=0,
        key=bytes(META.key),
        parent_key=bytes(META.parent_key),
        owner=META.owner.encode(),
        num_tokens=BLOCK_TOKENS,
        tokens=META.tokens,
        num_layers=LAYOUT.num_layers,
        kv_heads=LAYOUT.kv_heads,
        block_tokens=BLOCK_TOKENS,
        head_dim=LAYOUT.head_dim,
        payload_len=HEADER.payload_len,
        raw_len=HEADER.raw_len,
        namespace_digest=META.namespace_digest,
    )
    return dataclasses.replace(fields, **overrides)


def seal(body: bytes, payload: bytes, mac_key: bytes = MAC_KEY) -> bytes:
    """``body`` (a header without its tags) and ``payload`` joined with both tags, as the codec
    would write them with ``mac_key``: what someone holding the key could forge."""
    mac = BlockMac(mac_key)
    block_tag = mac.block_tag(body, [payload])
    return body + block_tag + mac.header_tag(body, block_tag) + payload


def forge(payload: bytes, *, mac_key: bytes = MAC_KEY, **overrides: Any) -> bytes:
    """A blob whose header says ``overrides`` about ``payload``, with valid tags."""
    overrides.setdefault("payload_len", len(payload))
    return seal(pack_body(header_fields(**overrides)), payload, mac_key)


def remac(blob: bytes | bytearray) -> bytes:
    """Recompute both tags of a (tampered) blob with the real key."""
    header_len = struct.unpack_from("<I", blob, 6)[0]
    return seal(bytes(blob[: header_len - TAGS_LEN]), bytes(blob[header_len:]))


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("compression", ["raw", "lz4", "auto"])
@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8],
)
def test_round_trip_is_bit_identical(dtype: torch.dtype, compression: str) -> None:
    layout = dataclasses.replace(LAYOUT, dtype=dtype)
    codec = make_codec(layout=layout, compression=compression)
    block = make_block(layout, seed=3)
    assert_bit_identical(codec.decode(codec.encode(META, block), META), block)


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="no float8 in this torch")
def test_round_trip_of_float8_is_bit_identical() -> None:
    layout = dataclasses.replace(LAYOUT, dtype=torch.float8_e4m3fn)
    codec = make_codec(layout=layout)
    block = make_block(layout)
    assert_bit_identical(codec.decode(codec.encode(META, block), META), block)


def test_round_trip_preserves_nan_payloads_bit_for_bit() -> None:
    block = make_block()
    block.keys[0].view(torch.int32)[0, 0, 0] = 0x7FC01234  # a NaN with a payload
    assert_bit_identical(CODEC.decode(CODEC.encode(META, block), META), block)


def test_round_trip_with_one_byte_keys() -> None:
    meta = make_meta(key=b"\x01", parent_key=b"\x00")
    decoded = CODEC.decode(CODEC.encode(meta, BLOCK), meta)
    assert_bit_identical(decoded, BLOCK)
    assert CODEC.read_header(CODEC.encode(meta, BLOCK)).meta == meta


def test_round_trip_of_non_contiguous_tensors() -> None:
    gen = torch.Generator().manual_seed(5)
    shape = (BLOCK_TOKENS, LAYOUT.kv_heads, LAYOUT.head_dim)
    block = KVBlock(
        keys=tuple(torch.randn(shape, generator=gen).transpose(0, 1) for _ in range(2)),
        values=tuple(torch.randn(shape, generator=gen).transpose(0, 1) for _ in range(2)),
    )
    assert not block.keys[0].is_contiguous()
    assert_bit_identical(CODEC.decode(CODEC.encode(META, block), META), block)


def test_owner_is_stored_but_not_checked() -> None:
    header = CODEC.read_header(BLOB)
    assert header.meta.owner == "tenant-a"
    other_owner = dataclasses.replace(META, owner="tenant-b")
    assert_bit_identical(CODEC.decode(BLOB, other_owner), BLOCK)


def test_decode_accepts_bytearray_and_memoryview() -> None:
    assert_bit_identical(CODEC.decode(bytearray(BLOB), META), BLOCK)
    assert_bit_identical(CODEC.decode(memoryview(BLOB), META), BLOCK)
    padded = memoryview(b"xx" + BLOB + b"yy")[2:-2]
    assert_bit_identical(CODEC.decode(padded, META), BLOCK)


@pytest.mark.parametrize("blob", [BLOB, LZ4_BLOB], ids=["raw", "lz4"])
def test_decoded_tensors_do_not_alias_the_input_buffer(blob: bytes) -> None:
    data = bytearray(blob)
    decoded = make_codec(compression="auto").decode(data, META)
    data[:] = bytes(len(data))
    assert_bit_identical(decoded, BLOCK)


def test_auto_stores_incompressible_kv_raw() -> None:
    blob = make_codec(compression="auto").encode(META, BLOCK)
    assert CODEC.read_header(blob).compression == "raw"


def test_auto_stores_lz4_when_it_saves_enough() -> None:
    zeros = KVBlock(
        keys=tuple(torch.zeros(2, BLOCK_TOKENS, 4) for _ in range(2)),
        values=tuple(torch.zeros(2, BLOCK_TOKENS, 4) for _ in range(2)),
    )
    layout = dataclasses.replace(LAYOUT, head_dim=4)
    blob = make_codec(layout=layout, compression="auto").encode(META, zeros)
    header = CODEC.read_header(blob)
    assert header.compression == "lz4"
    assert header.payload_len < header.raw_len
    assert_bit_identical(CODEC.decode(blob, META), zeros)


def test_lz4_mode_stores_lz4_even_when_it_does_not_save() -> None:
    assert CODEC.read_header(LZ4_BLOB).compression == "lz4"
    assert_bit_identical(CODEC.decode(LZ4_BLOB, META), BLOCK)


def test_read_header_needs_only_the_header_bytes() -> None:
    header_len = BlockCodec.header_length(BLOB[:PREFIX_LEN])
    header = CODEC.read_header(BLOB[:header_len])
    assert isinstance(header, DecodedHeader)
    assert header.header_len == header_len
    assert header.total_len == len(BLOB)
    assert header.meta == META
    assert (header.dtype, header.num_layers, header.kv_heads, header.head_dim) == (
        torch.float32,
        2,
        2,
        4,
    )
    assert header.block_tokens == BLOCK_TOKENS
    assert header.raw_len == header.payload_len == LAYOUT.block_nbytes(BLOCK_TOKENS)
    assert header.block_tag == BLOB[header.body_len : header.body_len + MAC_LEN]


def test_blob_starts_with_magic_version_and_header_length() -> None:
    magic, version, header_len = struct.unpack_from("<4sHI", BLOB)
    assert (magic, version, header_len) == (MAGIC, FORMAT_VERSION, HEADER.header_len)
    assert PREFIX_LEN == 10


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("blob", [BLOB, LZ4_BLOB], ids=["raw", "lz4"])
def test_every_truncation_is_refused_as_truncated(blob: bytes) -> None:
    for length in range(len(blob)):
        refused("truncated", lambda: CODEC.decode(blob[:length], META))  # noqa: B023


def test_header_length_of_a_short_prefix_is_refused_as_truncated() -> None:
    refused("truncated", lambda: BlockCodec.header_length(BLOB[: PREFIX_LEN - 1]))


def test_trailing_bytes_are_refused() -> None:
    error = refused("size", lambda: CODEC.decode(BLOB + b"\x00", META))
    assert "trailing" in str(error)


def test_wrong_magic_is_refused() -> None:
    refused("magic", lambda: CODEC.decode(b"XXXX" + BLOB[4:], META))


def test_other_format_version_is_refused() -> None:
    other = remac(BLOB[:4] + struct.pack("<H", FORMAT_VERSION + 1) + BLOB[6:])
    error = refused("version", lambda: CODEC.decode(other, META))
    assert str(FORMAT_VERSION + 1) in str(error)


def test_format_1_blob_is_refused_as_version() -> None:
    old = encode_format_1(CODEC, MAC_KEY, META, BLOCK)
    assert format_1_accepts(old, MAC_KEY)  # positive control: a genuine format 1 blob
    refused("version", lambda: CODEC.decode(old, META))
    refused("version", lambda: CODEC.read_header(old))


def test_blob_of_another_mac_key_is_refused() -> None:
    foreign = make_codec(mac_key=OTHER_MAC_KEY).encode(META, BLOCK)
    error = refused("mac", lambda: CODEC.decode(foreign, META))
    assert "another deployment secret" in str(error)


def test_header_bit_flips_are_caught_by_the_mac() -> None:
    for byte in range(PREFIX_LEN, HEADER.header_len):
        for bit in range(8):
            tampered = bytearray(BLOB)
            tampered[byte] ^= 1 << bit
            refused("mac", lambda: CODEC.decode(tampered, META))  # noqa: B023


def test_prefix_bit_flips_are_refused() -> None:
    for byte in range(PREFIX_LEN):
        for bit in range(8):
            tampered = bytearray(BLOB)
            tampered[byte] ^= 1 << bit
            with pytest.raises(CodecError):
                CODEC.decode(tampered, META)


@pytest.mark.parametrize("blob", [BLOB, LZ4_BLOB], ids=["raw", "lz4"])
def test_payload_bit_flips_are_caught_by_the_block_mac(blob: bytes) -> None:
    header_len = CODEC.read_header(blob).header_len
    for byte in range(header_len, len(blob)):
        tampered = bytearray(blob)
        tampered[byte] ^= 1 << (byte % 8)
        refused("payload_mac", lambda: CODEC.decode(tampered, META))  # noqa: B023


def page_of_a_pool(layout: KVLayout, block_tokens: int) -> KVBlock:
    """Page 1 of a ``[layers, 2, kv_heads, pages, tokens, head_dim]`` pool, filled with a
    sentinel, as a block: strided views, what a decode writes into."""
    pool = torch.full((layout.num_layers, 2, layout.kv_heads, 3, block_tokens, layout.head_dim),
                      -7.0, dtype=layout.dtype)
    return KVBlock.of_packed(pool[:, :, :, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("as_bytes", [True, False], ids=["immutable bytes", "bytearray"])
def test_a_block_decoded_into_a_page_is_the_block_and_its_views_are_the_page(
        dtype: torch.dtype, as_bytes: bool) -> None:
    layout = dataclasses.replace(LAYOUT, dtype=dtype)
    codec, block = make_codec(layout=layout), make_block(layout)
    blob = codec.encode(META, block)
    page = page_of_a_pool(layout, BLOCK_TOKENS)
    got = codec.decode(blob if as_bytes else bytearray(blob), META, into=page)
    assert got is page
    assert all(torch.equal(a, b) for a, b in zip((*got.keys, *got.values),
                                                 (*block.keys, *block.values), strict=True))


def test_a_block_that_fails_verification_writes_nothing_into_its_page() -> None:
    header_len = CODEC.read_header(BLOB).header_len
    tampered = bytearray(BLOB)
    tampered[header_len + 5] ^= 1
    page = page_of_a_pool(LAYOUT, BLOCK_TOKENS)
    refused("payload_mac", lambda: CODEC.decode(bytes(tampered), META, into=page))
    assert page.packed is not None and bool((page.packed == -7.0).all())


def test_read_header_vouches_for_the_header_only() -> None:
    tampered = bytearray(BLOB)
    tampered[-1] ^= 1
    assert CODEC.read_header(tampered).meta == META
    refused("payload_mac", lambda: CODEC.decode(tampered, META))


# A layout whose payload (16 KiB) spans 15 xxh3 blocks of 1 KiB and a last partial one.
ATTACK_LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=32, dtype=torch.float32)
ATTACK_TOKENS = 16


def _attack() -> tuple[BlockCodec, BlockMeta, KVBlock, bytes, float]:
    """The victim's codec, meta and block, and the attacker's payload: KV of the attacker's
    choosing (every value 1e4) wherever the lane fix-up leaves it, xxh3 of the victim's."""
    codec = make_codec(layout=ATTACK_LAYOUT, block_tokens=ATTACK_TOKENS)
    meta = make_meta(ATTACK_TOKENS)
    block = make_block(ATTACK_LAYOUT, ATTACK_TOKENS, seed=11)
    genuine = codec.encode(meta, block)[codec.read_header(codec.encode(meta, block)).header_len :]
    chosen = torch.full((codec.raw_len // 4,), 1e4, dtype=torch.float32).numpy().tobytes()
    forged, chosen_share = forge_keeping_xxh3(genuine, chosen)
    return codec, meta, block, forged, chosen_share


def test_xxh3_lane_fix_up_forges_a_payload_that_format_1_accepts() -> None:
    codec, meta, block, forged, chosen_share = _attack()
    old = encode_format_1(codec, MAC_KEY, meta, block)
    header_len = struct.unpack_from("<I", old, 6)[0]
    poisoned = old[:header_len] + forged
    assert chosen_share >= 0.85  # the attacker picks 14 of every 16 words
    assert xxhash.xxh3_128_digest(forged) == xxhash.xxh3_128_digest(old[header_len:])
    assert forged != old[header_len:]
    assert format_1_accepts(poisoned, MAC_KEY)


def test_payload_forged_to_keep_its_xxh3_is_refused_by_the_block_mac() -> None:
    codec, meta, block, forged, _ = _attack()
    blob = codec.encode(meta, block)
    header_len = codec.read_header(blob).header_len
    refused("payload_mac", lambda: codec.decode(blob[:header_len] + forged, meta))


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("key", BlockKey(b"k" * 16), "key"),
        ("key", BlockKey(b"K" * 15), "key"),
        ("parent_key", BlockKey(b"p" * 16), "parent"),
        ("namespace_digest", b"n" * 32, "namespace"),
        ("tokens", make_meta(first_token=8).tokens, "tokens"),
    ],
)
def test_expected_identity_mismatch_is_refused(field: str, value: bytes, reason: str) -> None:
    changes: dict[str, Any] = {field: value}
    expected = dataclasses.replace(META, **changes)
    refused(reason, lambda: CODEC.decode(BLOB, expected))


@pytest.mark.parametrize(
    "layout",
    [
        dataclasses.replace(LAYOUT, num_layers=3),
        dataclasses.replace(LAYOUT, kv_heads=1),
        dataclasses.replace(LAYOUT, head_dim=8),
        dataclasses.replace(LAYOUT, dtype=torch.float16),
        dataclasses.replace(LAYOUT, dtype=torch.bfloat16, head_dim=8),  # same byte size
    ],
    ids=["num_layers", "kv_heads", "head_dim", "dtype", "dtype_same_size"],
)
def test_blob_of_another_layout_is_refused(layout: KVLayout) -> None:
    refused("shape", lambda: make_codec(layout=layout).read_header(BLOB))


def test_blob_of_another_block_size_is_refused() -> None:
    refused("shape", lambda: make_codec(block_tokens=BLOCK_TOKENS + 1).read_header(BLOB))


def test_forged_header_claiming_a_huge_payload_is_refused_without_allocating() -> None:
    four_gib = 4 << 30
    forged = forge(b"\x00" * 16, payload_len=four_gib, raw_len=four_gib)
    tracemalloc.start()
    started = time.perf_counter()
    try:
        refused("size", lambda: CODEC.decode(forged, META))
        refused("size", lambda: CODEC.read_header(forged))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - started < 0.5
    assert peak < 256 * 1024


def test_forged_header_claiming_a_huge_lz4_payload_is_refused() -> None:
    forged = forge(b"\x00" * 16, compression_id=1, payload_len=1 << 40)
    refused("size", lambda: CODEC.read_header(forged))


def test_prefix_claiming_a_huge_header_is_refused_unread() -> None:
    prefix = struct.pack("<4sHI", MAGIC, FORMAT_VERSION, 0xFFFFFFFF)
    refused("size", lambda: BlockCodec.header_length(prefix))
    refused("size", lambda: CODEC.decode(prefix + b"\x00" * 100, META))


def test_header_fields_that_disagree_with_the_header_length_are_refused() -> None:
    forged = bytearray(BLOB)
    forged[12] += 1  # key length one longer than what the prefix's header length leaves room for
    refused("size", lambda: CODEC.decode(remac(forged), META))


def test_unknown_dtype_code_is_refused() -> None:
    refused("codec", lambda: CODEC.read_header(forge(PAYLOAD, dtype_code=200)))


def test_unknown_compression_id_is_refused() -> None:
    refused("codec", lambda: CODEC.read_header(forge(PAYLOAD, compression_id=9)))


def test_owner_that_is_not_utf8_is_refused() -> None:
    refused("codec", lambda: CODEC.read_header(forge(PAYLOAD, owner=b"\xff\xfe")))


@pytest.fixture(scope="module")
def large_codec() -> BlockCodec:
    # 2 MiB blocks: an lz4 bomb small enough to pass the payload size bound fits.
    layout = KVLayout(num_layers=4, kv_heads=8, head_dim=64, dtype=torch.float32)
    return make_codec(layout=layout, block_tokens=128)


def lz4_blob(codec: BlockCodec, payload: bytes) -> bytes:
    layout = codec.layout
    return forge(
        payload,
        compression_id=1,
        num_layers=layout.num_layers,
        kv_heads=layout.kv_heads,
        head_dim=layout.head_dim,
        block_tokens=codec.block_tokens,
        num_tokens=codec.block_tokens,
        tokens=make_meta(codec.block_tokens).tokens,
        raw_len=codec.raw_len,
    )


def test_lz4_bomb_is_refused_without_inflating(large_codec: BlockCodec) -> None:
    bomb = lz4.frame.compress(bytes(64 << 20))  # 64 MiB of zeros in ~256 KiB
    blob = lz4_blob(large_codec, bomb)
    meta = make_meta(large_codec.block_tokens)
    assert large_codec.read_header(blob).payload_len == len(bomb)
    tracemalloc.start()
    try:
        error = refused("codec", lambda: large_codec.decode(blob, meta))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "more than" in str(error)
    assert peak < 3 * large_codec.raw_len + 2 * len(bomb)


@pytest.mark.parametrize("delta", [-1, 1])
def test_lz4_payload_of_the_wrong_size_is_refused(large_codec: BlockCodec, delta: int) -> None:
    payload = lz4.frame.compress(bytes(large_codec.raw_len + delta))
    meta = make_meta(large_codec.block_tokens)
    refused("codec", lambda: large_codec.decode(lz4_blob(large_codec, payload), meta))


def test_lz4_payload_with_bytes_after_the_frame_is_refused(large_codec: BlockCodec) -> None:
    payload = lz4.frame.compress(bytes(large_codec.raw_len)) + b"junk"
    meta = make_meta(large_codec.block_tokens)
    refused("codec", lambda: large_codec.decode(lz4_blob(large_codec, payload), meta))


def test_payload_that_is_not_lz4_is_refused() -> None:
    refused("codec", lambda: CODEC.decode(forge(b"not an lz4 frame", compression_id=1), META))


class _TouchOnUnpickle:
    """Unpickling this object touches ``path``: the canary of code execution."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (self.path,))


def test_pickle_payload_is_never_executed(tmp_path: pathlib.Path) -> None:
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_TouchOnUnpickle(control)))  # positive control: the bytes are live
    assert control.exists()

    canary = tmp_path / "canary"
    payload = pickle.dumps(_TouchOnUnpickle(canary))
    refused("magic", lambda: CODEC.decode(payload, META))
    refused("mac", lambda: CODEC.decode(forge(payload, mac_key=OTHER_MAC_KEY), META))
    refused("size", lambda: CODEC.decode(forge(payload), META))
    refused("codec", lambda: CODEC.decode(forge(payload, compression_id=1), META))
    padded = payload.ljust(CODEC.raw_len, b".")  # a raw payload of the right size: just numbers
    assert CODEC.decode(forge(padded), META).num_layers == LAYOUT.num_layers
    assert not canary.exists()


def test_codec_never_imports_pickle_or_calls_torch_load() -> None:
    tree = ast.parse(pathlib.Path(codec_module.__file__).read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    } | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not imported & {"pickle", "marshal", "dill", "cloudpickle", "shelve"}
    attributes = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert not attributes & {"load", "loads"}
    assert not names & {"eval", "exec", "__import__"}


# ----------------------------------------------------------------------------- encode errors


def test_encode_refuses_a_block_of_another_shape() -> None:
    block = make_block(dataclasses.replace(LAYOUT, head_dim=8))
    refused("shape", lambda: CODEC.encode(META, block))


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("key", BlockKey(b""), "key"),
        ("key", BlockKey(b"k" * 65), "key"),
        ("parent_key", BlockKey(b"p" * 65), "parent"),
        ("namespace_digest", b"n" * 16, "namespace"),
        ("tokens", b"\x00" * 4, "tokens"),
        ("owner", "o" * 257, "size"),
        ("owner", "\ud800", "codec"),
    ],
)
def test_encode_refuses_meta_the_format_cannot_hold(field: str, value: object, reason: str) -> None:
    changes: dict[str, Any] = {field: value}
    meta = dataclasses.replace(META, **changes)
    refused(reason, lambda: CODEC.encode(meta, BLOCK))


# ----------------------------------------------------------------------------- construction


def test_codec_refuses_a_big_endian_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "byteorder", "big")
    with pytest.raises(TierConfigError, match="big-endian"):
        make_codec()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mac_key": b"short"},
        {"block_tokens": 0},
        {"compression": "zstd"},
        {"min_lz4_saving": 1.0},
        {"layout": dataclasses.replace(LAYOUT, dtype=torch.int32)},
    ],
    ids=["mac_key", "block_tokens", "compression", "min_lz4_saving", "dtype"],
)
def test_codec_refuses_bad_configuration(kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {"mac_key": MAC_KEY, "layout": LAYOUT, "block_tokens": BLOCK_TOKENS}
    with pytest.raises(TierConfigError):
        BlockCodec(**(args | kwargs))


def test_mac_key_is_32_bytes_per_secret_and_not_a_namespace_digest() -> None:
    assert len(MAC_KEY) == 32
    assert derive_mac_key(SECRET) == MAC_KEY
    assert OTHER_MAC_KEY != MAC_KEY
    spec = NamespaceSpec(
        deployment_secret=SECRET,
        model_fingerprint="m",
        kv_dtype="float32",
        device_kind="cpu",
        scope=Scope.shared(),
    )
    assert derive_namespace(spec).digest != MAC_KEY
    with pytest.raises(TierConfigError):
        derive_mac_key(b"too short")


# ----------------------------------------------------------------------------- fuzzing


def decode_or_codec_error(codec: BlockCodec, data: bytes | bytearray) -> KVBlock | None:
    """Decode, or return None on a CodecError; any other exception fails the test."""
    try:
        return codec.decode(data, META)
    except CodecError:
        return None


@FUZZ
@given(st.binary(max_size=600))
@example(b"")
@example(MAGIC)
@example(BLOB[:PREFIX_LEN])
def test_fuzz_random_bytes_only_raise_codec_error(data: bytes) -> None:
    assert decode_or_codec_error(CODEC, data) is None
    assert decode_or_codec_error(CODEC, BLOB[:PREFIX_LEN] + data) is None


@FUZZ
@given(
    blob=st.sampled_from([BLOB, LZ4_BLOB]),
    flips=st.lists(st.integers(min_value=0, max_value=8 * len(LZ4_BLOB) - 1), max_size=4),
    cut=st.one_of(st.none(), st.integers(min_value=0, max_value=len(LZ4_BLOB) + 8)),
    tail=st.binary(max_size=8),
)
def test_fuzz_mutated_blobs_decode_exactly_or_raise_codec_error(
    blob: bytes, flips: list[int], cut: int | None, tail: bytes
) -> None:
    data = bytearray(blob)
    for flip in flips:
        if flip // 8 < len(data):
            data[flip // 8] ^= 1 << (flip % 8)
    if cut is not None:
        data = data[:cut]
    data += tail
    decoded = decode_or_codec_error(LZ4_CODEC, data)
    if bytes(data) == blob:
        assert decoded is not None
        assert_bit_identical(decoded, BLOCK)
    else:
        assert decoded is None


@FUZZ
@given(
    flips=st.lists(
        st.tuples(
            st.integers(min_value=PREFIX_LEN, max_value=HEADER.body_len - 1),
            st.integers(min_value=1, max_value=255),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_fuzz_re_maced_header_tampering_decodes_exactly_or_raises_codec_error(
    flips: list[tuple[int, int]],
) -> None:
    """A leaked MAC key must still not crash the parser or pass off other bytes."""
    data = bytearray(BLOB)
    for at, mask in flips:
        data[at] ^= mask
    decoded = decode_or_codec_error(CODEC, remac(data))
    if decoded is not None:  # only the owner can change and still decode (it is not checked)
        assert_bit_identical(decoded, BLOCK)


_u8 = st.integers(min_value=0, max_value=255)
_u32 = st.integers(min_value=0, max_value=2**32 - 1)
_u64 = st.integers(min_value=0, max_value=2**64 - 1)


def _valid_or(valid: Any, wild: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the genuine value, so that forgeries also reach the later checks."""
    return st.one_of(st.just(valid), st.just(valid), wild)


@FUZZ
@given(
    fields=st.builds(
        HeaderFields,
        dtype_code=_valid_or(1, _u8),
        compression_id=_valid_or(0, _u8),
        key=_valid_or(bytes(META.key), st.binary(max_size=80)),
        parent_key=_valid_or(bytes(META.parent_key), st.binary(max_size=80)),
        owner=_valid_or(META.owner.encode(), st.binary(max_size=300)),
        num_tokens=_valid_or(BLOCK_TOKENS, _u32),
        tokens=_valid_or(META.tokens, st.binary(max_size=40)),
        num_layers=_valid_or(LAYOUT.num_layers, _u32),
        kv_heads=_valid_or(LAYOUT.kv_heads, _u32),
        block_tokens=_valid_or(BLOCK_TOKENS, _u32),
        head_dim=_valid_or(LAYOUT.head_dim, _u32),
        payload_len=_valid_or(HEADER.payload_len, _u64),
        raw_len=_valid_or(HEADER.raw_len, _u64),
        namespace_digest=_valid_or(META.namespace_digest, st.binary(min_size=32, max_size=32)),
    ),
    payload=_valid_or(PAYLOAD, st.binary(max_size=512)),
)
def test_fuzz_forged_headers_with_a_valid_mac_only_raise_codec_error(
    fields: HeaderFields, payload: bytes
) -> None:
    try:
        data = seal(pack_body(fields), payload)
    except struct.error:
        return  # a field too wide for its slot: such a header cannot even be written
    try:
        CODEC.read_header(data)
    except CodecError:
        pass
    decoded = decode_or_codec_error(CODEC, data)
    if decoded is not None:  # a forger holding the key picks the payload, never the shapes
        decoded.check(LAYOUT, BLOCK_TOKENS)
        if payload == PAYLOAD:
            assert_bit_identical(decoded, BLOCK)
