"""Operators' view of the cache: list, evict, pin, quota and flush, across every tenant.

The request path asks the cache about one prompt in one namespace; an operator asks about
*sets* of blocks -- everything of a tenant, everything under a system prompt, everything idle
for an hour, everything in one tier -- and about every replica at once (an eviction must reach
the shared Redis tier, or another replica would serve the prefix back). That selection, and the
checks on what an operator sent, live here, apart from the lease and insert logic they would
otherwise crowd; the removals in Redis that an eviction resolves to are
``gateway.cache.operations.remote_eviction``, and sessions' listing and reset
``gateway.cache.operations.session_admin`` (``CacheAdmin.sessions``). ``CacheAdmin`` is what the
gRPC Admin service calls.

What an operator names (prefix text, a scope) becomes tokens and namespaces through
``PromptKeys``: the engine implements it, since it owns the tokenizer and the model's
namespaces; this module only sees the protocol.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.cache.lossy_copies import lossy_copies
from gateway.cache.operations.invalidation import EvictionEvent
from gateway.cache.operations.remote_eviction import evict_remote
from gateway.cache.operations.session_admin import SessionAdmin
from gateway.cache.operations.tags import tagged_blocks, tags_of
from gateway.cache.prefix_cache import PrefixCache
from gateway.cache.radix_index import BlockRecord, RadixIndex
from gateway.core.admin_reports import Evicted, PrefixInfo, StatsReport
from gateway.core.canonical import PromptInput
from gateway.core.errors import EvictionNotPublished, InvalidRequest, NotFound
from gateway.core.fingerprint import Namespace, Scope
from gateway.core.tags import checked_tag
from gateway.core.tokens import TokenIds, tokens_from_bytes
from policies.base import BlockKey
from tiers.hierarchy import REMOTE

logger = logging.getLogger(__name__)

PREVIEW_TOKENS = 24
"""How many tokens of a prefix's first block a listing shows as text."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptBlocks:
    """A prompt an eviction selects, with the keys of its full blocks (``prompt_blocks``).

    NOTE: the keys are computed when this is built, before the cache's lock is taken: hashing
    a long prompt's chain inside ``placement.locked()`` would hold every request's lease back
    for as long (issue 44).
    """

    namespace: Namespace
    tokens: TokenIds
    keys: tuple[BlockKey, ...]


def prompt_blocks(cache: PrefixCache, namespace: Namespace, tokens: TokenIds) -> PromptBlocks:
    """``tokens`` in ``namespace`` with their block keys, hashed here (without the lock)."""
    keys = cache.fingerprinter(namespace).block_keys(tokens)
    return PromptBlocks(namespace=namespace, tokens=tokens, keys=tuple(keys))


class EvictionPublisher(Protocol):
    """Tells the other replicas what was evicted
    (``gateway.cache.operations.invalidation.EvictionFeed``)."""

    def publish(self, event: EvictionEvent) -> bool:
        """False if they could not be told."""
        ...


class PromptKeys(Protocol):
    """Turns what an operator names into what the cache is keyed by (``Engine``)."""

    def namespace(self, scope: Scope) -> Namespace:
        """The namespace of ``scope`` for the served model."""
        ...

    def known_namespaces(self) -> list[Namespace]:
        """Every namespace derived so far (including those with nothing cached locally)."""
        ...

    def prompt_tokens(self, prompt: PromptInput) -> TokenIds:
        """The canonical tokens of ``prompt``."""
        ...

    def preview(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, for a listing."""
        ...


# ---- selection ----------------------------------------------------------------------------


def list_prefixes(cache: PrefixCache, *, owner: str | None = None, limit: int = 100,
                  preview: Callable[[Sequence[int]], str] = lambda _: "") -> list[PrefixInfo]:
    """One entry per cached prompt (a leaf of a trie), most recently used first.

    Args:
        cache: the cache to list.
        owner: only this tenant's (or "shared") prefixes; None for all.
        limit: the most entries returned.
        preview: the text of a prompt's first ``PREVIEW_TOKENS`` tokens (none by default:
            the cache keeps token ids, the engine's tokenizer turns them into text).

    Returns:
        The entries, most recently used first.
    """
    placement = cache.placement
    with placement.locked():
        now = placement.now()
        index = placement.index
        leaves = [
            r for r in index.records()
            if not index.has_children(r) and (owner is None or r.namespace.scope.owner == owner)
        ]
        leaves.sort(key=lambda r: r.last_access, reverse=True)
        out = []
        for leaf in leaves[:limit]:
            path = _path_to(leaf)
            out.append(
                PrefixInfo(
                    tenant=leaf.namespace.scope.owner,
                    key_hex=leaf.key.hex(),
                    num_blocks=len(path),
                    num_tokens=len(path) * cache.block_tokens,
                    num_bytes=sum(r.num_bytes for r in path),
                    tiers=placement.tiers_in(path),
                    age_s=max(0.0, now - leaf.created_at),
                    idle_s=max(0.0, now - leaf.last_access),
                    num_hits=leaf.num_hits,
                    is_pinned=any(r.is_pinned for r in path),
                    preview=preview([int(t) for t in
                                     tokens_from_bytes(path[0].tokens)[:PREVIEW_TOKENS]]),
                    tags=tags_of(path),
                )
            )
        return out


def _path_to(record: BlockRecord) -> list[BlockRecord]:
    path = []
    node: BlockRecord | None = record
    while node is not None:
        path.append(node)
        node = node.parent
    path.reverse()
    return path


def chain_of(index: RadixIndex, record: BlockRecord) -> list[BlockRecord]:
    """The blocks that exist only for ``record``'s prompt and what follows it: ``record``,
    everything after it, and its ancestors up to (not including) the nearest one that another
    prompt continues from. Ancestors first.

    NOTE: ``kvgate admin ls`` shows a prompt by its last block's key; evicting only that
    block (and its descendants) would leave the rest of the prompt cached, which is not what
    an operator who names the listed prompt means.
    """
    ancestors: list[BlockRecord] = []
    node = record.parent
    while node is not None and len(index.children(node)) == 1:
        ancestors.append(node)
        node = node.parent
    ancestors.reverse()
    return ancestors + list(index.subtree(record.namespace, record))


def resolve_key(cache: PrefixCache, key_hex: str) -> BlockKey:
    """The cached block whose key begins with ``key_hex`` (any case; ``kvgate admin ls`` shows
    16 hex digits of a key, and any unique prefix names it).

    Raises:
        InvalidRequest: not hex, or the key of more than one cached block begins with it.
        NotFound: no cached block's key begins with it (on this replica).
    """
    prefix = key_hex.strip().lower()
    if not prefix or any(c not in "0123456789abcdef" for c in prefix):
        raise InvalidRequest(f"key_hex must be hex digits (a block key or its beginning, as "
                             f"ListPrefixes and `kvgate admin ls` show it), got {key_hex!r}")
    placement = cache.placement
    with placement.locked():
        matches = [r.key for r in placement.index.records() if r.key.hex().startswith(prefix)]
    if not matches:
        raise NotFound(f"no cached block's key begins with {key_hex!r}: it was evicted, or it "
                       "is not a key of this replica (`kvgate admin ls` lists the keys)")
    if len(matches) > 1:
        shown = ", ".join(sorted(k.hex()[: len(prefix) + 4] for k in matches)[:5])
        raise InvalidRequest(f"key {key_hex!r} is ambiguous: {len(matches)} cached blocks' "
                             f"keys begin with it ({shown}{', ...' if len(matches) > 5 else ''}"
                             "); give more of it")
    return matches[0]


def evict_where(
    cache: PrefixCache,
    *,
    owner: str | None = None,
    under: PromptBlocks | None = None,
    key: BlockKey | None = None,
    idle_s: float | None = None,
    tier: str | None = None,
    tag: str | None = None,
) -> dict[str, int]:
    """Drop every local block matching all the given selectors.

    Pinned blocks go too (an operator asked); blocks in use by a running request stay. A block
    is only dropped from a tier after its children there, so a selection that would orphan
    children keeps the parents it needs.

    Args:
        cache: the cache to evict from.
        owner: blocks of this tenant (or "shared").
        under: blocks of this prompt and everything after it (its keys hashed beforehand:
            nothing is hashed under the lock).
        key: one block, everything after it, and the ancestors only it continues from
            (``chain_of``).
        idle_s: blocks not used for at least this many seconds.
        tier: drop only the copies in this tier (default: every tier).
        tag: blocks carrying this tag and everything after them (``tagged_blocks``).

    Returns:
        Bytes freed per tier.

    Raises:
        ValueError: ``tier`` is not a tier of the cache.
    """
    placement = cache.placement
    tiers = [placement.slot(tier).name] if tier is not None else list(cache.tier_names)
    with placement.locked():
        now = placement.now()
        index = placement.index
        selected: list[BlockRecord]
        if under is not None:
            _, records, _ = cache.match_records(under.namespace, under.tokens, list(under.keys))
            if not records or len(records) < len(under.keys):
                selected = []
            else:
                # The prefix's own blocks and everything built on it; blocks of the prefix
                # that other prompts still continue from stay (they are not leaves).
                selected = records[:-1] + list(index.subtree(under.namespace, records[-1]))
        elif key is not None:
            start = index.get(key)
            selected = [] if start is None else chain_of(index, start)
        elif tag is not None:
            tagged = tagged_blocks(index, tag, owner=owner)
            # The lossy copies written through for the tagged blocks go with them.
            copies = [record for ns, k in lossy_copies(cache, tagged)
                      if (record := index.get(k)) is not None and record.namespace == ns]
            selected = list({id(r): r for r in [
                *tagged, *(r for c in copies for r in index.subtree(c.namespace, c))]}.values())
        else:
            selected = list(index.records())
        selected = [
            r for r in selected
            if (owner is None or r.namespace.scope.owner == owner)
            and (idle_s is None or now - r.last_access >= idle_s)
        ]
        freed: dict[str, int] = {}
        # Deepest first, so that children leave before their parents.
        for record in sorted(selected, key=lambda r: r.depth, reverse=True):
            if record.key not in index or record.refcount:
                continue
            for name in tiers:
                if placement.may_leave(record, name):
                    placement.evict_copy(record, name, "admin")
                    freed[name] = freed.get(name, 0) + record.num_bytes
            placement.drop_unheld([record])
        if (under is None and key is None and owner is None and idle_s is None and tier is None
                and tag is None):
            placement.tell_if_cleared()  # everything was selected
        moves = placement.take_moves()
    cache.run_moves(moves)  # the deletions, after the lock
    cache.keep_pins()  # a pin went with its block's last copy: the pin log forgets it
    return freed


# ---- the admin surface --------------------------------------------------------------------


class CacheAdmin:
    """The Admin service's operations on one cache, with the checks on what an operator sent.

    Args:
        cache: the cache administered.
        keys: prompt text and scopes to tokens and namespaces (the engine).
        feed: where evictions are published for the other replicas (None: a lone replica).
    """

    def __init__(self, cache: PrefixCache, keys: PromptKeys, *,
                 feed: EvictionPublisher | None = None) -> None:
        self._cache = cache
        self._keys = keys
        self._feed = feed
        self.sessions = SessionAdmin(cache, feed=feed)
        """Sessions: list and reset (every tier, every replica)."""

    def stats(self) -> StatsReport:
        """Every figure of the cache (``PrefixCache.stats``)."""
        return self._cache.stats()

    def list_prefixes(self, *, tenant: str | None, limit: int) -> list[PrefixInfo]:
        """The cached prompts (of ``tenant``, or all), most recently used first."""
        return list_prefixes(self._cache, owner=tenant, limit=limit, preview=self._keys.preview)

    def evict(
        self,
        *,
        tenant: str | None = None,
        prefix_text: str | None = None,
        key_hex: str | None = None,
        older_than_s: float | None = None,
        tier: str | None = None,
        everything: bool = False,
        tag: str | None = None,
    ) -> Evicted:
        """Drop blocks matching every given selector (``everything`` for all): here, in the
        shared Redis tier (every selector reaches it, unless ``tier`` names a local tier), and
        on every other replica (published, see ``gateway.cache.operations.invalidation``).

        ``key_hex`` may be any unique beginning of a cached block's key; it selects that
        block's whole chain (``chain_of``), and the full key is what is published.

        ``prefix_text`` selects the prompts that begin with it *as warmed*: the text as a
        system message rendered by the model's chat template without a generation prompt
        (how ``kvgate prewarm`` warms a text file, and how a chat under that system prompt
        begins), and the text as a raw prompt. Every full block of a rendering must be cached
        for it to select anything; its blocks and everything built on them go.

        ``tag`` selects the blocks tagged so on this replica (``gateway.cache.operations.tags``) and
        everything built on them; with ``tenant``, only that tenant's.

        Raises:
            InvalidRequest: no selector, an unknown tier, a bad age or key, a key prefix
                that more than one cached block's key begins with, or prefix text without the
                tenant it belongs to.
            NotFound: ``key_hex`` begins no cached block's key (``resolve_key``).
            EvictionNotPublished: done here and in Redis, but the other replicas could not be
                told (retry: an eviction is idempotent).
        """
        cache = self._cache
        if not (everything or tenant or prefix_text or key_hex or older_than_s is not None
                or tier or tag is not None):
            raise InvalidRequest("say what to evict: a tenant, a prefix, a key, an age, a tier, "
                                 "a tag, or everything")
        if tag is not None:
            checked_tag(tag)
        if tier is not None and tier not in (*cache.tier_names, REMOTE):
            raise InvalidRequest(f"unknown tier {tier!r}; tiers are "
                                 f"{[*cache.tier_names, REMOTE]}")
        if older_than_s is not None and not (math.isfinite(older_than_s) and older_than_s >= 0):
            raise InvalidRequest("older_than_s must be a non-negative number of seconds")
        if prefix_text is not None and tenant is None:
            raise InvalidRequest("evicting by prefix text needs the tenant it belongs to")
        if key_hex is not None:
            key_hex = resolve_key(cache, key_hex).hex()
        event = EvictionEvent(tenant=tenant, prefix_text=prefix_text, key_hex=key_hex,
                              older_than_s=older_than_s, tier=tier, everything=everything,
                              tag=tag)
        before = cache.stats().num_blocks
        selections = self._selections(event)
        if event.tier in (None, REMOTE):
            self._evict_remote(event, selections)
        freed = self._evict_local(event, selections)
        result = Evicted(num_blocks=max(0, before - cache.stats().num_blocks),
                             bytes_by_tier=freed)
        if self._feed is not None and not self._feed.publish(event):
            raise EvictionNotPublished(
                f"evicted here ({result.num_blocks} blocks) and from Redis, but the other "
                "replicas could not be told: Redis is unreachable; retry the eviction")
        return result

    def apply_event(self, event: EvictionEvent, *, remote: bool = False) -> None:
        """Apply an eviction another replica published to this replica's local tiers.

        The event came from the shared stream, which anyone who can write Redis can write:
        what does not apply here (a tier this replica lacks, a key that is not hex) is
        logged and skipped.

        ``remote``: also remove what it selects from the shared Redis tier, for a replica whose
        namespaces the publisher cannot know (a vLLM worker's: their device kind is vLLM's
        page layout, docs/vllm-worker.md); removing is idempotent.
        """
        if event.session is not None:  # a session reset: never a whole tenant's eviction
            self.sessions.apply_event(event)
            return
        try:
            if event.tier is not None and event.tier not in (*self._cache.tier_names, REMOTE):
                raise InvalidRequest("it names a tier this replica does not have")
            selections = self._selections(event)
            if remote and event.tier in (None, REMOTE):
                self._evict_remote(event, selections)
            freed = self._evict_local(event, selections)
        except InvalidRequest as exc:  # e.g. a tier this replica does not have
            logger.warning("an eviction from another replica does not apply here: %s", exc)
            return
        logger.info("applied an eviction from another replica: %s bytes freed",
                    sum(freed.values()))

    def _selections(self, event: EvictionEvent) -> list[PromptBlocks | None]:
        """The prompts ``event.prefix_text`` names (module docstring of ``evict``), or
        ``[None]`` when it names none. Tokenised and hashed here, before any lock is taken;
        the text is bounded like a prompt (at the Admin edge, and ``EventBounds`` for an event
        read from the stream)."""
        if event.prefix_text is None or event.tenant is None:
            return [None]
        namespace = self._keys.namespace(_scope_of(event.tenant))
        renderings = (
            PromptInput(messages=[{"role": "system", "content": event.prefix_text}],
                        add_generation_prompt=False),
            PromptInput(prompt=event.prefix_text),
        )
        out: list[PromptBlocks | None] = []
        cache = self._cache
        lossy = cache.lossy_namespace(namespace)
        for prompt in renderings:
            try:
                tokens = self._keys.prompt_tokens(prompt)
            except InvalidRequest:
                continue  # e.g. no chat template: only the raw rendering
            out.append(prompt_blocks(cache, namespace, tokens))
            if lossy is not None:  # and the lossy copies of the same prompt
                out.append(prompt_blocks(cache, lossy, tokens))
        return out

    def _evict_local(self, event: EvictionEvent,
                     selections: Sequence[PromptBlocks | None]) -> dict[str, int]:
        if event.tier == REMOTE:
            return {}
        key = None if event.key_hex is None else _key_of(event.key_hex)
        freed: dict[str, int] = {}
        for under in selections:
            for name, num_bytes in evict_where(
                self._cache, owner=event.tenant, under=under, key=key,
                idle_s=event.older_than_s, tier=event.tier, tag=event.tag,
            ).items():
                freed[name] = freed.get(name, 0) + num_bytes
        return freed

    def _evict_remote(self, event: EvictionEvent,
                      selections: Sequence[PromptBlocks | None]) -> None:
        """The shared tier: what one replica evicts must not come back from Redis. What the
        event selects is resolved here (namespaces, chains); ``remote_eviction`` removes it."""
        transfers = self._cache.transfers
        if transfers is None or not transfers.has_remote:
            return
        scope_namespaces = None
        if event.tenant is not None:
            scope = _scope_of(event.tenant)
            known = {*self._cache.known_namespaces(), *self._keys.known_namespaces(),
                     self._keys.namespace(scope)}
            exact = [ns for ns in known if ns.scope == scope]
            lossy = [lossy for ns in exact if (lossy := self._cache.lossy_namespace(ns))]
            scope_namespaces = list(dict.fromkeys([*exact, *lossy]))
        chain_keys = None if event.key_hex is None else self._chain_keys(_key_of(event.key_hex))
        prompts = [None if s is None else (s.namespace, s.tokens) for s in selections]
        evict_remote(self._cache, event, selections=prompts,
                     scope_namespaces=scope_namespaces, chain_keys=chain_keys)

    def _chain_keys(self, key: BlockKey) -> list[BlockKey]:
        """The keys of ``key``'s chain as this replica knows it (just ``key`` if unknown)."""
        placement = self._cache.placement
        with placement.locked():
            start = placement.index.get(key)
            if start is None:
                return [key]
            return [r.key for r in chain_of(placement.index, start)]

    def set_pinned(self, prompt: PromptInput, scope: Scope, is_pinned: bool) -> int:
        """Pin (or unpin) the cached full blocks of ``prompt`` in ``scope``; how many changed."""
        tokens = self._keys.prompt_tokens(prompt)
        return self._cache.set_pinned(self._keys.namespace(scope), tokens, is_pinned)

    def set_quota(self, tenant: str, num_bytes: int | None) -> None:
        """Cap what ``tenant`` may hold in every tier (None: no cap).

        Raises:
            InvalidRequest: a negative quota.
        """
        if num_bytes is not None and num_bytes < 0:
            raise InvalidRequest("a quota must be >= 0 bytes")
        self._cache.set_quota(tenant, num_bytes)

    def flush(self) -> Evicted:
        """Evict everything, everywhere."""
        return self.evict(everything=True)


def _key_of(key_hex: str) -> BlockKey:
    """The block key ``key_hex`` names.

    Raises:
        InvalidRequest: not hex.
    """
    try:
        return BlockKey(bytes.fromhex(key_hex))
    except ValueError:
        raise InvalidRequest(f"key must be hex, got {key_hex!r}") from None


def _scope_of(tenant: str) -> Scope:
    return Scope.shared() if tenant == "shared" else Scope.of_tenant(tenant)
