"""Small fakes shared by the policy tests: a controllable clock and readable keys."""

from __future__ import annotations

from policies import BlockKey, PolicyEntry


class FakeClock:
    """A clock that moves only when told to, so TTL tests never sleep."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "time does not run backwards"
        self.now += seconds


def key(n: int) -> BlockKey:
    """The n-th test key: 16 bytes, like a real chain hash."""
    return BlockKey(n.to_bytes(16, "big"))


def entry(n: int, tenant: str = "t", num_bytes: int = 1, ttl_s: float | None = None) -> PolicyEntry:
    """An entry for ``key(n)``."""
    return PolicyEntry(key=key(n), tenant=tenant, num_bytes=num_bytes, ttl_s=ttl_s)
