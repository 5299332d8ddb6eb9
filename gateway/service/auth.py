"""API keys: who is calling, and which cache scope that gives them.

Every RPC carries ``authorization: Bearer <key>``. A key maps to a ``Principal``: a tenant id, and
whether it is an admin key. The tenant is the cache scope of everything the caller sends
(docs/design.md, "Identity of a prefix"): no request field can name another tenant, so one tenant
can never read, time or count another's prefixes (docs/reliability.md, threat 1). Admin keys are
separate keys; they may call the Admin service, use the shared scope and pin prefixes.

Keys are never kept, compared or logged in the clear: the table holds BLAKE2b digests, and a
presented key is hashed and compared against every entry with ``hmac.compare_digest`` (no early
exit, so the time taken says nothing about which entry came close). A configuration may hold
digests instead of keys (``key_digest(key).hex()``), so the file itself need not be secret.

The errors (``Unauthenticated``, ``PermissionDenied``) live in ``gateway.core.errors``; the
configured entries in ``gateway.config.keys``.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable, Sequence

from gateway.config.keys import KeyEntry, Principal, admin_tenant_clashes, key_digest
from gateway.core.errors import Unauthenticated

logger = logging.getLogger(__name__)

AUTHORIZATION = "authorization"


class Authenticator:
    """Finds the principal of a call's ``authorization`` metadata (or HTTP header).

    Args:
        entries: every configured key; a key may appear only once.

    Raises:
        ValueError: two entries have the same key, or an admin is named like a tenant.
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
        clashes = admin_tenant_clashes(entries)
        if clashes:
            raise ValueError(f"admin names {clashes} are also tenant ids; name admin keys apart")
        self._entries = tuple(entries)

    @property
    def num_keys(self) -> int:
        return len(self._entries)

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(e.principal.tenant for e in self._entries if not e.principal.is_admin)

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None, *,
                     is_http: bool = False) -> Principal:
        """The principal of a call, from its invocation metadata (gRPC) or headers (HTTP).

        Args:
            metadata: the call's metadata or the request's headers, as name-value pairs.
            is_http: the caller speaks HTTP: the messages say "header", and how an HTTP client
                sends one, instead of gRPC "metadata".

        Raises:
            Unauthenticated: no ``authorization`` header, not a bearer token, or an unknown key.
        """
        values = [value for name, value in metadata or () if name.lower() == AUTHORIZATION]
        carrier = "header" if is_http else "metadata"
        if not values:
            raise Unauthenticated(
                "no API key: send the HTTP header `Authorization: Bearer <key>` (an OpenAI "
                "SDK sends its api_key so)" if is_http else
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
                f"the `authorization` {carrier} must be `Bearer <key>` (the bearer scheme)"
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
