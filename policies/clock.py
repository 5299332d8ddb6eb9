"""Second-chance CLOCK order: an LRU approximation whose hits cost one bit, not a relink.

Blocks sit on a ring with a hand. A hit sets the block's reference bit; the hand, looking for a
victim, clears set bits as it passes (a second chance) and offers the first block whose bit is
already clear. Recently read blocks therefore survive one more revolution, and a hit never
touches the ring, which is why CLOCK suits a hot read path better than LRU.
"""

from __future__ import annotations

from collections.abc import Iterator

from policies.base import BlockKey, PolicyEntry, Shortfall


class _Node:
    """One block on the ring.

    NOTE: a slotted class rather than a dataclass so that a node costs five pointers and no
    ``__dict__``; the policy holds one per block in the tier.
    """

    __slots__ = ("key", "tenant", "is_referenced", "prev", "next")

    def __init__(self, key: BlockKey, tenant: str) -> None:
        self.key = key
        self.tenant = tenant
        self.is_referenced = False
        # A lone node is a ring of one; ``_link_before`` rewires both pointers.
        self.prev: _Node = self
        self.next: _Node = self


class ClockPolicy:
    """Ranks a tier's blocks by the second-chance CLOCK algorithm, O(1) amortised.

    The ring is a circular doubly linked list (a Python ``deque`` cannot drop a block from the
    middle in O(1), and blocks leave from anywhere when they are removed by other means). A new
    block is linked just behind the hand, so it is the last one the hand reaches, with its
    reference bit clear; ``on_access`` sets the bit.

    ``candidates`` moves the real hand: the position it leaves the hand at is where the next
    search starts, as in the textbook algorithm. When a tenant is given, other tenants' blocks
    are passed over untouched (their bits are kept), so a quota eviction does not spend their
    second chances; such a search costs O(tier), unlike ``LRUPolicy``'s per-tenant order.
    """

    __slots__ = ("_key_to_node", "_hand")

    def __init__(self) -> None:
        self._key_to_node: dict[BlockKey, _Node] = {}
        # The next node the hand examines; None exactly when the ring is empty.
        self._hand: _Node | None = None

    def __len__(self) -> int:
        return len(self._key_to_node)

    @property
    def hand(self) -> BlockKey | None:
        """The key the next search examines first, or None when nothing is tracked."""
        return None if self._hand is None else self._hand.key

    def is_referenced(self, key: BlockKey) -> bool:
        """Whether a tracked block was read since the hand last passed it.

        Raises:
            KeyError: the key is not tracked.
        """
        return self._key_to_node[key].is_referenced

    def ring(self) -> list[BlockKey]:
        """Every tracked key in ring order, starting at the hand (for inspection and tests)."""
        keys: list[BlockKey] = []
        node = self._hand
        for _ in range(len(self._key_to_node)):
            assert node is not None
            keys.append(node.key)
            node = node.next
        return keys

    def on_insert(self, entry: PolicyEntry) -> None:
        """Link a new block just behind the hand with its reference bit clear.

        Raises:
            ValueError: the key is already tracked (a caller bug: keys are unique).
        """
        key = entry.key
        if key in self._key_to_node:
            raise ValueError(f"block {key.hex()} is already tracked by this CLOCK policy")
        node = _Node(key, entry.tenant)
        self._key_to_node[key] = node
        hand = self._hand
        if hand is None:
            self._hand = node
            return
        tail = hand.prev
        node.prev = tail
        node.next = hand
        tail.next = node
        hand.prev = node

    def on_access(self, key: BlockKey) -> None:
        """Set a tracked block's reference bit: the hand will spare it once.

        Raises:
            KeyError: the key is not tracked.
        """
        self._key_to_node[key].is_referenced = True

    def on_remove(self, key: BlockKey) -> None:
        """Unlink a block; if the hand was on it, the hand moves to its successor.

        Raises:
            KeyError: the key is not tracked.
        """
        node = self._key_to_node.pop(key)
        successor = node.next
        if successor is node:
            self._hand = None
            return
        if self._hand is node:
            self._hand = successor
        node.prev.next = successor
        successor.prev = node.prev

    def candidates(self, tenant: str | None = None) -> Iterator[BlockKey]:
        """Sweep the hand and yield victims in the order it finds them.

        From the hand: a block of another tenant (when ``tenant`` is given), or one this search
        already yielded, is passed over untouched; a block with its bit set has it cleared; a
        block with its bit clear is yielded. The hand always moves past the block it examined,
        so closing the iterator leaves the hand just after the last victim. The search ends
        after a full revolution in which nothing was yielded and no bit was cleared.

        Yielded blocks stay on the ring until the caller removes them after closing the
        iterator; the search remembers them so that a second revolution does not offer them
        twice.
        """
        yielded: set[BlockKey] = set()
        num_idle = 0  # nodes passed since the last yield or cleared bit
        while self._hand is not None and num_idle < len(self._key_to_node):
            node = self._hand
            self._hand = node.next
            if (tenant is not None and node.tenant != tenant) or node.key in yielded:
                num_idle += 1
            elif node.is_referenced:
                node.is_referenced = False
                num_idle = 0
            else:
                num_idle = 0
                yielded.add(node.key)
                yield node.key

    def shortfall(self, entry: PolicyEntry) -> Shortfall | None:
        """Always None: CLOCK ranks victims, it does not limit what fits."""
        return None
