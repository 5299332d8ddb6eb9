"""Block fingerprints: keyed, chained, namespaced, and unforgeable by field framing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gateway.core.fingerprint import (
    KEY_BYTES,
    LAYOUT_VERSION,
    BlockFingerprinter,
    NamespaceSpec,
    Scope,
    derive_namespace,
)
from gateway.core.tokens import as_token_ids

SECRET = b"s" * 32


def spec(**overrides: object) -> NamespaceSpec:
    fields: dict[str, object] = {
        "deployment_secret": SECRET,
        "model_fingerprint": "model-a",
        "kv_dtype": "float32",
        "device_kind": "cpu",
        "scope": Scope.of_tenant("alice"),
    }
    fields.update(overrides)
    return NamespaceSpec(**fields)  # type: ignore[arg-type]


def keys_for(tokens: list[int], **overrides: Any) -> list[bytes]:
    fp = BlockFingerprinter(derive_namespace(spec(**overrides)), 4)
    return list(fp.block_keys(as_token_ids(tokens)))


def test_keys_are_deterministic_and_16_bytes() -> None:
    first = keys_for(list(range(12)))
    assert first == keys_for(list(range(12)))
    assert [len(k) for k in first] == [KEY_BYTES] * 3


def test_only_full_blocks_are_fingerprinted() -> None:
    assert len(keys_for(list(range(11)))) == 2
    assert keys_for([1, 2, 3]) == []


def test_keys_chain_so_a_prefix_has_a_prefix_of_keys() -> None:
    assert keys_for(list(range(16)))[:2] == keys_for(list(range(8)))


def test_changing_one_token_changes_that_block_and_every_later_key() -> None:
    base = keys_for(list(range(16)))
    edited = list(range(16))
    edited[5] = 999
    changed = keys_for(edited)
    assert changed[0] == base[0]
    assert all(a != b for a, b in zip(base[1:], changed[1:], strict=True))


def test_same_tokens_in_two_tenants_give_unrelated_keys() -> None:
    alice = keys_for(list(range(16)), scope=Scope.of_tenant("alice"))
    bob = keys_for(list(range(16)), scope=Scope.of_tenant("bob"))
    assert not set(alice) & set(bob)


def test_a_tenant_named_shared_is_not_the_shared_scope() -> None:
    assert keys_for(list(range(8)), scope=Scope.of_tenant("shared")) != keys_for(
        list(range(8)), scope=Scope.shared()
    )


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (
            {"model_fingerprint": "ab", "kv_dtype": "c"},
            {"model_fingerprint": "a", "kv_dtype": "bc"},
        ),
        (
            {"kv_dtype": "float3", "device_kind": "2cpu"},
            {"kv_dtype": "float32", "device_kind": "cpu"},
        ),
        (
            {"device_kind": "cpu", "scope": Scope.of_tenant("1x")},
            {"device_kind": "cpu1", "scope": Scope.of_tenant("x")},
        ),
        (
            {"model_fingerprint": "m\x00", "kv_dtype": "x"},
            {"model_fingerprint": "m", "kv_dtype": "\x00x"},
        ),
    ],
)
def test_no_field_can_be_framed_to_look_like_another(
    left: dict[str, object], right: dict[str, object]
) -> None:
    assert derive_namespace(spec(**left)).digest != derive_namespace(spec(**right)).digest


def test_tenant_id_cannot_absorb_the_scope_kind() -> None:
    a = derive_namespace(spec(scope=Scope.of_tenant("tenant"))).digest
    b = derive_namespace(spec(scope=Scope.shared())).digest
    assert a != b


@pytest.mark.parametrize(
    "override",
    [
        {"deployment_secret": b"t" * 32},
        {"model_fingerprint": "model-b"},
        {"kv_dtype": "float16"},
        {"device_kind": "cuda:sm90"},
        {"layout_version": 2},
    ],
)
def test_every_namespace_field_changes_the_keys(override: dict[str, object]) -> None:
    assert keys_for(list(range(8)), **override) != keys_for(list(range(8)))


def test_continuing_from_a_parent_equals_hashing_from_the_start() -> None:
    fp = BlockFingerprinter(derive_namespace(spec()), 4)
    tokens = as_token_ids(list(range(20)))
    whole = fp.block_keys(tokens)
    rest = fp.block_keys(tokens, start_block=2, parent=whole[1])
    assert whole[2:] == rest


def test_continuing_without_a_parent_is_refused() -> None:
    fp = BlockFingerprinter(derive_namespace(spec()), 4)
    with pytest.raises(ValueError, match="parent is required"):
        fp.block_keys(as_token_ids(list(range(20))), start_block=2)


def test_block_token_bytes_are_little_endian_uint32() -> None:
    fp = BlockFingerprinter(derive_namespace(spec()), 2)
    tokens = as_token_ids([1, 258, 3, 4])
    assert fp.block_token_bytes(tokens, 0) == b"\x01\x00\x00\x00\x02\x01\x00\x00"


def test_an_8192_token_prompt_has_32_blocks_of_256() -> None:
    fp = BlockFingerprinter(derive_namespace(spec()), 256)
    assert len(fp.block_keys(as_token_ids(np.arange(8192)))) == 32


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"deployment_secret": b"short"}, "16 to 64 bytes"),
        ({"model_fingerprint": ""}, "model_fingerprint must not be empty"),
        ({"kv_dtype": ""}, "kv_dtype must not be empty"),
    ],
)
def test_invalid_namespace_specs_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec(**kwargs)


def test_scope_validation() -> None:
    with pytest.raises(ValueError, match="non-empty tenant"):
        Scope.of_tenant("")
    with pytest.raises(ValueError, match="no tenant id"):
        Scope(kind="shared", tenant="x")
    assert Scope.shared().owner == "shared"
    assert Scope.of_tenant("bob").owner == "bob"


def test_block_tokens_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_tokens"):
        BlockFingerprinter(derive_namespace(spec()), 0)


def test_the_block_key_format_matches_its_golden_vector() -> None:
    """Pins the block-key format: keyed BLAKE2b-256 namespace digest over length-framed fields
    (domain, model fingerprint, KV dtype, device kind, layout version, scope kind, tenant)
    keyed by the deployment secret, then a keyed BLAKE2b-128 chain over parent key and
    little-endian uint32 token ids.

    Every key on disk and in Redis was made this way: a change here silently turns every
    stored block into a miss (or, worse, lets two formats meet). Change the format only on
    purpose, bump ``LAYOUT_VERSION`` with it, and then update these hex strings.
    """
    namespace = derive_namespace(NamespaceSpec(
        deployment_secret=b"kvgate-golden-vector-secret-0001",
        model_fingerprint="golden-model-fingerprint",
        kv_dtype="float32",
        device_kind="cpu",
        scope=Scope.of_tenant("tenant-a"),
    ))
    tokens = as_token_ids([1, 2, 3, 4, 500, 600, 70000, 2**32 - 1, 0, 42, 42, 7, 9])
    keys = BlockFingerprinter(namespace, 4).block_keys(tokens)
    assert LAYOUT_VERSION == 1
    assert namespace.digest.hex() == (
        "f174b6e7a12c098bcceec329d957202a8774970148dbb2f7fae769bd4d676182")
    assert [key.hex() for key in keys] == [
        "d5d1e6889d488024fefafde3597214e2",
        "29e91156e6db16aca9b846000dd964e9",
        "a97095cdb0b8a5b06bf9c16ac0d232a8",
    ]
