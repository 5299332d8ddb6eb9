"""The order-policy registry, the tier policy config's validation, and building from it."""

from __future__ import annotations

from typing import Any

import pytest

from policies import (
    ORDER_POLICIES,
    BlockKey,
    ClockPolicy,
    InsertRefused,
    LRUPolicy,
    TierPolicyConfig,
    build_tier_policy,
    make_order_policy,
)
from tests.policies.fakes import FakeClock, entry, key


def always(k: BlockKey) -> bool:
    return True


def ignore(k: BlockKey) -> None:
    return None


def test_the_registry_names_lru_and_clock() -> None:
    assert dict(ORDER_POLICIES) == {"lru": LRUPolicy, "clock": ClockPolicy}


def test_the_registry_is_read_only() -> None:
    with pytest.raises(TypeError):
        ORDER_POLICIES["lfu"] = LRUPolicy  # type: ignore[index]


@pytest.mark.parametrize(("name", "cls"), [("lru", LRUPolicy), ("clock", ClockPolicy)])
def test_make_order_policy_builds_a_fresh_policy_by_name(name: str, cls: type) -> None:
    first, second = make_order_policy(name), make_order_policy(name)
    assert isinstance(first, cls)
    assert first is not second


def test_an_unknown_order_policy_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError) as error:
        make_order_policy("lfu")
    assert str(error.value) == "unknown order policy 'lfu'; valid names: 'clock', 'lru'"


def test_config_defaults() -> None:
    config = TierPolicyConfig(budget_bytes=100)
    assert config.order == "lru"
    assert dict(config.quotas) == {}
    assert config.default_quota_bytes is None
    assert config.enable_ttl is True


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"order": "fifo"},
            "order='fifo' is not a known order policy; valid names: 'clock', 'lru'",
        ),
        ({"budget_bytes": -1}, "budget_bytes must be an int >= 0, got -1"),
        ({"budget_bytes": True}, "budget_bytes must be an int >= 0, got True"),
        ({"budget_bytes": 1.5}, "budget_bytes must be an int >= 0, got 1.5"),
        ({"quotas": {"a": -5}}, "quotas['a'] must be an int >= 0, got -5"),
        ({"quotas": {"": 5}}, "quotas keys must be non-empty tenant names, got ''"),
        (
            {"default_quota_bytes": -1},
            "default_quota_bytes must be an int >= 0 or None, got -1",
        ),
        ({"enable_ttl": 1}, "enable_ttl must be a bool, got 1"),
    ],
)
def test_config_validation_says_what_was_wrong(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as error:
        TierPolicyConfig(**{"budget_bytes": 100, **kwargs})
    assert str(error.value) == message


def test_config_keeps_its_own_copy_of_the_quotas() -> None:
    quotas = {"a": 5}
    config = TierPolicyConfig(budget_bytes=100, quotas=quotas)
    quotas["a"] = 50
    assert dict(config.quotas) == {"a": 5}
    with pytest.raises(TypeError):
        config.quotas["a"] = 1  # type: ignore[index]


def test_configs_compare_by_value_and_hash() -> None:
    first = TierPolicyConfig(budget_bytes=100, quotas={"a": 5})
    assert first == TierPolicyConfig(budget_bytes=100, quotas={"a": 5})
    assert first != TierPolicyConfig(budget_bytes=100, quotas={"a": 6})
    assert hash(first) == hash(TierPolicyConfig(budget_bytes=100, quotas={"a": 5}))


def test_config_is_frozen() -> None:
    config = TierPolicyConfig(budget_bytes=100)
    with pytest.raises(AttributeError):
        config.budget_bytes = 5  # type: ignore[misc]


def test_built_policy_has_the_configured_budget_and_order() -> None:
    tier = build_tier_policy(TierPolicyConfig(order="clock", budget_bytes=2))
    for n in range(3):
        tier.admit(entry(n), can_evict=always, remove=ignore)
    assert tier.budget_bytes == 2
    assert set(tier.keys()) == {key(1), key(2)}


def test_built_policy_expires_on_the_injected_clock() -> None:
    clock = FakeClock()
    tier = build_tier_policy(TierPolicyConfig(budget_bytes=10), clock=clock)
    tier.admit(entry(0, ttl_s=5), can_evict=always, remove=ignore)
    clock.advance(5)
    assert tier.is_expired(key(0))


def test_built_policy_without_ttl_ignores_entries_ttls() -> None:
    clock = FakeClock()
    tier = build_tier_policy(TierPolicyConfig(budget_bytes=10, enable_ttl=False), clock=clock)
    tier.admit(entry(0, ttl_s=5), can_evict=always, remove=ignore)
    clock.advance(5)
    assert not tier.is_expired(key(0))


def test_built_policy_enforces_explicit_and_default_quotas() -> None:
    tier = build_tier_policy(
        TierPolicyConfig(budget_bytes=100, quotas={"a": 3}, default_quota_bytes=5)
    )
    with pytest.raises(InsertRefused, match="quota of tenant 'a' \\(3 B\\)"):
        tier.admit(entry(0, tenant="a", num_bytes=4), can_evict=always, remove=ignore)
    with pytest.raises(InsertRefused, match="quota of tenant 'z' \\(5 B\\)"):
        tier.admit(entry(0, tenant="z", num_bytes=6), can_evict=always, remove=ignore)
    tier.admit(entry(0, tenant="z", num_bytes=5), can_evict=always, remove=ignore)
