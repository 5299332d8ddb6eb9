"""Errors of the gateway package, and the one place that says what each means to a client.

Hierarchy::

    GatewayError                 root: anything the gateway raises on purpose
     ├── InvalidRequest          the client sent something unusable (gRPC INVALID_ARGUMENT)
     │    └── CanonicalizationError   messages / prompt / token ids cannot be canonicalised
     └── IndexInvariantError     the radix index found its own state inconsistent (a bug)

Messages are written for a person: they say what was wrong and what would be accepted.
"""

from __future__ import annotations


class GatewayError(Exception):
    """Root of every error raised on purpose by ``gateway``."""


class InvalidRequest(GatewayError):
    """The request cannot be served as sent; retrying it unchanged will fail again."""


class CanonicalizationError(InvalidRequest):
    """Messages, prompt text or token ids that cannot be turned into canonical tokens."""


class IndexInvariantError(GatewayError):
    """The radix index or a block's reference count is inconsistent: always a bug."""
