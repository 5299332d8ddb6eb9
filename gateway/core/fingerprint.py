"""Block fingerprints: the keyed hash chain that names every cached block.

Block i's key is keyed BLAKE2b (``hashlib``) of ``key_{i-1} || little-endian token ids of block
i``, keyed by a namespace digest. The namespace binds everything that makes two blocks' KV
interchangeable -- deployment secret, model fingerprint, numerics, layout version -- and the
cache scope (a tenant, or ``shared``). Two tenants sending the same prompt therefore get unrelated
keys, so nothing keyed by block (index, tiers, counters) can tell one about the other.

Why a cryptographic chain: a key is looked up before tokens are compared, and every later block
is chained to its parent, so a parent collision would let a foreign block pass all later checks.
Seeded non-cryptographic hashes (xxh3) can be made to collide by whoever crafts the prompt.
Measured here: ~1.1 us per 256-token block, ~40 us for an 8,192-token prompt.

Fields of the namespace are length-framed (8-byte length, then bytes), and the scope's kind is
its own field, so no tenant id, model name or dtype can be spelled to equal another combination.

Lossy copies (a tier with ``quantize = "int8"``) live in a namespace of their own,
``lossy_namespace(exact, quantization)``: its digest is keyed BLAKE2b *under the exact
namespace's digest* of a framed domain and the quantization's name. So every block key of a
lossy chain differs from the exact chain's over the same tokens, an exact request (which only
ever hashes under the exact digest) cannot even name a lossy block, and the lossy digest is as
unguessable as the exact one without the deployment secret (docs/design.md, "Lossy tiers").
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

from gateway.core.quantization import QUANTIZATIONS, Quantization
from gateway.core.tokens import BYTES_PER_TOKEN, TokenIds, token_view
from policies.base import BlockKey

LAYOUT_VERSION = 1
"""Version of the KV block layout; bump it when the stored tensor layout changes."""

KEY_BYTES = 16
"""BLAKE2b-128 block keys."""

NAMESPACE_DIGEST_BYTES = 32

_DOMAIN = b"kvgate.namespace.v1"
_LOSSY_DOMAIN = b"kvgate.lossy-namespace.v1"

ScopeKind = Literal["tenant", "shared"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Scope:
    """Whose cache a prefix belongs to. Comes from authentication, never from a request field."""

    kind: ScopeKind
    tenant: str = ""

    def __post_init__(self) -> None:
        if self.kind == "tenant" and not self.tenant:
            raise ValueError("a tenant scope needs a non-empty tenant id")
        if self.kind == "shared" and self.tenant:
            raise ValueError("the shared scope has no tenant id")
        if self.kind not in ("tenant", "shared"):
            raise ValueError(f"unknown scope kind {self.kind!r}; expected 'tenant' or 'shared'")

    @classmethod
    def of_tenant(cls, tenant: str) -> Scope:
        return cls(kind="tenant", tenant=tenant)

    @classmethod
    def shared(cls) -> Scope:
        return cls(kind="shared")

    @property
    def owner(self) -> str:
        """Who is charged for blocks in this scope: the tenant id, or "shared"."""
        return self.tenant if self.kind == "tenant" else "shared"


@dataclass(frozen=True, slots=True, kw_only=True)
class NamespaceSpec:
    """Everything that must match for two blocks' KV to be interchangeable.

    Attributes:
        deployment_secret: per-deployment secret (16..64 bytes); keys are unguessable without it.
        model_fingerprint: digest of the model's weights and config.
        kv_dtype: dtype the KV is computed and stored in, e.g. "float32".
        device_kind: where it is computed, e.g. "cpu" or "cuda:sm90" (kernels differ).
        scope: the tenant, or shared.
        layout_version: version of the stored block layout.
    """

    deployment_secret: bytes = field(repr=False)
    model_fingerprint: str
    kv_dtype: str
    device_kind: str
    scope: Scope
    layout_version: int = LAYOUT_VERSION

    def __post_init__(self) -> None:
        if not 16 <= len(self.deployment_secret) <= 64:
            raise ValueError("deployment_secret must be 16 to 64 bytes long")
        for name in ("model_fingerprint", "kv_dtype", "device_kind"):
            if not getattr(self, name):
                raise ValueError(f"{name} must not be empty")


@dataclass(frozen=True, slots=True)
class Namespace:
    """A namespace's public identity: its digest (the key of every block hash) and scope.

    ``quantization`` is None for the exact namespace (K/V as the model computed them, promise
    1) and names the lossy format for a namespace made by ``lossy_namespace``: whatever is
    stored or computed under it is not exact, and nothing in it may be stored under, or served
    as, the exact namespace.
    """

    digest: bytes = field(repr=False)
    scope: Scope
    quantization: Quantization | None = None

    @property
    def digest_hex(self) -> str:
        return self.digest.hex()

    @property
    def exact(self) -> bool:
        """Whether blocks of this namespace are bit for bit what the model computes."""
        return self.quantization is None


def frame(*fields: bytes) -> bytes:
    """``fields`` each behind its length (8 bytes, little-endian): what a keyed hash is taken
    over, so that no field can run into the next."""
    return b"".join(len(f).to_bytes(8, "little") + f for f in fields)


def derive_namespace(spec: NamespaceSpec) -> Namespace:
    """Compute the namespace digest of ``spec`` (keyed by the deployment secret)."""
    framed = frame(
        _DOMAIN,
        spec.model_fingerprint.encode("utf-8"),
        spec.kv_dtype.encode("utf-8"),
        spec.device_kind.encode("utf-8"),
        str(spec.layout_version).encode("ascii"),
        spec.scope.kind.encode("ascii"),
        spec.scope.tenant.encode("utf-8"),
    )
    digest = hashlib.blake2b(
        framed, key=spec.deployment_secret, digest_size=NAMESPACE_DIGEST_BYTES
    ).digest()
    return Namespace(digest=digest, scope=spec.scope)


def lossy_namespace(exact: Namespace, quantization: Quantization) -> Namespace:
    """The namespace of ``exact``'s blocks stored as ``quantization`` (same scope).

    Derived from the exact digest, not from the ``NamespaceSpec``, so that whoever holds a
    request's namespace can name its lossy sibling; keyed by the exact digest, so that it is
    unguessable without the deployment secret, and domain-separated from ``derive_namespace``
    (another domain, another key), so that no lossy digest is an exact one but by a BLAKE2b
    collision.

    Raises:
        ValueError: ``exact`` is already lossy (a lossy copy of a lossy copy has no namespace
            of its own: it stays in the one it was read from), or ``quantization`` is unknown.
    """
    if not exact.exact:
        raise ValueError(f"namespace is already lossy ({exact.quantization}); lossy blocks "
                         "are only ever stored in the namespace they were read from")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; known: {list(QUANTIZATIONS)}")
    digest = hashlib.blake2b(
        frame(_LOSSY_DOMAIN, quantization.encode("ascii")),
        key=exact.digest, digest_size=NAMESPACE_DIGEST_BYTES,
    ).digest()
    return Namespace(digest=digest, scope=exact.scope, quantization=quantization)


ROOT_PARENT = BlockKey(bytes(KEY_BYTES))
"""The parent key of a prompt's first block."""


class BlockFingerprinter:
    """Cuts token ids into full blocks and chains their keys within one namespace.

    Args:
        namespace: the namespace whose digest keys every hash.
        block_tokens: tokens per block (the unit of storage and sharing).
        key_bytes: digest size; only tests shrink it (to force collisions and prove that
            token verification catches them).
    """

    def __init__(self, namespace: Namespace, block_tokens: int, *, key_bytes: int = KEY_BYTES):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        if not 1 <= key_bytes <= 64:
            raise ValueError(f"key_bytes must be 1..64, got {key_bytes}")
        self.namespace = namespace
        self.block_tokens = block_tokens
        self.key_bytes = key_bytes
        self._root = BlockKey(bytes(key_bytes))
        # NOTE: keying BLAKE2b costs a compression; copying a keyed state is ~7x cheaper.
        self._keyed = hashlib.blake2b(key=namespace.digest, digest_size=key_bytes)

    @property
    def root_parent(self) -> BlockKey:
        return self._root

    def num_full_blocks(self, tokens: TokenIds) -> int:
        return len(tokens) // self.block_tokens

    def block_keys(
        self,
        tokens: TokenIds,
        *,
        start_block: int = 0,
        parent: BlockKey | None = None,
    ) -> list[BlockKey]:
        """Keys of the full blocks of ``tokens`` from ``start_block`` on.

        Args:
            tokens: canonical token ids of the whole prompt.
            start_block: first block to hash; ``parent`` must then be block start_block-1's key.
            parent: key of the block before ``start_block`` (the root parent for block 0).
        """
        if start_block > 0 and parent is None:
            raise ValueError("parent is required when start_block > 0")
        data = token_view(tokens)
        step = self.block_tokens * BYTES_PER_TOKEN
        prev = self._root if parent is None else parent
        keys: list[BlockKey] = []
        keyed = self._keyed
        for offset in range(start_block * step, (len(tokens) // self.block_tokens) * step, step):
            h = keyed.copy()
            h.update(prev)
            h.update(data[offset : offset + step])
            prev = BlockKey(h.digest())
            keys.append(prev)
        return keys

    def block_token_bytes(self, tokens: TokenIds, block: int) -> bytes:
        """The little-endian token bytes of one full block (what the index stores)."""
        step = self.block_tokens * BYTES_PER_TOKEN
        return token_view(tokens)[block * step : (block + 1) * step].tobytes()
