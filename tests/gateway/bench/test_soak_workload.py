"""What the soak's load sends (``gateway.bench.soak.workload``): its admin evictions never take
the pinned prefixes the end check wants on disk."""

from __future__ import annotations

from typing import Any

import grpc

from gateway.bench.soak.workload import EVICT_IDLE_S, evict_idle
from gateway.client import NotFound
from gateway.core.admin_reports import PrefixInfo


def listed(key_hex: str, *, idle_s: float, is_pinned: bool = False) -> PrefixInfo:
    return PrefixInfo(tenant="soak", key_hex=key_hex, num_blocks=2, num_tokens=128,
                      num_bytes=1, tiers=("disk",), age_s=idle_s, idle_s=idle_s, num_hits=0,
                      is_pinned=is_pinned, preview="")


class FakeAdmin:
    """An admin client that lists ``prefixes`` and records evictions (``gone``: NotFound)."""

    def __init__(self, prefixes: list[PrefixInfo], gone: frozenset[str] = frozenset()) -> None:
        self.prefixes = prefixes
        self.gone = gone
        self.evicted: list[dict[str, Any]] = []

    def list_prefixes(self, *, tenant: str | None = None) -> list[PrefixInfo]:
        assert tenant == "soak"
        return self.prefixes

    def evict(self, **selectors: Any) -> None:
        if selectors.get("key_hex") in self.gone:
            raise NotFound(grpc.StatusCode.NOT_FOUND, "no cached block's key begins with it")
        self.evicted.append(selectors)


def evict_with(admin: FakeAdmin) -> None:
    evict_idle(admin, "soak")  # type: ignore[arg-type]


def test_the_loads_eviction_takes_idle_prompts_by_key_and_never_a_pinned_one() -> None:
    admin = FakeAdmin([listed("aa", idle_s=EVICT_IDLE_S + 1),
                       listed("bb", idle_s=EVICT_IDLE_S + 1, is_pinned=True),
                       listed("cc", idle_s=1.0)])
    evict_with(admin)
    assert admin.evicted == [{"key_hex": "aa", "tenant": "soak", "older_than_s": EVICT_IDLE_S}]


def test_a_prompt_evicted_since_the_listing_is_no_error() -> None:
    admin = FakeAdmin([listed("aa", idle_s=60.0), listed("dd", idle_s=60.0)],
                      gone=frozenset({"aa"}))
    evict_with(admin)  # no exception: the load records the eviction as done
    assert [e["key_hex"] for e in admin.evicted] == ["dd"]
