"""A request's blocks: the cached prefix it leases and loads, and what it stores as it runs.

The step loop decides when (admission, the end of a prefill, the end of an answer); this decides
what: which namespace a request reads (its own, or the shared scope where an admin published a
longer prefix), which tail of its conversation it continues, and which blocks are new. Storing
an answer's blocks needs no recomputation where decoding writes the K/V a prefill writes
(``gateway.engine.parity.probe``); on the serial route they are recomputed block-aligned first
(docs/design.md, "Parity"). Every block a request reads or stores in its own namespace is
reported to the cache's session registry with the request's session (or none), which decides
whose block it is (``gateway.cache.sessions``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import ExitStack

import numpy as np
import torch

from gateway.cache.prefix_cache import Lease, PrefixCache
from gateway.core.fingerprint import Namespace, Scope
from gateway.core.requests import SHARED_SCOPE_TIER, GenerateRequest
from gateway.core.tokens import TokenIds, as_token_ids
from gateway.engine.forward.batched import SequenceRows, StepForward
from gateway.engine.forward.kept_states import state_bytes
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.kv.stateful_tail import StatefulTail
from gateway.engine.kv.tail_cache import TAIL_TIER, TailCache
from gateway.engine.parity.shadow import ShadowVerifier
from gateway.engine.scheduling.jobs import Job
from gateway.engine.scheduling.loop_records import ActiveRequest, LeasedPrefix, LoopSettings
from tiers.payload import KVBlock


class RequestBlocks:
    """Reads and writes the prefix cache for the step loop's requests.

    Args:
        cache: the prefix cache.
        forward: recomputes an answer's blocks on the serial route.
        settings: the loop's settings (block size, what to store).
        namespace_of: the namespace of a scope.
        tails: where conversation tails are kept (None: none are).
        shadow: offered every cache hit, to verify some cold when idle (None: none are).
    """

    def __init__(self, *, cache: PrefixCache, forward: StepForward, settings: LoopSettings,
                 namespace_of: Callable[[Scope], Namespace], tails: TailCache | None,
                 shadow: ShadowVerifier | None = None) -> None:
        self._cache = cache
        self._shadow = shadow
        self._forward = forward
        self._settings = settings
        self._namespace_of = namespace_of
        self._tails = tails

    def lease(self, job: Job, stack: ExitStack, max_blocks: int | None,
              recompute_s_per_token: float | None, tokens: TokenIds | None = None
              ) -> LeasedPrefix:
        """Lease the request's cached prefix (its own namespace's, or the shared scope's where
        longer) until ``stack`` closes, and load it; ``recompute_s_per_token`` decides which
        tiers are worth reading. ``tokens``: what the request's sequence holds, when not its
        prompt alone (a preempted generation resumed: its prompt and what it generated)."""
        request = job.request
        namespace = self._namespace_of(request.scope)
        tokens = job.tokens if tokens is None else tokens
        lease = stack.enter_context(self._cache.acquire(namespace, tokens))
        source = lease
        if request.scope.kind == "tenant":
            # Prompts an admin published in the shared scope are read by every tenant; what the
            # tenant then stores goes to its own namespace, never to the shared one.
            shared = stack.enter_context(
                self._cache.acquire(self._namespace_of(Scope.shared()), tokens))
            if shared.match.num_blocks > lease.match.num_blocks:
                source = shared
        blocks = self._cache.load(source, recompute_s_per_token=recompute_s_per_token,
                                  max_blocks=max_blocks)
        bt = self._settings.block_tokens
        by_tier: dict[str, int] = {}
        for tier in source.match.tiers[:len(blocks)]:
            if source is not lease:  # the shared scope: its tier would tell of other tenants
                tier = SHARED_SCOPE_TIER
            by_tier[tier] = by_tier.get(tier, 0) + bt
        self._cache.sessions.note_use(namespace, _session_of(job), lease.records,
                                      lease.match.tiers)
        lossy = (self._lossy_extension(job, namespace, tokens, stack, len(blocks), max_blocks,
                                       recompute_s_per_token)
                 if source is lease else None)
        if lossy is not None:
            lossy_lease, extra = lossy
            fmt = lossy_lease.namespace.quantization
            for tier in lossy_lease.match.tiers[len(blocks):len(blocks) + len(extra)]:
                by_tier[f"{tier}:{fmt}"] = by_tier.get(f"{tier}:{fmt}", 0) + bt
            self._cache.sessions.note_use(lossy_lease.namespace, _session_of(job),
                                          lossy_lease.records, lossy_lease.match.tiers)
            # From here on the request computes on approximate K/V: it reads and stores in
            # the lossy namespace, and is never offered to the shadow check (not exact).
            return LeasedPrefix(lease=lossy_lease, namespace=lossy_lease.namespace,
                                reads_own_namespace=True, blocks=[*blocks, *extra],
                                cached_by_tier=by_tier, lossy=True)
        if self._shadow is not None and blocks:
            match = source.match  # what was loaded: its keys and the tier each came from
            self._shadow.offer(namespace=source.namespace, tokens=tokens, keys=match.keys,
                               tiers=match.tiers, blocks=blocks)
        return LeasedPrefix(lease=lease, namespace=namespace,
                            reads_own_namespace=source is lease, blocks=blocks,
                            cached_by_tier=by_tier)

    def _lossy_extension(self, job: Job, namespace: Namespace, tokens: TokenIds,
                         stack: ExitStack, num_exact: int, max_blocks: int | None,
                         recompute_s_per_token: float | None
                         ) -> tuple[Lease, list[KVBlock]] | None:
        """The lossy copies that continue the exact prefix's ``num_exact`` blocks, leased
        until ``stack`` closes -- for a request that allows them, where a lower tier keeps
        them; None where none continues it (nothing is then held)."""
        request = job.request
        if not (isinstance(request, GenerateRequest) and request.cache.allow_lossy):
            return None
        lossy = self._cache.lossy_namespace(namespace)
        if lossy is None:
            return None
        with ExitStack() as trial:
            lossy_lease = trial.enter_context(self._cache.acquire(lossy, tokens))
            extra = self._cache.load(lossy_lease, recompute_s_per_token=recompute_s_per_token,
                                     max_blocks=max_blocks, start=num_exact)
            if not extra:
                return None
            stack.enter_context(trial.pop_all())
        return lossy_lease, extra

    def computing_shared_blocks(self, job: Job, tokens: TokenIds,
                                running: Iterable[ActiveRequest]) -> int | None:
        """The id of a request of ``running`` now prefilling full blocks ``job`` needs (of its
        ``tokens``), or None: ``job`` then waits for them instead of computing them too."""
        request = job.request
        if isinstance(request, GenerateRequest) and request.cache.no_cache:
            return None
        bt = self._settings.block_tokens
        namespace = self._namespace_of(request.scope)
        for other in running:
            if (other.lease is None or other.namespace != namespace
                    or other.seq.length >= other.target):
                continue
            theirs = other.tokens
            n = min(len(tokens), len(theirs), other.target) // bt * bt
            if n == 0:
                continue
            same = np.flatnonzero(tokens[:n] != theirs[:n])
            common_blocks = (int(same[0]) if same.size else n) // bt
            if common_blocks > len(other.loaded_blocks):
                return other.job.id
        return None

    def find_tail(self, active: ActiveRequest, blocks: list[KVBlock]) -> list[KVBlock]:
        """The kept tail a generation continues after its loaded blocks ([] if none), leaving
        at least its last prompt token to compute (its logits are needed)."""
        lease = active.lease
        if (self._tails is None or not blocks or lease is None or active.namespace is None
                or not active.reads_own_namespace or len(lease.records) != len(blocks)
                or not isinstance(active.job.request, GenerateRequest)):
            return []
        start = len(blocks) * self._settings.block_tokens
        following = active.tokens[start:]
        kv = self._tails.find(active.namespace, lease.records[-1], following,
                              max_tokens=len(following) - 1, session_id=_session_of(active.job))
        if kv is None:
            return []
        # Kept in the engine's memory, where the model runs: reported as the device's (with
        # the format, for a lossy request's tail: it was computed on lossy K/V).
        tier = TAIL_TIER if active.namespace.exact else (
            f"{TAIL_TIER}:{active.namespace.quantization}")
        active.cached_by_tier[tier] = active.cached_by_tier.get(tier, 0) + kv.num_tokens
        return [kv]

    def store_prompt_blocks(self, active: ActiveRequest) -> None:
        """Store the prompt's full blocks not yet cached, once its prefill has reached them;
        the request's tag, if it names one, is recorded on every block of its prompt cached
        in its namespace, those it found and those it stores (an eviction by tag drops every
        block the tagged prompt needs, not only those it computed)."""
        if active.lease is None:
            return
        bt = self._settings.block_tokens
        num_full = len(active.job.tokens) // bt
        own = active.lease.match.num_blocks
        blocks = active.loaded_blocks
        end = min(num_full, active.seq.length // bt)
        fresh = [blocks[i] if i < len(blocks) else active.seq.block(i, bt)
                 for i in range(own, end)]
        result = self._cache.insert(active.lease, tier=self._cache.tier_names[0], blocks=fresh,
                                    ttl_s=active.ttl_s, num_blocks=end, tag=_tag_of(active.job))
        active.stored_new = result.num_new_blocks
        if active.namespace is not None:
            self._cache.sessions.note_stored(active.namespace, _session_of(active.job),
                                             active.lease.keys[own:end])

    def store_for_resume(self, active: ActiveRequest) -> None:
        """Hand a preempted generation's complete K/V to the cache so that it resumes as a hit
        on its own tokens (``gateway.engine.scheduling.preemption``): its prompt's full blocks, its
        answer's (where answers are stored) and the tail after them (where tails are kept)."""
        if active.seq.length < len(active.job.tokens):
            self.store_prompt_blocks(active)  # preempted while prefilling
        if self._settings.store_generated_blocks:
            self.store_answer(active)

    def store_answer(self, active: ActiveRequest) -> None:
        """Store the full blocks the answer filled (recomputed first on the serial route), then
        keep the conversation's tail (where tails are kept) for its next turn."""
        if active.namespace is None:
            return
        self._cache.sessions.touch(active.namespace, _session_of(active.job))  # it ends now
        everything = as_token_ids(np.concatenate(
            [active.job.tokens, np.asarray(active.generated, np.uint32)]))
        self._store_generated(active, active.namespace, everything)
        if self._tails is not None:
            self._keep_tail(active, active.namespace, everything, self._tails)

    def _store_generated(self, active: ActiveRequest, namespace: Namespace,
                         everything: TokenIds) -> None:
        bt = self._settings.block_tokens
        first = len(active.job.tokens) // bt
        num_full = min(len(everything), active.seq.length) // bt
        if num_full <= first:
            return
        with self._cache.acquire(namespace, everything, to_load=False) as lease:
            stored = lease.match.num_blocks  # past ``first`` where it was preempted and resumed
            if stored < first:
                return  # the prompt's blocks are not all stored: nothing to continue
            if not self._settings.decode_kv_is_prefill_kv:
                self._recompute(active.seq, everything, first * bt, num_full * bt)
            fresh = [active.seq.block(i, bt) for i in range(stored, num_full)]
            self._cache.insert(lease, tier=self._cache.tier_names[0], blocks=fresh,
                               ttl_s=active.ttl_s)
            self._cache.sessions.note_stored(namespace, _session_of(active.job),
                                             lease.keys[stored:num_full])

    def _keep_tail(self, active: ActiveRequest, namespace: Namespace, everything: TokenIds,
                   tails: TailCache) -> None:
        bt = self._settings.block_tokens
        length = active.seq.length  # the last generated token was never fed back
        num_full = length // bt
        if num_full == 0 or length == num_full * bt:
            return
        # The record of the block the tail continues (just stored): insert hands back no records.
        with self._cache.acquire(namespace, everything[:num_full * bt], to_load=False) as lease:
            if lease.match.num_blocks != num_full:
                return  # the blocks it continues are not all stored
            parent = lease.records[-1]
        kv = active.seq.span(num_full * bt, length)
        if active.seq.states:  # recurrent layers: their states at the tail's end go with it
            kv = StatefulTail.of(kv, active.seq.states, state_bytes(active.seq.states))
        tails.keep(namespace, parent, everything[num_full * bt:length], kv,
                   session_id=_session_of(active.job))

    def _recompute(self, seq: KVSequence, tokens: np.ndarray, start: int, end: int) -> None:
        """Recompute tokens[start:end] block-aligned (the serial route's decode K/V differ)."""
        bt = self._settings.block_tokens
        ids = torch.from_numpy(tokens.astype(np.int64))
        seq.truncate(start)
        for at in range(start, end, bt):
            self._forward.forward([SequenceRows(sequence=seq, tokens=ids[at:at + bt],
                                                wants_logits=False)])


def _tag_of(job: Job) -> str | None:
    """The tag a request's prompt blocks carry (``CacheOptions.tag``, ``WarmRequest.tag``)."""
    request = job.request
    return request.cache.tag if isinstance(request, GenerateRequest) else request.tag


def _session_of(job: Job) -> str | None:
    """The session a request belongs to (a warm belongs to none)."""
    request = job.request
    return request.cache.session_id if isinstance(request, GenerateRequest) else None
