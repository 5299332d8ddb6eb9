"""What a request holds of the cache: its match (``PrefixMatch``), its lease on the matched
blocks (``Lease``), and what an insert stored (``InsertResult``) -- the records of
``gateway.cache.prefix_cache``, apart from the object that makes them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gateway.cache.load_plan import PlannedRead
from gateway.cache.radix_index import BlockRecord
from gateway.core.errors import IndexInvariantError
from gateway.core.fingerprint import Namespace
from gateway.core.tokens import TokenIds
from policies.base import BlockKey


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixMatch:
    """How much of a prompt is cached (in its own namespace), and where.

    Attributes:
        num_blocks: full blocks of the prompt that are cached, from the start.
        num_tokens: the tokens they cover.
        keys: their keys, in order.
        tiers: for each of them, the fastest tier that holds it.
        num_prompt_blocks: full blocks in the whole prompt.
        diverges_at_block: first block that is not cached (== num_blocks), or None if every
            full block is.
        num_token_mismatches: 1 if a key matched but its tokens did not (a collision, counted
            and treated as a miss).
    """

    num_blocks: int
    num_tokens: int
    keys: tuple[BlockKey, ...]
    tiers: tuple[str, ...]
    num_prompt_blocks: int
    diverges_at_block: int | None
    num_token_mismatches: int = 0

    def tokens_in_tier(self, tier: str, block_tokens: int) -> int:
        """Tokens of the match served from ``tier``."""
        return sum(block_tokens for t in self.tiers if t == tier)


@dataclass(frozen=True, slots=True, kw_only=True)
class InsertResult:
    """What an insert stored in a tier, and what it could not."""

    num_new_blocks: int
    num_existing_blocks: int
    num_refused_blocks: int
    num_evicted_blocks: int
    refusal: str | None = None


class Lease:
    """A running request's hold on the cached prefix of its prompt.

    Holds one reference on every matched block until the cache releases it (done by the
    context manager of ``PrefixCache.acquire``). Remembers the prompt's block keys so that
    inserting the rest of the prompt later hashes nothing twice, and where each held block
    could be read when it was matched (``plan``, made in the same stay under the cache's lock,
    so that loading the prefix asks placement nothing before its reads; it covers the first
    held blocks, up to the first that no tier could serve; None for a lease not meant to
    load). The lease owns the list of records it holds; the cache changes it only through the
    methods below.
    """

    __slots__ = ("namespace", "tokens", "keys", "match", "plan", "_records", "_is_released")

    def __init__(
        self,
        *,
        namespace: Namespace,
        tokens: TokenIds,
        keys: list[BlockKey],
        match: PrefixMatch,
        records: list[BlockRecord],
        plan: tuple[PlannedRead, ...] | None = None,
    ) -> None:
        self.namespace = namespace
        self.tokens = tokens
        self.keys = keys
        self.match = match
        self.plan = plan
        self._records = records
        self._is_released = False

    @property
    def is_released(self) -> bool:
        """Whether the cache has taken its references back."""
        return self._is_released

    @property
    def records(self) -> tuple[BlockRecord, ...]:
        """The blocks held, in prompt order."""
        return tuple(self._records)

    def cut(self, num_blocks: int) -> list[BlockRecord]:
        """Keep the first ``num_blocks`` blocks; returns the rest, whose references the caller
        now owns (and must release)."""
        rest = self._records[num_blocks:]
        del self._records[num_blocks:]
        if self.plan is not None:
            self.plan = self.plan[:num_blocks]
        return rest

    def extend(self, records: Iterable[BlockRecord]) -> None:
        """Take over one reference on each of ``records``, the blocks after the held ones."""
        self._records.extend(records)

    def end(self) -> list[BlockRecord]:
        """Mark the lease released; returns the blocks whose references it gives back.

        Raises:
            IndexInvariantError: it was released already.
        """
        if self._is_released:
            raise IndexInvariantError("lease released twice")
        self._is_released = True
        return list(self._records)
