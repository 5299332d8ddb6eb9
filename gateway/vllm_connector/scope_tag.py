"""The tenant a request reaches a vLLM worker with, signed by kvgate's gateway.

Why signed: whatever a request carries into vLLM's scheduler -- ``kv_transfer_params``,
``vllm_xargs``, ``cache_salt`` -- is set by whoever calls vLLM, and a scope must come from
kvgate's authentication, never from a request field (``Scope``). So the gateway sends the scope
with an expiry and a tag, a keyed BLAKE2b of both under a key derived from the deployment
secret for this purpose alone; the connector takes the scope only where the tag verifies and has
not expired, and otherwise gives the request the deployment's default scope
(docs/vllm-worker.md, "How it works"). The tag binds the scope's kind and tenant and the expiry,
each length-framed, so no field can be moved into another.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.core.fingerprint import Scope, frame

SCOPE_PARAM = "kvgate.scope"
"""The ``kv_transfer_params`` entry naming the scope: ``shared`` or ``tenant:<id>``."""
EXPIRES_PARAM = "kvgate.scope_expires_ms"
"""The entry holding when the tag stops being accepted (Unix milliseconds, decimal)."""
TAG_PARAM = "kvgate.scope_tag"
"""The entry holding the tag (hex)."""

TAG_BYTES = 32
_DOMAIN = b"kvgate.vllm-scope.v1"
_PERSON = b"kvgate-vllm-scop"  # BLAKE2b's personalisation: 16 bytes at most
_TENANT_PREFIX = "tenant:"
NO_CACHE = "none"
"""The default scope that neither loads nor stores (``parse_default_scope``)."""


def scope_key(deployment_secret: bytes) -> bytes:
    """The 32-byte key that tags scopes, derived from the deployment secret (its own domain and
    personalisation: a tag can never stand in for a block MAC or a namespace digest).

    Raises:
        ValueError: the secret is shorter than 16 or longer than 64 bytes.
    """
    if not 16 <= len(deployment_secret) <= 64:
        raise ValueError(f"the deployment secret must be 16 to 64 bytes long, got "
                         f"{len(deployment_secret)}")
    return hashlib.blake2b(_DOMAIN, key=deployment_secret, digest_size=32,
                           person=_PERSON).digest()


def scope_text(scope: Scope) -> str:
    """``shared``, or ``tenant:<id>``."""
    return "shared" if scope.kind == "shared" else _TENANT_PREFIX + scope.tenant


def parse_scope(text: str) -> Scope:
    """The scope ``scope_text`` wrote.

    Raises:
        ValueError: ``text`` names no scope (the message says what does).
    """
    if text == "shared":
        return Scope.shared()
    if text.startswith(_TENANT_PREFIX) and len(text) > len(_TENANT_PREFIX):
        return Scope.of_tenant(text[len(_TENANT_PREFIX):])
    raise ValueError(f"{text!r} is not a scope: expected 'shared' or 'tenant:<id>'")


def parse_default_scope(text: str) -> Scope | None:
    """A connector's default scope, for requests without a valid tag: ``none`` (neither loaded
    nor stored: None), ``shared`` or ``tenant:<id>``.

    Raises:
        ValueError: ``text`` is none of these.
    """
    if text == NO_CACHE:
        return None
    try:
        return parse_scope(text)
    except ValueError:
        raise ValueError(f"default scope {text!r}: expected 'none', 'shared' or "
                         "'tenant:<id>'") from None


def sign(scope: Scope, key: bytes, *, expires_at_ms: int) -> dict[str, str]:
    """The ``kv_transfer_params`` entries that carry ``scope`` to the connector until
    ``expires_at_ms`` (Unix milliseconds)."""
    text = scope_text(scope)
    return {SCOPE_PARAM: text, EXPIRES_PARAM: str(expires_at_ms),
            TAG_PARAM: _tag(key, text, expires_at_ms).hex()}


@dataclass(frozen=True, slots=True)
class ScopeCheck:
    """What a request's parameters said: its scope where the tag verified, else why not."""

    scope: Scope | None
    refusal: str | None = None
    """None where the scope verified; ``missing``, ``malformed``, ``expired`` or ``tag``
    (a counter's label: which refusals a deployment sees)."""


def verify(params: Mapping[str, object] | None, key: bytes, *, now_ms: int) -> ScopeCheck:
    """The scope ``params`` (a request's ``kv_transfer_params``) carry, where its tag was made
    with ``key`` and has not expired at ``now_ms``."""
    if params is None or not any(name in params for name in (SCOPE_PARAM, TAG_PARAM)):
        return ScopeCheck(None, "missing")
    text, expires, tag = (params.get(name) for name in (SCOPE_PARAM, EXPIRES_PARAM, TAG_PARAM))
    if not (isinstance(text, str) and isinstance(expires, str) and isinstance(tag, str)
            and expires.isdigit() and len(expires) <= 19):
        return ScopeCheck(None, "malformed")
    try:
        scope = parse_scope(text)
        given = bytes.fromhex(tag)
    except ValueError:
        return ScopeCheck(None, "malformed")
    expires_at_ms = int(expires)
    if not hmac.compare_digest(given, _tag(key, text, expires_at_ms)):
        return ScopeCheck(None, "tag")
    if expires_at_ms <= now_ms:
        return ScopeCheck(None, "expired")
    return ScopeCheck(scope)


def _tag(key: bytes, text: str, expires_at_ms: int) -> bytes:
    framed = frame(_DOMAIN, text.encode("utf-8"), str(expires_at_ms).encode("ascii"))
    return hashlib.blake2b(framed, key=key, digest_size=TAG_BYTES).digest()
