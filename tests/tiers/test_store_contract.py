"""The store contract (``tests/tiers/store_contract.py``) over every registered tier kind,
each store opened through its kind as ``open_cache`` opens it; Redis's under its marker, on a
real ``redis-server`` on a free loopback port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tiers.store_contract import StoreCase, StoreContract, open_case
from tiers.kinds.registry import TIER_KINDS

KINDS = [pytest.param(name, marks=pytest.mark.redis) if kind.is_remote else name
         for name, kind in TIER_KINDS.items()]


class TestEveryKind(StoreContract):
    @pytest.fixture(params=KINDS)
    def case(self, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreCase]:
        is_remote = TIER_KINDS[request.param].is_remote
        redis = request.getfixturevalue("redis_server") if is_remote else None
        yield from open_case(request.param, tmp_path, redis)


def test_every_kind_is_in_the_suite() -> None:
    assert [getattr(p, "values", (p,))[0] for p in KINDS] == list(TIER_KINDS)
