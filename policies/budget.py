"""A tier's byte budget: the one limit every block in the tier shares.

A budget limits; it does not rank (``candidates`` yields nothing). Its ``shortfall`` names no
tenant, so ``policies.stack.TierPolicy`` may free the bytes from anyone's blocks, in the order
the tier's order policy (LRU or CLOCK) gives.
"""

from __future__ import annotations

from collections.abc import Iterator

from policies.base import BlockKey, InsertRefused, PolicyEntry, Shortfall


class BudgetPolicy:
    """Caps the bytes all blocks of one tier hold together.

    Args:
        budget_bytes: the tier's capacity in bytes.

    Raises:
        ValueError: ``budget_bytes`` is negative.
    """

    __slots__ = ("_budget_bytes", "_key_to_num_bytes", "_used_bytes")

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self._budget_bytes = budget_bytes
        self._key_to_num_bytes: dict[BlockKey, int] = {}
        self._used_bytes = 0

    def __len__(self) -> int:
        return len(self._key_to_num_bytes)

    @property
    def budget_bytes(self) -> int:
        """The tier's capacity in bytes."""
        return self._budget_bytes

    @property
    def used_bytes(self) -> int:
        """The bytes all tracked blocks hold."""
        return self._used_bytes

    def on_insert(self, entry: PolicyEntry) -> None:
        """Charge a new block to the budget.

        Raises:
            ValueError: the key is already tracked (a caller bug: keys are unique).
        """
        if entry.key in self._key_to_num_bytes:
            raise ValueError(f"block {entry.key.hex()} is already tracked by this budget policy")
        self._key_to_num_bytes[entry.key] = entry.num_bytes
        self._used_bytes += entry.num_bytes

    def on_access(self, key: BlockKey) -> None:
        """Nothing to note: reading a block does not change what it costs.

        Raises:
            KeyError: the key is not tracked.
        """
        if key not in self._key_to_num_bytes:
            raise KeyError(key)

    def on_remove(self, key: BlockKey) -> None:
        """Refund a block's bytes to the budget.

        Raises:
            KeyError: the key is not tracked.
        """
        self._used_bytes -= self._key_to_num_bytes.pop(key)

    def candidates(self, tenant: str | None = None) -> Iterator[BlockKey]:
        """Yield nothing: a budget limits, it does not rank victims."""
        return iter(())

    def shortfall(self, entry: PolicyEntry) -> Shortfall | None:
        """The bytes, from any tenant, that must leave before ``entry`` fits the budget.

        Returns:
            None if ``entry`` fits now; else a ``Shortfall`` with ``tenant=None``.

        Raises:
            InsertRefused: ``entry`` alone is larger than the whole budget.
        """
        if entry.num_bytes > self._budget_bytes:
            raise InsertRefused(
                f"block {entry.key.hex()} ({entry.num_bytes} B) is larger than the tier's whole "
                f"budget ({self._budget_bytes} B); it can never be admitted"
            )
        excess = self._used_bytes + entry.num_bytes - self._budget_bytes
        return Shortfall(num_bytes=excess, tenant=None) if excess > 0 else None
