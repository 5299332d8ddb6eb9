"""The seal on a stored response kept outside the process (Redis, the disk): a MAC keyed from
the deployment secret over the tenant's tag, the id and the JSON, so that whoever can write
there without the secret cannot make a replica serve a conversation it did not keep, nor move
one to another tenant or id; and the tenant's tag, a keyed digest, so that no tenant's name is
written there."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

MAC_LEN = 32


def responses_mac_key(deployment_secret: bytes) -> bytes:
    """The key that seals stored responses: its own, so that it never equals a block MAC."""
    return hashlib.blake2b(b"stored responses", key=deployment_secret, digest_size=MAC_LEN,
                           person=b"kvgate-responses").digest()


class ResponseSeal:
    """Seals and opens stored responses under one key."""

    def __init__(self, mac_key: bytes) -> None:
        self._key = mac_key

    def tag(self, tenant: str) -> str:
        """The tenant's name as the keys and paths spell it: 32 hex digits."""
        return hashlib.blake2b(tenant.encode("utf-8"), key=self._key, digest_size=16,
                               person=b"kvgate-resp-tag").hexdigest()

    def sealed(self, tag: str, id: str, messages: Sequence[Mapping[str, str]],
               body: Mapping[str, object], ttl_s: float | None) -> bytes:
        """The MAC, then the response as JSON."""
        payload = json.dumps({"id": id, "messages": [dict(m) for m in messages],
                              "body": dict(body), "ttl_s": ttl_s},
                             ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        return self._mac(tag, id, payload) + payload

    def opened(self, tag: str, id: str, value: bytes, where: str) -> dict[str, Any] | None:
        """The response's fields; None (with a warning naming ``where``) if its seal fails."""
        mac, payload = value[:MAC_LEN], value[MAC_LEN:]
        if len(value) <= MAC_LEN or not hmac.compare_digest(mac, self._mac(tag, id, payload)):
            logger.warning("a stored response in %s (%s) failed its MAC: dropped (written by "
                           "something without this deployment's secret)", where, id)
            return None
        fields: dict[str, Any] = json.loads(payload)
        return fields if fields.get("id") == id else None

    def _mac(self, tag: str, id: str, payload: bytes) -> bytes:
        return hashlib.blake2b(b"\0".join([tag.encode(), id.encode(), payload]),
                               key=self._key, digest_size=MAC_LEN).digest()
