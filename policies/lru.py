"""Least-recently-used order: the victim is the block inserted or read longest ago.

LRU only ranks blocks; it never limits a tier (``shortfall`` is always None). Limits come from
``policies.budget`` and ``policies.quota``, and ``policies.stack.TierPolicy`` combines them.
"""

from __future__ import annotations

from collections.abc import Iterator

from policies.base import BlockKey, PolicyEntry, Shortfall


class _Node:
    """One block, threaded on two rings: the whole tier's recency and its tenant's.

    NOTE: a slotted class with six pointers. Two ``OrderedDict``s (one global, one per
    tenant) would do the same job in C, but cost about 205 B per block against about 130 B
    here (tracemalloc, 100k blocks); the policy holds one of these per block in the tier.
    """

    __slots__ = ("key", "tenant", "prev", "next", "tenant_prev", "tenant_next")

    def __init__(self, key: BlockKey, tenant: str) -> None:
        self.key = key
        self.tenant = tenant
        # A lone node is an empty ring's sentinel; linking rewires all four pointers.
        self.prev: _Node = self
        self.next: _Node = self
        self.tenant_prev: _Node = self
        self.tenant_next: _Node = self


class LRUPolicy:
    """Ranks a tier's blocks by least recent insert or access.

    Every block sits on two circular doubly linked rings, each closed by a sentinel: one over
    the whole tier and one over its tenant, least recent first after the sentinel. A quota
    eviction asks for one tenant's victims only; filtering the tier-wide order would walk every
    other tenant's blocks first, O(tier) for a small tenant in a big tier, while the tenant's
    own ring makes it O(victims). Insert, access and removal are O(1) on both rings (a
    ``deque`` could not drop a block from the middle in O(1)).
    """

    __slots__ = ("_key_to_node", "_head", "_tenant_to_head")

    def __init__(self) -> None:
        self._key_to_node: dict[BlockKey, _Node] = {}
        self._head = _Node(BlockKey(b""), "")  # sentinel of the tier-wide ring
        # Sentinel of each tenant's ring; a tenant disappears with its last block.
        self._tenant_to_head: dict[str, _Node] = {}

    def __len__(self) -> int:
        return len(self._key_to_node)

    def on_insert(self, entry: PolicyEntry) -> None:
        """Track a new block as the most recently used.

        Raises:
            ValueError: the key is already tracked (a caller bug: keys are unique).
        """
        key = entry.key
        if key in self._key_to_node:
            raise ValueError(f"block {key.hex()} is already tracked by this LRU policy")
        node = _Node(key, entry.tenant)
        self._key_to_node[key] = node
        tenant_head = self._tenant_to_head.get(entry.tenant)
        if tenant_head is None:
            tenant_head = self._tenant_to_head[entry.tenant] = _Node(BlockKey(b""), entry.tenant)
        self._link_last(node, tenant_head)

    def on_access(self, key: BlockKey) -> None:
        """Make a tracked block the most recently used.

        Raises:
            KeyError: the key is not tracked.
        """
        node = self._key_to_node[key]
        self._unlink(node)
        self._link_last(node, self._tenant_to_head[node.tenant])

    def on_remove(self, key: BlockKey) -> None:
        """Forget a block that left the tier.

        Raises:
            KeyError: the key is not tracked.
        """
        node = self._key_to_node.pop(key)
        self._unlink(node)
        tenant_head = self._tenant_to_head[node.tenant]
        if tenant_head.tenant_next is tenant_head:
            del self._tenant_to_head[node.tenant]

    def candidates(self, tenant: str | None = None) -> Iterator[BlockKey]:
        """Yield tracked keys least recently used first; only ``tenant``'s when given.

        The iterator walks the live rings, so (as the ``EvictionPolicy`` contract requires) no
        other method may be called until it is closed.
        """
        if tenant is None:
            head = self._head
            node = head.next
            while node is not head:
                yield node.key
                node = node.next
            return
        tenant_head = self._tenant_to_head.get(tenant)
        if tenant_head is None:
            return
        node = tenant_head.tenant_next
        while node is not tenant_head:
            yield node.key
            node = node.tenant_next

    def shortfall(self, entry: PolicyEntry) -> Shortfall | None:
        """Always None: LRU ranks victims, it does not limit what fits."""
        return None

    def _link_last(self, node: _Node, tenant_head: _Node) -> None:
        """Link ``node`` as the most recent block of the tier and of its tenant."""
        head = self._head
        last = head.prev
        node.prev = last
        node.next = head
        last.next = node
        head.prev = node
        last = tenant_head.tenant_prev
        node.tenant_prev = last
        node.tenant_next = tenant_head
        last.tenant_next = node
        tenant_head.tenant_prev = node

    @staticmethod
    def _unlink(node: _Node) -> None:
        node.prev.next = node.next
        node.next.prev = node.prev
        node.tenant_prev.tenant_next = node.tenant_next
        node.tenant_next.tenant_prev = node.tenant_prev
