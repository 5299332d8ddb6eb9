"""Per-tenant byte quotas: one tenant's blocks may not crowd out another's.

A quota limits; it does not rank (``candidates`` yields nothing). When a tenant is over its
quota, ``shortfall`` names that tenant, and ``policies.stack.TierPolicy`` frees the bytes from
that tenant's own blocks only: an over-quota tenant never evicts anyone else.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from policies.base import BlockKey, InsertRefused, PolicyEntry, Shortfall


def _check_num_bytes(what: str, num_bytes: int | None) -> None:
    if num_bytes is not None and num_bytes < 0:
        raise ValueError(f"{what} must be >= 0 bytes or None, got {num_bytes}")


class QuotaPolicy:
    """Caps the bytes each tenant holds in one tier.

    A tenant's quota is its explicit one if set, else ``default_bytes``; a tenant with neither
    is unlimited here (the tier budget still applies).

    Lowering a quota below what the tenant already holds is allowed: nothing is evicted at
    once, but the tenant's next insert must first free its own blocks down to the new quota.

    Args:
        quotas: explicit quotas, tenant to bytes.
        default_bytes: the quota of every tenant without an explicit one; None for no limit.

    Raises:
        ValueError: a quota is negative.
    """

    __slots__ = ("_tenant_to_quota", "_default_bytes", "_key_to_entry", "_tenant_to_used")

    def __init__(
        self, quotas: Mapping[str, int] | None = None, default_bytes: int | None = None
    ) -> None:
        _check_num_bytes("default_bytes", default_bytes)
        self._tenant_to_quota: dict[str, int] = {}
        for tenant, num_bytes in (quotas or {}).items():
            _check_num_bytes(f"the quota of tenant {tenant!r}", num_bytes)
            self._tenant_to_quota[tenant] = num_bytes
        self._default_bytes = default_bytes
        self._key_to_entry: dict[BlockKey, PolicyEntry] = {}
        # Bytes held per tenant; a tenant disappears with its last block.
        self._tenant_to_used: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._key_to_entry)

    def set_quota(self, tenant: str, num_bytes: int | None) -> None:
        """Give ``tenant`` an explicit quota, or None to fall back to the default.

        Raises:
            ValueError: ``num_bytes`` is negative.
        """
        _check_num_bytes(f"the quota of tenant {tenant!r}", num_bytes)
        if num_bytes is None:
            self._tenant_to_quota.pop(tenant, None)
        else:
            self._tenant_to_quota[tenant] = num_bytes

    def quota_of(self, tenant: str) -> int | None:
        """The bytes ``tenant`` may hold, or None if it is unlimited."""
        return self._tenant_to_quota.get(tenant, self._default_bytes)

    def used_bytes(self, tenant: str) -> int:
        """The bytes ``tenant``'s tracked blocks hold."""
        return self._tenant_to_used.get(tenant, 0)

    def on_insert(self, entry: PolicyEntry) -> None:
        """Charge a new block to its tenant.

        Raises:
            ValueError: the key is already tracked (a caller bug: keys are unique).
        """
        if entry.key in self._key_to_entry:
            raise ValueError(f"block {entry.key.hex()} is already tracked by this quota policy")
        self._key_to_entry[entry.key] = entry
        self._tenant_to_used[entry.tenant] = self.used_bytes(entry.tenant) + entry.num_bytes

    def on_access(self, key: BlockKey) -> None:
        """Nothing to note: reading a block does not change what it costs.

        Raises:
            KeyError: the key is not tracked.
        """
        if key not in self._key_to_entry:
            raise KeyError(key)

    def on_remove(self, key: BlockKey) -> None:
        """Refund a block's bytes to its tenant.

        Raises:
            KeyError: the key is not tracked.
        """
        entry = self._key_to_entry.pop(key)
        used = self.used_bytes(entry.tenant) - entry.num_bytes
        if used:
            self._tenant_to_used[entry.tenant] = used
        else:  # used_bytes() reads a missing tenant as 0, so the map stays small
            self._tenant_to_used.pop(entry.tenant, None)

    def candidates(self, tenant: str | None = None) -> Iterator[BlockKey]:
        """Yield nothing: a quota limits, it does not rank victims."""
        return iter(())

    def shortfall(self, entry: PolicyEntry) -> Shortfall | None:
        """The tenant's own bytes that must leave before ``entry`` fits under its quota.

        Returns:
            None if the tenant is unlimited or ``entry`` fits; else a ``Shortfall`` naming the
            tenant, whose blocks alone must cover it.

        Raises:
            InsertRefused: ``entry`` alone is larger than its tenant's whole quota.
        """
        quota = self.quota_of(entry.tenant)
        if quota is None:
            return None
        if entry.num_bytes > quota:
            raise InsertRefused(
                f"block {entry.key.hex()} ({entry.num_bytes} B) is larger than the whole quota "
                f"of tenant {entry.tenant!r} ({quota} B); it can never be admitted"
            )
        excess = self.used_bytes(entry.tenant) + entry.num_bytes - quota
        return Shortfall(num_bytes=excess, tenant=entry.tenant) if excess > 0 else None
