"""Errors of the gateway package, and what each means to a client.

Hierarchy::

    GatewayError                 root: anything the gateway raises on purpose
     ├── InvalidRequest          the client sent something unusable (gRPC INVALID_ARGUMENT)
     │    ├── CanonicalizationError   messages / prompt / token ids cannot be canonicalised
     │    └── NotFound            an admin request names a tenant or block that is not there
     │                            (gRPC NOT_FOUND)
     ├── QueueFull               too many requests waiting (RESOURCE_EXHAUSTED)
     ├── RequestCancelled        the client cancelled or went away (CANCELLED)
     ├── DeadlineExceeded        the request's deadline passed (DEADLINE_EXCEEDED)
     ├── EngineDraining          the server is shutting down (UNAVAILABLE)
     │    └── EvictionNotPublished  evicted here, but the other replicas could not be told
 ├── AuthError
 │    ├── Unauthenticated     no key, a malformed header or an unknown key (UNAUTHENTICATED)
 │    └── PermissionDenied    a known key asking for what only admin keys may do
     ├── IndexInvariantError     the radix index found its own state inconsistent (a bug)
     └── MalformedEvent          an entry on the shared eviction stream that this build does not
                                 read (skipped and counted by the reader; never reaches a client)

Messages are written for a person: they say what was wrong and what would be accepted. The gRPC
servicer maps these to status codes in one place (``gateway.service.status_mapping``).
"""

from __future__ import annotations


class GatewayError(Exception):
    """Root of every error raised on purpose by ``gateway``."""


class InvalidRequest(GatewayError):
    """The request cannot be served as sent; retrying it unchanged will fail again."""


class CanonicalizationError(InvalidRequest):
    """Messages, prompt text or token ids that cannot be turned into canonical tokens."""


class NotFound(InvalidRequest):
    """An admin request names what this gateway does not have (a tenant, a cached block):
    acting on it would change nothing, so it is refused, saying where to look."""


class QueueFull(GatewayError):
    """The engine's request queue is full; the client may retry after a while."""


class RequestCancelled(GatewayError):
    """The request was cancelled (the client disconnected or cancelled the call)."""


class DeadlineExceeded(GatewayError):
    """The request's deadline passed before it finished."""


class EngineDraining(GatewayError):
    """The engine is shutting down and takes no new requests."""


class EvictionNotPublished(EngineDraining):
    """An admin eviction was applied here and in Redis, but the other replicas could not be
    told (the shared event stream is unreachable). UNAVAILABLE, like a draining server: an
    eviction is idempotent, so the operator retries it."""


class IndexInvariantError(GatewayError):
    """The radix index or a block's reference count is inconsistent: always a bug."""


class MalformedEvent(GatewayError):
    """An entry on the shared eviction stream (``gateway.cache.operations.invalidation``) that
    is not an eviction this build reads: a field too large, of the wrong form, or unknown. Anyone
    who can write Redis can write the stream, so the message names the field and what was wrong with
    it, never its value (a prefix text or session id may be personal data)."""


class AuthError(GatewayError):
    """The caller is not allowed to do what it asked."""


class Unauthenticated(AuthError):
    """No API key, a malformed ``authorization`` header, or a key this gateway does not know."""


class PermissionDenied(AuthError):
    """A valid key that is not allowed this call (an admin-only RPC or option)."""
