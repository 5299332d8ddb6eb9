"""The block MAC: one keyed BLAKE3 over a block's header *and* payload.

Why a MAC over the payload, not a checksum: whoever can write the shared Redis or a disk file
must not be able to make ``BlockCodec.decode`` accept KV of their choosing, because one poisoned
Redis value is served by every replica. Format 1 MAC'd the header only and guarded the payload
with an xxh3-128 stored in that header. xxh3 is no defence against a writer: inside each 1 KiB
block of its input every 8-byte word only *adds* to an accumulator (its value to one lane, the
product of its two halves, xored with a public secret, to another), so a forger can set most
words to chosen values and solve a few words per lane to restore both sums, keeping the digest
(``tests/tiers/xxh3_forgery.py`` does it). Only a keyed function of every payload byte stops
that.

Choice: keyed BLAKE3 (PyPI ``blake3``, SIMD) is the fastest keyed function on this machine,
about 2x HMAC-SHA256 and 4x keyed BLAKE2b on one 11.8 MB block (SmolLM2, float32, 256 tokens);
``kvgate bench tiers`` prints all of them and the MAC's share of encode and decode.

Two tags, both keyed BLAKE3 under subkeys derived from the codec's MAC key:

* the **block tag** covers everything before it in the header (prefix, fields, identity) and
  then the stored payload: this is the MAC that authenticates the block;
* the **header tag** covers the header up to and including the block tag, so that a restart can
  authenticate a block file's identity and sizes from one small read (``read_header``) without
  reading the payload. It proves nothing about the payload; ``decode`` always checks the block
  tag.

The payload is streamed into the MAC from memoryviews (tensor bytes on encode, the received
buffer or the private copy on decode): no extra copy.

Verifying can use every core (BLAKE3's tree splits one input across threads; the tag is the
same bits), and does where the model runs on a GPU: a load from disk or Redis waits for the
MAC, the CPU's cores are otherwise idle, and an 8B-shape 8k-token prefix is 1 GiB to verify
(~320 ms on one core). Where the model runs on the CPU it does not: BLAKE3's worker threads
take the cores from torch's, and spin on them after the hash. Measured 2026-11-27 on the 2-core
AMD EPYC, a warm start from Redis in int8 (2,048 cached tokens of SmolLM2, in process): the MAC
took 41 ms per request on every core against 7 ms on one, and the suffix's forward after it 375
against 224 ms. Tagging on encode stays on one thread: blocks are written behind, off every
request's path.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from blake3 import blake3

from tiers.base import TierConfigError

MAC_LEN: int = 32
"""Bytes of each tag (BLAKE3's default output)."""

_MAC_PERSON = b"kvgate.blockmac"
_MAC_DOMAIN = b"kvgate.block-mac-key.v1"
# BLAKE3 derive_key contexts: hardcoded, globally unique, one per purpose (BLAKE3 spec).
_BLOCK_CONTEXT = "kvgate 2026-11 block tag over header and payload, format 2"
_HEADER_CONTEXT = "kvgate 2026-11 header tag over header and block tag, format 2"

_Buffer = bytes | bytearray | memoryview


def derive_mac_key(deployment_secret: bytes) -> bytes:
    """Derive the 32-byte key that MACs stored blocks from the deployment secret.

    A separate key (BLAKE2b personalised for this purpose, over its own domain string) so
    that a MAC can never equal a namespace digest, which is keyed by the same secret.

    Args:
        deployment_secret: the per-deployment secret, 16..64 bytes.

    Returns:
        32 bytes.

    Raises:
        TierConfigError: the secret is shorter than 16 or longer than 64 bytes.
    """
    if not 16 <= len(deployment_secret) <= 64:
        raise TierConfigError(
            f"deployment secret must be 16 to 64 bytes long, got {len(deployment_secret)}"
        )
    return hashlib.blake2b(
        _MAC_DOMAIN, key=deployment_secret, digest_size=MAC_LEN, person=_MAC_PERSON
    ).digest()


class BlockMac:
    """Computes and checks the two tags of a block under one MAC key.

    Args:
        mac_key: 16..64 bytes (``derive_mac_key``); each tag gets its own 32-byte subkey
            (BLAKE3 ``derive_key`` mode), so a header tag can never stand in for a block tag.
        verify_on_every_core: hash a tag being verified on every core (the same tag): for an
            engine on a GPU, whose host cores are idle; see the module docstring.

    Raises:
        TierConfigError: the key is shorter than 16 or longer than 64 bytes.
    """

    def __init__(self, mac_key: bytes, *, verify_on_every_core: bool = False) -> None:
        if not 16 <= len(mac_key) <= 64:
            raise TierConfigError(f"mac_key must be 16 to 64 bytes long, got {len(mac_key)}")
        self._block_key = blake3(mac_key, derive_key_context=_BLOCK_CONTEXT).digest()
        header_key = blake3(mac_key, derive_key_context=_HEADER_CONTEXT).digest()
        self._block = blake3(key=self._block_key)
        self._header = blake3(key=header_key)
        self._verify_on_every_core = verify_on_every_core

    @property
    def verifies_on_every_core(self) -> bool:
        return self._verify_on_every_core

    def block_tag(self, body: _Buffer, payload: Iterable[_Buffer], *,
                  every_core: bool = False) -> bytes:
        """The tag of ``body`` (the header before its tags) followed by the payload pieces;
        ``every_core``: hashed on as many threads as there are cores (the same tag)."""
        state = (blake3(key=self._block_key, max_threads=blake3.AUTO) if every_core
                 else self._block.copy())
        state.update(body)
        for piece in payload:
            state.update(piece)
        return state.digest()

    def header_tag(self, body: _Buffer, block_tag: _Buffer) -> bytes:
        """The tag of the header up to and including its block tag."""
        state = self._header.copy()
        state.update(body)
        state.update(block_tag)
        return state.digest()

    def is_block_tag(self, tag: _Buffer, body: _Buffer, payload: Iterable[_Buffer]) -> bool:
        """Whether ``tag`` is the block tag of ``body`` and ``payload`` (constant time; hashed
        on every core if this MAC was made to verify there)."""
        return hmac.compare_digest(
            self.block_tag(body, payload, every_core=self._verify_on_every_core), tag)

    def is_header_tag(self, tag: _Buffer, body: _Buffer, block_tag: _Buffer) -> bool:
        """Whether ``tag`` is the header tag of ``body`` and ``block_tag`` (constant time)."""
        return hmac.compare_digest(self.header_tag(body, block_tag), tag)
