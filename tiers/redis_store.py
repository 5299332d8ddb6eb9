"""The Redis tier: block payloads in a Redis server or Redis Cluster shared by every replica.

Redis is the tier that makes a prefix computed by one replica a hit on all the others
(docs/design.md "Scaling past one machine"). It is also the tier that anyone with access to the
Redis can write to, that can disappear, stall or evict at any moment; so this store is built
around three rules:

* **Outages are misses.** Every Redis fault (refused, reset, timed out, loading, cluster down,
  bad auth, ...) makes the call a miss or a dropped put, counted by kind; nothing raises to the
  caller except bugs. A ``CircuitBreaker`` stops calling a Redis that keeps failing, so a dead
  tier costs no socket timeout per request; one probe every ``reset_after_s`` brings it back.
  redis-py's own retries are switched off (the caller recomputes faster than a retry storm).
* **Stored bytes are untrusted.** Each value is read with ``GETRANGE key 0 max_value_bytes``,
  so a planted huge value costs at most ``max_value_bytes + 1`` bytes of memory and is
  rejected before decoding; every value is decoded and verified by ``BlockCodec`` (a MAC
  over header and payload, key, parent, namespace, tokens). A value that fails is a miss, counted by
  reason, and deleted (it is poison, and ``SET NX`` would otherwise keep it forever).
* **One key per block.** ``{key_prefix}:{namespace_digest hex}:{block key hex}`` holds the
  codec's bytes, written with ``SET NX PX ttl`` so that replicas writing the same block never
  rewrite it (the first wins; both wrote identical bytes anyway). No hash tags: the blocks of
  one chain spread over the cluster's slots and pipelines are split per node by redis-py.
* **Expiry travels with the block.** ``PX`` is the block's own TTL (``BlockMeta.expiry``, the
  request's ``ttl_s``), capped by the store's ``ttl_s``; a block pinned when written gets no
  expiry. The TTL is also in the block's authenticated header, so the replica that fetches it
  keeps it, and a hit restarts the key's expiry with that TTL (sliding, as ``policies.ttl``
  does for local tiers) -- unless the key has none (it was pinned): ``PTTL`` is read with the
  value and only keys that have an expiry get ``PEXPIRE``. ``refresh_expiry`` persists the
  keys of a block that gets pinned and restores the expiry of one that gets unpinned.

Batches: ``get_many``/``put_many`` send a whole chain in one pipelined round trip (one per
node on a cluster; if one node of a cluster is down, the whole call is a miss: a chain spans
every node, so its usable prefix would end there almost at once anyway). ``get_many``
returns a *prefix-shaped* answer: a block is only useful with all its ancestors, so after the
first miss at position i every later position is None (those values are not even decoded),
even if Redis held them; Redis's own eviction can drop a parent and keep its child, and the
child must never be used.

Keys need the namespace digest, which ``delete(key)`` and ``contains(key)`` do not carry: the
store remembers the Redis key of the last ``_NUM_KNOWN_KEYS`` blocks this process put or got;
``delete_metas`` / ``contains_meta`` work for any block, ``remove_where`` for any selection.

Production: use ``rediss://`` and a Redis user with a password (ACL) in the URL; stored KV is
as sensitive as the prompts. Passwords never reach a log line (URLs are redacted).

The redis-py mechanics (clients, faults, commands over many keys, URL redaction) live in
``tiers.redis_client``, the bookkeeping of failures in ``tiers.redis_faults``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace

import redis
from redis.cluster import RedisCluster
from redis.exceptions import DataError, ResponseError

from gateway.core.admin_reports import StoreReport
from policies.base import BlockKey
from tiers.base import (
    BatchDefaults,
    BlockExpiry,
    BlockMeta,
    CodecError,
    StoreCounters,
    TierConfigError,
)
from tiers.breaker import CircuitBreaker
from tiers.codec import BlockCodec
from tiers.payload import KVBlock, KVLayout
from tiers.redis_client import (
    REDIS_FAULTS,
    RedisClient,
    build_client,
    close_client,
    glob_escape,
    is_wrong_type,
    raise_first_error,
    redact_url,
    replies_as_they_arrive,
    unlink_all,
    unlink_idle,
    unlink_matching,
    url_secrets,
)
from tiers.redis_faults import RedisFaults

logger = logging.getLogger(__name__)

_NUM_KNOWN_KEYS = 65_536
"""Block key → Redis key entries remembered for ``delete(key)``/``contains(key)`` (~150 B each)."""

_FLUSH_BATCH = 512

_HEADER_SLACK_BYTES = 4096
"""Room for the codec's fixed header fields (magic, version, keys, digest, two MAC tags)."""


def default_max_value_bytes(layout: KVLayout, block_tokens: int) -> int:
    """The largest value the codec can produce for one block, with generous header slack.

    Raw payload, plus lz4's worst-case expansion (n/255 + 16) in case compression is forced on
    incompressible data, plus the token ids and a fixed allowance for the header.
    """
    raw = layout.block_nbytes(block_tokens)
    return raw + raw // 255 + 16 + 4 * block_tokens + _HEADER_SLACK_BYTES


class RedisStore(BatchDefaults):
    """``BlockStore`` over a Redis server or Redis Cluster (see the module docstring).

    Args:
        codec: encodes blocks and verifies every value read back.
        url: ``redis://[user:password@]host:port/db`` or ``rediss://`` for TLS; with
            ``cluster=True`` any node of the cluster. Exactly one of ``url`` and ``client``.
        cluster: build a ``RedisCluster`` client from ``url`` instead of a ``Redis``.
        client: an already built ``redis.Redis`` / ``RedisCluster`` (decode_responses=False).
            The caller owns it: ``close()`` does not close it, and its retry settings are its
            own.
        key_prefix: first part of every key; lets several deployments share one Redis.
        ttl_s: the longest a key lives without a hit, in seconds: a block's own shorter TTL
            wins; a block without one gets this; None: no cap (a pinned block never expires).
        socket_timeout_s: bound on each socket read/write, so a Redis that stalls costs one
            timeout. NOTE: it bounds each read, not the call: a Redis that drips bytes faster
            than this stretches a call without failing it (it still never yields garbage).
        connect_timeout_s: bound on opening a connection.
        breaker: gates calls while Redis keeps failing; default ``CircuitBreaker()``.
        max_value_bytes: values longer than this are rejected unread; default from the codec's
            layout (``default_max_value_bytes``).

    Raises:
        TierConfigError: neither or both of url/client, a bad client, ttl or max_value_bytes.
    """

    name = "redis"

    def __init__(
        self,
        codec: BlockCodec,
        *,
        url: str | None = None,
        cluster: bool = False,
        client: object | None = None,
        key_prefix: str = "kvgate",
        ttl_s: float | None = 3600.0,
        socket_timeout_s: float = 0.25,
        connect_timeout_s: float = 0.25,
        breaker: CircuitBreaker | None = None,
        max_value_bytes: int | None = None,
    ) -> None:
        if (url is None) == (client is None):
            raise TierConfigError("RedisStore needs exactly one of url= and client=")
        if client is not None and not isinstance(client, (redis.Redis, RedisCluster)):
            raise TierConfigError(
                f"client must be a redis.Redis or RedisCluster, got {type(client).__name__}"
            )
        if ttl_s is not None and not ttl_s > 0:
            raise TierConfigError(f"ttl_s must be > 0 or None, got {ttl_s}")
        if max_value_bytes is None:
            max_value_bytes = default_max_value_bytes(codec.layout, codec.block_tokens)
        if max_value_bytes < 1:
            raise TierConfigError(f"max_value_bytes must be >= 1, got {max_value_bytes}")
        self._codec = codec
        self._url = url
        self._is_cluster = cluster or isinstance(client, RedisCluster)
        self._client: RedisClient | None = (
            client if isinstance(client, (redis.Redis, RedisCluster)) else None
        )
        self._owns_client = client is None
        self._key_prefix = key_prefix
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._socket_timeout_s = socket_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._breaker = breaker if breaker is not None else CircuitBreaker()
        self._faults = RedisFaults(
            self._breaker, where=redact_url(url) if url is not None else "an injected client",
            secrets=url_secrets(url) if url is not None else ())
        self._max_value_bytes = max_value_bytes
        self._lock = threading.Lock()  # counters, the known-key map, the outage flag
        self._client_lock = threading.Lock()  # building the client
        self._stats = StoreCounters(name=self.name)
        self._num_skipped = 0
        self._num_dropped_puts = 0
        self._num_put_existing = 0
        self._num_not_decoded = 0
        self._num_delete_unknown = 0
        self._block_key_to_redis_key: OrderedDict[BlockKey, str] = OrderedDict()
        self._is_started = False
        self._is_closed = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Build the client and PING once. Never fails because Redis is down or refuses us:
        that logs one warning, opens the breaker, and the tier serves misses until a probe
        succeeds.

        Raises:
            TierConfigError: the URL cannot be parsed.
        """
        if self._is_started:
            return
        self._is_started = True
        try:
            client = self._ensure_client()
            began = time.perf_counter()
            client.ping()
        except REDIS_FAULTS as exc:
            if isinstance(exc, DataError):
                raise
            self._breaker.trip()
            self._faults.count(exc)
            self._faults.enter_outage(exc)
            return
        self._faults.on_success(began)
        logger.info("redis tier ready at %s", self._faults.where)

    def close(self) -> None:
        """Close the client this store built (an injected client is left to its owner)."""
        if self._is_closed:
            return
        self._is_closed = True
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None and self._owns_client:
            close_client(client)

    # ------------------------------------------------------------------ BlockStore

    def put(self, meta: BlockMeta, block: KVBlock) -> None:
        self.put_many([(meta, block)])

    def get(self, meta: BlockMeta) -> KVBlock | None:
        return self.get_many([meta])[0]

    def put_many(self, items: Sequence[tuple[BlockMeta, KVBlock]]) -> None:
        """Store a chain with one pipelined ``SET NX PX`` per block, in one round trip.

        Dropped (and counted) when the breaker is open or Redis fails; nothing is encoded then.

        Raises:
            TierConfigError: the codec produced a value over ``max_value_bytes`` (it could
                never be read back: the bound is misconfigured).
        """
        if not items:
            return
        client = self._admit()
        if client is None:
            with self._lock:
                self._num_dropped_puts += len(items)
            return
        redis_keys = [self._remember(meta) for meta, _ in items]
        values = [self._codec.encode(meta, block) for meta, block in items]
        for value in values:
            if len(value) > self._max_value_bytes:
                raise TierConfigError(
                    f"an encoded block is {len(value)} bytes, over max_value_bytes="
                    f"{self._max_value_bytes}; raise max_value_bytes"
                )
        began = time.perf_counter()
        try:
            with client.pipeline(transaction=False) as pipe:
                for redis_key, value, (meta, _) in zip(redis_keys, values, items, strict=True):
                    pipe.set(redis_key, value, nx=True, px=self.expiry_ms(meta.expiry))
                replies = pipe.execute(raise_on_error=False)
            raise_first_error(replies)
        except REDIS_FAULTS as exc:
            self._faults.on_fault(exc)
            with self._lock:
                self._num_dropped_puts += len(items)
            return
        self._faults.on_success(began)
        num_new = sum(1 for reply in replies if reply)
        with self._lock:
            self._stats.puts += num_new
            self._num_put_existing += len(replies) - num_new

    def get_many(self, metas: Sequence[BlockMeta]) -> list[KVBlock | None]:
        """Fetch a chain in one pipelined round trip; the answer is prefix-shaped.

        Returns:
            One entry per meta. If position i is None, every position after i is None too:
            the caller uses the leading run of blocks only. Values after the first miss are
            not decoded (a child is useless without its parent).
        """
        return [None if got is None else got[0] for got in self.fetch_chain(metas)]

    def fetch_chain(
        self, metas: Sequence[BlockMeta], *, into: Sequence[KVBlock] = ()
    ) -> list[tuple[KVBlock, BlockExpiry | None] | None]:
        """``get_many`` with each block's expiry, as its verified header says; block ``i`` is
        decoded into ``into[i]`` where there is one, and is then that block (a page of the
        pool: no copy later).

        A hit restarts the key's expiry with the block's own TTL (see the module docstring):
        one more round trip, only when something was found.
        """
        results: list[tuple[KVBlock, BlockExpiry | None] | None] = [None] * len(metas)
        if not metas:
            return results
        client = self._admit()
        if client is None:
            with self._lock:
                self._stats.misses += len(metas)
            return results
        redis_keys = [self._remember(meta) for meta in metas]
        commands: list[tuple[object, ...]] = []
        for redis_key in redis_keys:
            # NOTE: the end index is inclusive, so an oversized value shows as
            # max_value_bytes + 1 bytes and is never read whole.
            commands += [("GETRANGE", redis_key, 0, self._max_value_bytes), ("PTTL", redis_key)]
        num_hits = 0
        poison_key: str | None = None
        slide: list[tuple[str, int]] = []  # keys of hits that expire, with their block's TTL
        began = time.perf_counter()
        try:
            # Each block is verified and decoded while the server sends the next one.
            replies = replies_as_they_arrive(client, commands)
            for i, meta in enumerate(metas):
                value, pttl = next(replies), next(replies)
                raise_first_error([value, pttl], allow=is_wrong_type)
                if num_hits < i:  # a block is missing before this one: read, not decoded
                    continue
                got, reason = self._decoded(meta, value, into[i] if i < len(into) else None)
                if reason is not None:
                    poison_key = self._reject(redis_keys[i], reason)
                if got is None:
                    continue
                results[i] = got
                num_hits += 1
                px = self.expiry_ms(got[1], on_hit=True)
                if isinstance(pttl, int) and pttl > 0 and px is not None:
                    slide.append((redis_keys[i], px))
            for _ in replies:  # past the last reply: the connection goes back to its pool
                raise AssertionError("more replies than commands")
        except REDIS_FAULTS as exc:
            self._faults.on_fault(exc)
            with self._lock:
                self._stats.misses += len(metas)
            return [None] * len(metas)
        self._faults.on_success(began)
        with self._lock:
            self._stats.hits += num_hits
            self._stats.misses += len(metas) - num_hits
            self._num_not_decoded += max(0, len(metas) - num_hits - 1)
        if poison_key is not None:
            self._unlink(client, [poison_key])
        if slide:
            self._set_expiry(client, slide)  # a hit restarts a sliding TTL
        return results

    def _decoded(self, meta: BlockMeta, value: object, into: KVBlock | None
                 ) -> tuple[tuple[KVBlock, BlockExpiry | None] | None, str | None]:
        """One GETRANGE reply as the block ``meta`` names, with its expiry; or None, and the
        reason to unlink the key when it holds something that is not that block."""
        if isinstance(value, ResponseError):  # WRONGTYPE: not a string, not ours
            return None, "type"
        if not value:
            return None, None  # absent (GETRANGE answers "" for a missing key; we never store "")
        if not isinstance(value, bytes):
            raise TierConfigError("the Redis client must be built with decode_responses=False")
        if len(value) > self._max_value_bytes:
            return None, "size"
        try:
            header, block = self._codec.decode_with_header(value, meta, into=into)
        except CodecError as exc:
            return None, exc.reason
        return (block, header.meta.expiry), None

    def expiry_ms(self, expiry: BlockExpiry | None, *, on_hit: bool = False) -> int | None:
        """``PX`` for a block with ``expiry``: its TTL capped by the store's, the store's for a
        block without one, None (no expiry) for a block pinned when written. When written,
        what is left of its TTL; after a hit (``on_hit``), its whole TTL again."""
        if expiry is not None and expiry.is_pinned:
            return None
        own = None
        if expiry is not None and expiry.ttl_s is not None:
            own = max(1, round(expiry.ttl_s * 1000))
            if expiry.expires_at is not None and not on_hit:
                own = min(own, max(1, round((expiry.expires_at - time.time()) * 1000)))
        if own is None:
            return self._ttl_ms
        return own if self._ttl_ms is None else min(own, self._ttl_ms)

    def refresh_expiry(self, metas: Sequence[BlockMeta]) -> None:
        """Give these blocks' keys the expiry their metas say now: ``PERSIST`` for a pinned
        block, ``PEXPIRE`` otherwise (pin and unpin reach the shared tier). Missing keys are
        left missing; a fault is counted and the keys keep their old expiry."""
        client = self._admit()
        if client is not None and metas:
            self._set_expiry(client, [(self._remember(meta), self.expiry_ms(meta.expiry))
                                      for meta in metas])

    def _set_expiry(self, client: RedisClient, items: Sequence[tuple[str, int | None]]) -> None:
        """``PEXPIRE`` each key by its ``PX`` (``PERSIST`` for None), in one round trip."""
        began = time.perf_counter()
        try:
            with client.pipeline(transaction=False) as pipe:
                for redis_key, px in items:
                    if px is None:
                        pipe.persist(redis_key)
                    else:
                        pipe.pexpire(redis_key, px)
                raise_first_error(pipe.execute(raise_on_error=False))
        except REDIS_FAULTS as exc:
            self._faults.on_fault(exc)
            return
        self._faults.on_success(began)

    def delete(self, key: BlockKey) -> None:
        """Delete a block this process put or got recently (see ``delete_meta`` otherwise).

        NOTE: a Redis key needs the namespace digest, which ``key`` alone does not carry; a
        key this store has not seen (or has forgotten) is counted in ``notes`` and ignored.
        """
        with self._lock:
            redis_key = self._block_key_to_redis_key.get(key)
            if redis_key is None:
                self._num_delete_unknown += 1
                return
        client = self._admit()
        if client is not None:
            self._unlink(client, [redis_key])

    def delete_meta(self, meta: BlockMeta) -> None:
        """Delete any block, given its meta (the general form of ``delete``)."""
        self.delete_metas([meta])

    def delete_metas(self, metas: Sequence[BlockMeta], *,
                     min_idle_s: float | None = None) -> int:
        """Delete these blocks in one round trip (two with ``min_idle_s``: only those idle at
        least that long, by ``OBJECT IDLETIME``); how many keys went (0 on a fault)."""
        client = self._admit()
        if client is None or not metas:
            return 0
        began = time.perf_counter()
        try:
            num = unlink_idle(client, [self._remember(m) for m in metas], min_idle_s)
        except REDIS_FAULTS as exc:
            self._faults.on_fault(exc)
            return 0
        self._faults.on_success(began)
        with self._lock:
            self._stats.deletes += num
        return num

    def contains(self, key: BlockKey) -> bool:
        """EXISTS for a block this process put or got recently; False when unknown or on error."""
        with self._lock:
            redis_key = self._block_key_to_redis_key.get(key)
        return redis_key is not None and self._exists(redis_key)

    def contains_meta(self, meta: BlockMeta) -> bool:
        """EXISTS for any block, given its meta; False on error. Does not verify the value."""
        return self._exists(self._remember(meta))

    def remove_where(self, *, namespace_digest: bytes | None = None, key: BlockKey | None = None,
                     min_idle_s: float | None = None) -> int:
        """Remove every block key of this deployment (``key_prefix``) in ``namespace_digest``
        (default: any), of block ``key`` (default: any), idle at least ``min_idle_s`` (default:
        however idle) -- SCAN + UNLINK on every primary, whichever replica wrote them. Returns
        how many keys were removed.

        A Redis fault stops it: it is counted, logged as a warning saying how far it got, and
        the keys left behind expire with their TTL; run it again to finish.
        """
        client = self._admit()
        if client is None:
            logger.warning("redis tier at %s is unavailable: nothing removed from it",
                           self._faults.where)
            return 0
        ns_part = "*" if namespace_digest is None else namespace_digest.hex()
        key_part = "*" if key is None else key.hex()
        pattern = f"{glob_escape(self._key_prefix)}:{ns_part}:{key_part}"
        with self._lock:
            for known, redis_key in list(self._block_key_to_redis_key.items()):
                _, ns_hex, key_hex = redis_key.rsplit(":", 2)
                if ns_part in ("*", ns_hex) and key_part in ("*", key_hex):
                    del self._block_key_to_redis_key[known]
        num_removed = 0
        began = time.perf_counter()
        try:
            num_removed = unlink_matching(client, pattern, min_idle_s=min_idle_s,
                                          batch=_FLUSH_BATCH)
        except REDIS_FAULTS as exc:
            self._faults.on_fault(exc)
            logger.warning("removing keys from the redis tier at %s stopped early: %s",
                           self._faults.where, self._faults.describe(exc))
        else:
            self._faults.on_success(began)
        with self._lock:
            self._stats.deletes += num_removed
        return num_removed

    def stats(self) -> StoreReport:
        """A snapshot of the counters. ``num_blocks``/``num_bytes`` stay 0: Redis holds the
        blocks of every replica and its size is Redis's to report."""
        state = self._breaker.state
        notes = self._faults.notes()
        with self._lock:
            notes |= {
                "num_skipped_breaker_open": self._num_skipped,
                "num_dropped_puts": self._num_dropped_puts,
                "num_put_existing": self._num_put_existing,
                "num_not_decoded_after_miss": self._num_not_decoded,
                "num_delete_unknown": self._num_delete_unknown,
            }
            return replace(
                self._stats.report(), errors=self._faults.num_errors, notes=notes,
                is_available=state != "open" and self._is_started and not self._is_closed)

    # ------------------------------------------------------------------ internals

    def redis_key(self, meta: BlockMeta) -> str:
        """The Redis key that holds a block (for admin tools and tests)."""
        return f"{self._key_prefix}:{meta.namespace_digest.hex()}:{meta.key.hex()}"

    def _remember(self, meta: BlockMeta) -> str:
        redis_key = self.redis_key(meta)
        with self._lock:
            self._block_key_to_redis_key[meta.key] = redis_key
            self._block_key_to_redis_key.move_to_end(meta.key)
            if len(self._block_key_to_redis_key) > _NUM_KNOWN_KEYS:
                self._block_key_to_redis_key.popitem(last=False)
        return redis_key

    def _admit(self) -> RedisClient | None:
        """The client to use now, or None when the breaker refuses (no network touched)."""
        if not self._is_started or self._is_closed:
            raise RuntimeError("RedisStore used before start() or after close()")
        if not self._breaker.allow():
            with self._lock:
                self._num_skipped += 1
            return None
        try:
            return self._ensure_client()
        except REDIS_FAULTS as exc:  # a cluster client connects while it is built
            self._faults.on_fault(exc)
            return None

    def _ensure_client(self) -> RedisClient:
        with self._client_lock:
            if self._client is None:
                if self._is_closed:
                    raise RuntimeError("RedisStore used after close()")
                self._client = self._build_client()
            return self._client

    def _build_client(self) -> RedisClient:
        assert self._url is not None  # no url means an injected client, never rebuilt
        try:
            return build_client(self._url, cluster=self._is_cluster,
                                socket_timeout_s=self._socket_timeout_s,
                                connect_timeout_s=self._connect_timeout_s)
        except ValueError as exc:
            # NOTE: `from None`: the original message may quote the URL, password included.
            where, detail = self._faults.where, self._faults.scrub(str(exc))
            raise TierConfigError(f"bad Redis URL {where}: {detail}") from None

    def _reject(self, redis_key: str, reason: str) -> str:
        with self._lock:
            self._stats.count_failure(reason)
        logger.debug("redis value at %s failed verification (%s); deleting it", redis_key, reason)
        return redis_key

    def _unlink(self, client: RedisClient, redis_keys: list[str]) -> bool:
        began = time.perf_counter()
        try:
            num = unlink_all(client, redis_keys)
        except REDIS_FAULTS as exc:
            self._faults.on_fault(exc)
            return False
        self._faults.on_success(began)
        with self._lock:
            self._stats.deletes += num
        return True

    def _exists(self, redis_key: str) -> bool:
        client = self._admit()
        if client is None:
            return False
        began = time.perf_counter()
        try:
            num = client.exists(redis_key)
        except REDIS_FAULTS as exc:
            self._faults.on_fault(exc)
            return False
        self._faults.on_success(began)
        return bool(num)
