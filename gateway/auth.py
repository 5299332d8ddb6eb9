"""API keys: who is calling, and which cache scope that gives them.

Every RPC carries ``authorization: Bearer <key>``. A key maps to a ``Principal``: a tenant id,
and whether it is an admin key. The tenant is the cache scope of everything the caller sends
(DESIGN.md, "Identity of a prefix"): no request field can name another tenant, so one tenant can
never read, time or count another's prefixes (RELIABILITY.md, threat 1). Admin keys are separate
keys; they may call the Admin service, use the shared scope and pin prefixes.

Keys are never kept, compared or logged in the clear: the table holds BLAKE2b digests, and a
presented key is hashed and compared against every entry with ``hmac.compare_digest`` (no early
exit, so the time taken says nothing about which entry came close). A configuration may hold
digests instead of keys (``key_digest(key).hex()``), so the file itself need not be secret.

Errors (both ``GatewayError``; ``gateway.grpc_errors`` gives their status codes)::

    AuthError
     ├── Unauthenticated     no key, a malformed header or an unknown key (UNAUTHENTICATED)
     └── PermissionDenied    a known key asking for what only admin keys may do
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gateway.errors import GatewayError

logger = logging.getLogger(__name__)

KEY_DIGEST_BYTES = 32
MIN_KEY_CHARS = 16
"""Shorter keys are refused by the configuration: they could be guessed."""

MAX_KEY_CHARS = 512
MAX_TENANT_CHARS = 128
RESERVED_TENANTS = frozenset({"shared"})
"""Tenant ids that would be confused with the shared scope (its owner is called "shared")."""

DEFAULT_ADMIN_NAME = "admin"
"""The name of an admin key configured without one (``KVGATE_ADMIN_KEYS=key``)."""

AUTHORIZATION = "authorization"
_PERSON = b"kvgate-api-key"


class AuthError(GatewayError):
    """The caller is not allowed to do what it asked."""


class Unauthenticated(AuthError):
    """No API key, a malformed ``authorization`` header, or a key this gateway does not know."""


class PermissionDenied(AuthError):
    """A valid key that is not allowed this call (an admin-only RPC or option)."""


def key_digest(key: str) -> bytes:
    """The digest kept for ``key`` (BLAKE2b-256, personalised for API keys)."""
    return hashlib.blake2b(
        key.encode("utf-8"), digest_size=KEY_DIGEST_BYTES, person=_PERSON
    ).digest()


@dataclass(frozen=True, slots=True, kw_only=True)
class Principal:
    """The authenticated caller.

    Attributes:
        tenant: the tenant id: the cache scope of the caller's prompts (an admin key's name is
            its tenant id when it sends prompts in the tenant scope).
        is_admin: an admin key (Admin service, shared scope, pinning).
    """

    tenant: str
    is_admin: bool = False

    def require_admin(self, what: str) -> None:
        """Raise ``PermissionDenied`` unless this is an admin key.

        Args:
            what: what was asked, for the message ("the Admin service", "pinning").
        """
        if not self.is_admin:
            raise PermissionDenied(
                f"{what} needs an admin key; this key belongs to tenant {self.tenant!r}. "
                "Ask the gateway's operator, or send the request without it"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyEntry:
    """One configured key: its digest and whom it authenticates."""

    digest: bytes = field(repr=False)
    principal: Principal

    def __post_init__(self) -> None:
        if len(self.digest) != KEY_DIGEST_BYTES:
            raise ValueError(f"a key digest is {KEY_DIGEST_BYTES} bytes, got {len(self.digest)}")
        problem = tenant_id_problem(self.principal.tenant)
        if problem is not None:
            raise ValueError(problem)

    @classmethod
    def of_key(cls, key: str, tenant: str, *, is_admin: bool = False, where: str = "") -> KeyEntry:
        """An entry for the clear-text ``key`` (checked for length, never kept)."""
        problem = key_problem(key)
        if problem is not None:
            at = f" ({where})" if where else ""
            raise ValueError(f"the key for {tenant!r}{at} {problem}")
        return cls(digest=key_digest(key), principal=Principal(tenant=tenant, is_admin=is_admin))

    @classmethod
    def of_digest(cls, digest_hex: str, tenant: str, *, is_admin: bool = False) -> KeyEntry:
        """An entry for a key given by its digest (``key_digest(key).hex()``)."""
        try:
            digest = bytes.fromhex(digest_hex)
        except ValueError as exc:
            raise ValueError(
                f"the key digest for {tenant!r} is not hex: write key_digest(key).hex()"
            ) from exc
        return cls(digest=digest, principal=Principal(tenant=tenant, is_admin=is_admin))


def key_problem(key: str) -> str | None:
    """What is wrong with ``key`` as an API key, or None. The message never contains it."""
    if len(key) < MIN_KEY_CHARS:
        return (f"is {len(key)} characters long; use at least {MIN_KEY_CHARS} random characters "
                "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    if len(key) > MAX_KEY_CHARS:
        return f"is longer than {MAX_KEY_CHARS} characters"
    if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        return "must be printable ASCII without spaces (it travels in an HTTP/2 header)"
    return None


def tenant_id_problem(tenant: str) -> str | None:
    """What is wrong with ``tenant`` as a tenant id, or None."""
    if not tenant:
        return "a tenant id must not be empty"
    if len(tenant) > MAX_TENANT_CHARS:
        return f"the tenant id {tenant[:40]!r}... is longer than {MAX_TENANT_CHARS} characters"
    if tenant in RESERVED_TENANTS:
        return f"the tenant id {tenant!r} is reserved (it names the shared scope)"
    if any(unicodedata.category(c).startswith("C") for c in tenant) or tenant != tenant.strip():
        return f"the tenant id {tenant!r} has control characters or surrounding spaces"
    return None


def parse_key_list(text: str, *, is_admin: bool, source: str) -> list[KeyEntry]:
    """Parse ``key1=tenantA,key2=tenantB`` (the ``KVGATE_API_KEYS`` form).

    For admin keys (``KVGATE_ADMIN_KEYS``) the part after ``=`` is the admin's name and may be
    left out (``key1,key2``: named ``admin``). The tenant is what follows the last ``=``, so a
    key may itself contain ``=``.

    Raises:
        ValueError: an entry is malformed; the message names its position, never the key.
    """
    entries = []
    for i, item in enumerate(part.strip() for part in text.split(",")):
        if not item:
            continue
        where = f"{source} entry {i + 1}"
        key, sep, tenant = item.rpartition("=")
        if not sep:
            if not is_admin:
                raise ValueError(f"{where} has no tenant: write key=tenant")
            key, tenant = item, DEFAULT_ADMIN_NAME
        tenant = tenant.strip()
        key = key.strip()
        problem = tenant_id_problem(tenant)
        if problem is not None:
            raise ValueError(f"{where}: {problem}")
        entries.append(KeyEntry.of_key(key, tenant, is_admin=is_admin, where=where))
    return entries


class Authenticator:
    """Finds the principal of a call's ``authorization`` metadata.

    Args:
        entries: every configured key; a key may appear only once.

    Raises:
        ValueError: two entries have the same key.
    """

    def __init__(self, entries: Sequence[KeyEntry]) -> None:
        seen: set[bytes] = set()
        for entry in entries:
            if entry.digest in seen:
                raise ValueError(
                    f"the same API key is configured twice (once for {entry.principal.tenant!r}); "
                    "every key must be distinct"
                )
            seen.add(entry.digest)
        self._entries = tuple(entries)

    @property
    def num_keys(self) -> int:
        return len(self._entries)

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(e.principal.tenant for e in self._entries if not e.principal.is_admin)

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Principal:
        """The principal of a call, from its invocation metadata.

        Raises:
            Unauthenticated: no ``authorization`` header, not a bearer token, or an unknown key.
        """
        values = [value for name, value in metadata or () if name.lower() == AUTHORIZATION]
        if not values:
            raise Unauthenticated(
                "no API key: send the metadata `authorization: Bearer <key>` "
                "(kvgate generate takes --api-key or KVGATE_API_KEY)"
            )
        if len(values) > 1:
            raise Unauthenticated("send one `authorization` header, not several")
        value = values[0]
        if isinstance(value, bytes):
            value = value.decode("utf-8", errors="replace")
        scheme, _, key = value.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise Unauthenticated(
                "the `authorization` metadata must be `Bearer <key>` (the bearer scheme)"
            )
        principal = self.find(key)
        if principal is None:
            raise Unauthenticated(
                "this API key is not valid for this gateway; check the key (or KVGATE_API_KEY)"
            )
        return principal

    def find(self, key: str) -> Principal | None:
        """The principal of ``key``, or None. Compares against every entry, matching or not."""
        digest = key_digest(key)
        found: Principal | None = None
        for entry in self._entries:
            if hmac.compare_digest(entry.digest, digest):
                found = entry.principal
        return found


def tenants_without_keys(entries: Sequence[KeyEntry], tenants: Iterable[str]) -> list[str]:
    """Those of ``tenants`` that no key authenticates (a quota for one is likely a typo)."""
    keyed = {e.principal.tenant for e in entries}
    return sorted(t for t in tenants if t not in keyed)


def is_loopback(host: str) -> bool:
    """Whether ``host`` only reaches this machine (a key may travel there without TLS)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
