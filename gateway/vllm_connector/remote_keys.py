"""Which blocks of a chain Redis holds, asked from vLLM's scheduler process.

Why the scheduler asks Redis itself: replicas share blocks through Redis, and a block another
replica stored never appears in this worker's reports or on its disk (``known_keys``); without
asking, a second vLLM server would never load what the first one computed. One pipelined
``EXISTS`` per key of the chain past what is known locally, under the store's own key scheme
(``tiers.redis_store``: ``{prefix}:{namespace digest}:{key}``). Nothing is read or verified
here: the worker does that when it loads, and a block that fails is recomputed and counted.
A Redis that fails or stalls answers "none held" (bounded by the tier's timeout) and is left
alone for ``retry_after_s``, so a Redis outage costs the scheduler one timeout, not one per
request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from redis.exceptions import RedisClusterException, RedisError

from policies.base import BlockKey
from tiers.kinds.remote import RedisTierConfig
from tiers.redis_client import RedisClient, build_client, pipelined, redact_url

logger = logging.getLogger(__name__)


class RedisKeyProbe:
    """Asks Redis which of a chain's blocks it holds.

    Args:
        config: the worker's Redis tier (its URL, prefix and timeouts).
        clock: monotonic seconds (tests move it).
    """

    def __init__(self, config: RedisTierConfig, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if config.url is None:
            raise ValueError("the Redis tier has no URL")
        self._config = config
        self._url = config.url
        self._clock = clock
        self._client: RedisClient | None = None
        self._resting_until = 0.0

    def count_leading(self, namespace_digest: bytes, keys: Sequence[BlockKey]) -> int:
        """How many of ``keys``, from the first, Redis holds in ``namespace_digest``."""
        if not keys or self._clock() < self._resting_until:
            return 0
        prefix = f"{self._config.key_prefix}:{namespace_digest.hex()}:"
        try:
            replies = pipelined(self._ensure_client(),
                                [("EXISTS", prefix + key.hex()) for key in keys])
        except (RedisError, RedisClusterException, OSError) as exc:
            self._rest(exc)
            return 0
        for index, reply in enumerate(replies):
            if isinstance(reply, Exception):
                self._rest(reply)
                return index
            if not reply:
                return index
        return len(keys)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _ensure_client(self) -> RedisClient:
        if self._client is None:
            self._client = build_client(self._url, cluster=self._config.cluster,
                                        socket_timeout_s=self._config.timeout_s,
                                        connect_timeout_s=self._config.timeout_s)
        return self._client

    def _rest(self, error: BaseException) -> None:
        self._resting_until = self._clock() + self._config.retry_after_s
        logger.warning("kvgate: Redis at %s did not answer which blocks it holds (%s); not "
                       "asked again for %.0f s", redact_url(self._url), type(error).__name__,
                       self._config.retry_after_s)
