"""The block tag hashed on every core (how an engine on a GPU verifies) is the tag hashed on one
thread (how encode tags, and an engine on the CPU verifies): the same bits for any header and any
payload pieces, small or over BLAKE3's threading size, so a block tagged on one machine verifies
on another whatever their cores."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiers.block_mac import BlockMac

MAC = BlockMac(b"block-mac-test-key-of-32-bytes!!")


@settings(max_examples=40, deadline=None)
@given(body=st.binary(max_size=300),
       pieces=st.lists(st.integers(0, 3 << 20), max_size=4),
       seed=st.integers(0, 2**32 - 1))
def test_a_tag_on_every_core_is_the_tag_on_one_thread(body: bytes, pieces: list[int],
                                                      seed: int) -> None:
    payload = [os.urandom(n) if n < 4096 else (seed.to_bytes(4, "little") * (n // 4 + 1))[:n]
               for n in pieces]
    assert MAC.block_tag(body, payload, every_core=True) == MAC.block_tag(body, payload)


@pytest.mark.parametrize("every_core", [False, True], ids=["one thread", "every core"])
def test_verification_accepts_the_tag_and_rejects_any_other(every_core: bool) -> None:
    verifier = BlockMac(b"block-mac-test-key-of-32-bytes!!", verify_on_every_core=every_core)
    body, payload = b"header", [os.urandom(5 << 20)]
    tag = MAC.block_tag(body, payload)
    assert verifier.is_block_tag(tag, body, payload)
    forged = bytearray(payload[0])
    forged[-1] ^= 1
    assert not verifier.is_block_tag(tag, body, [bytes(forged)])
