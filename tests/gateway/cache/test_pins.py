"""Pins outlive the process through the pin log (``gateway.cache.pins``): every pin, unpin and
operator eviction of a pinned block's last copy is saved before the call returns, and a
restart's adoption pins again exactly the blocks the log names that it finds.

A metadata-only cache and a ``PinLog`` that remembers its saves keep these to the bookkeeping;
the file (``tiers.pin_manifest``) is ``tests/tiers/test_pin_manifest.py``, and the whole path
-- admin pin, kill -9, restart on the same disk --
``tests/gateway/engine/test_pins_over_restart.py``.
"""

from __future__ import annotations

from collections.abc import Collection

from gateway.cache.operations.admin import evict_where, prompt_blocks
from gateway.cache.operations.adoption import adopt
from gateway.cache.prefix_cache import PrefixCache, TierSlot
from gateway.core.fingerprint import NamespaceSpec, Scope, derive_namespace
from gateway.core.tokens import TokenIds, as_token_ids
from policies.base import BlockKey
from policies.registry import TierPolicyConfig, build_tier_policy
from tiers.base import BlockMeta

BLOCK = 2
BLOCK_BYTES = 10
NS = derive_namespace(NamespaceSpec(deployment_secret=b"k" * 32, model_fingerprint="tiny",
                                    kv_dtype="float32", device_kind="cpu",
                                    scope=Scope.of_tenant("alice")))
PROMPT = as_token_ids([1, 2, 3, 4, 5, 6])  # three blocks
OTHER = as_token_ids([7, 8, 9, 10])


class RecordingLog:
    """A ``PinLog`` that keeps every save (``refuse``: the disk refuses them)."""

    def __init__(self, saved: Collection[BlockKey] = ()) -> None:
        self.saves: list[frozenset[BlockKey]] = []
        self.refuse = False
        self._saved = frozenset(saved)

    def load(self) -> frozenset[BlockKey]:
        return self._saved

    def save(self, keys: Collection[BlockKey]) -> bool:
        if self.refuse:
            return False
        self.saves.append(frozenset(keys))
        self._saved = frozenset(keys)
        return True


def make_cache(log: RecordingLog, tier: str = "device", budget_blocks: int = 100) -> PrefixCache:
    policy = build_tier_policy(TierPolicyConfig(budget_bytes=budget_blocks * BLOCK_BYTES))
    return PrefixCache(tiers=[TierSlot(name=tier, policy=policy)], block_tokens=BLOCK,
                       pin_log=log)


def store(cache: PrefixCache, tokens: TokenIds, tier: str = "device") -> None:
    with cache.acquire(NS, tokens) as lease:
        cache.insert(lease, tier=tier, block_bytes=BLOCK_BYTES)


def keys_of(cache: PrefixCache, tokens: TokenIds) -> frozenset[BlockKey]:
    return frozenset(cache.fingerprinter(NS).block_keys(tokens))


def test_a_pin_and_an_unpin_are_each_saved_before_the_call_returns() -> None:
    log = RecordingLog()
    cache = make_cache(log)
    store(cache, PROMPT)
    assert cache.set_pinned(NS, PROMPT, True) == 3
    assert log.saves == [keys_of(cache, PROMPT)]
    assert cache.set_pinned(NS, PROMPT, False) == 3
    assert log.saves[-1] == frozenset()


def test_pinning_what_is_pinned_already_saves_nothing() -> None:
    log = RecordingLog()
    cache = make_cache(log)
    store(cache, PROMPT)
    cache.set_pinned(NS, PROMPT, True)
    assert cache.set_pinned(NS, PROMPT, True) == 0
    assert len(log.saves) == 1


def test_an_operator_eviction_of_a_pinned_blocks_last_copy_takes_it_out_of_the_log() -> None:
    log = RecordingLog()
    cache = make_cache(log)
    store(cache, PROMPT)
    store(cache, OTHER)
    cache.set_pinned(NS, PROMPT, True)
    cache.set_pinned(NS, OTHER, True)
    evict_where(cache, under=prompt_blocks(cache, NS, PROMPT))
    assert log.saves[-1] == keys_of(cache, OTHER)


def test_a_save_the_disk_refused_is_made_again_at_the_next_chance() -> None:
    log = RecordingLog()
    cache = make_cache(log)
    store(cache, PROMPT)
    log.refuse = True
    cache.set_pinned(NS, PROMPT, True)
    assert log.saves == []
    log.refuse = False
    cache.keep_pins()
    assert log.saves == [keys_of(cache, PROMPT)]


# ---- adoption -----------------------------------------------------------------------------


def found_chain(cache: PrefixCache, tokens: TokenIds) -> list[tuple[BlockMeta, int]]:
    fp = cache.fingerprinter(NS)
    parent = fp.root_parent
    found = []
    for i, key in enumerate(fp.block_keys(tokens)):
        found.append((BlockMeta(key=key, parent_key=parent, namespace_digest=NS.digest,
                                owner="alice", tokens=fp.block_token_bytes(tokens, i)),
                      BLOCK_BYTES))
        parent = key
    return found


def test_adoption_pins_again_the_blocks_the_log_names() -> None:
    log = RecordingLog()
    cache = make_cache(log, tier="disk", budget_blocks=3)
    pinned = keys_of(cache, PROMPT)
    assert adopt(cache, "disk", found_chain(cache, PROMPT), pinned=pinned) == 3
    assert cache.evict("disk", 10**9).victims == ()  # pinned: no policy takes them
    store(cache, OTHER, tier="disk")  # a full tier of pinned blocks refuses the new ones
    assert cache.lookup(NS, PROMPT).num_blocks == 3
    assert cache.lookup(NS, OTHER).num_blocks == 0


def test_adoption_saves_the_log_without_the_pinned_blocks_it_did_not_find() -> None:
    log = RecordingLog()
    cache = make_cache(log, tier="disk")
    found = found_chain(cache, PROMPT)
    lost = found_chain(cache, OTHER)[0][0].key  # its file did not survive
    adopt(cache, "disk", found[:2], pinned={found[0][0].key, lost})
    assert log.saves == [frozenset({found[0][0].key})]


def test_adoption_without_a_pin_log_entry_pins_nothing() -> None:
    log = RecordingLog()
    cache = make_cache(log, tier="disk")
    adopt(cache, "disk", found_chain(cache, PROMPT))
    assert len(cache.evict("disk", 10**9).victims) == 3
    assert log.saves == []
