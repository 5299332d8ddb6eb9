"""The radix index: which blocks of which prefixes are cached, and where.

One radix trie per namespace over token blocks; an edge holds a run of blocks that share no
branching point (so a 32-block system prompt is one edge, not 32 nodes), plus one dict from
block key to record for O(1) access by key (the chain-hash path used with remote tiers and by
admin commands).

Why a trie as well as the dict: it answers longest-prefix match in one walk, lists everything
under a prefix (admin: "all prompts that start with this system prompt"), and knows each block's
children, which is what eviction needs -- a block is only useful with all its ancestors, so a
tier gives up its leaves first and a block leaves the index only after its descendants have.

Every match is verified by comparing token bytes, not only keys: a key is an address, not a
proof (a test build shrinks keys to 8 bits and still serves nothing wrong).

The index is a plain single-threaded data structure; ``gateway.cache.prefix_cache`` serialises
access. Records are internal: callers outside the gateway get keys and small result objects.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from gateway.core.errors import IndexInvariantError
from gateway.core.fingerprint import Namespace
from policies.base import BlockKey


class BlockRecord:
    """One cached block: identity, where it is held, and who is using it.

    NOTE: a slotted class, not a dataclass: the index holds millions of these and each field
    costs 8 bytes per block. The parent is derived from the trie rather than stored.
    """

    __slots__ = (
        "key",
        "tokens",
        "depth",
        "edge",
        "num_bytes",
        "tier_mask",
        "refcount",
        "is_pinned",
        "last_access",
        "created_at",
        "ttl_s",
        "num_hits",
        "tags",
        "session",
    )

    def __init__(
        self,
        *,
        key: BlockKey,
        tokens: bytes,
        depth: int,
        edge: _Edge,
        num_bytes: int,
        now: float,
        ttl_s: float | None,
    ) -> None:
        self.key = key
        self.tokens = tokens
        self.depth = depth
        self.edge = edge
        self.num_bytes = num_bytes
        self.tier_mask = 0
        self.refcount = 0
        self.is_pinned = False
        self.last_access = now
        self.created_at = now
        self.ttl_s = ttl_s
        self.num_hits = 0
        # Operators' names for the requests that stored or warmed this block (``add_tag``, at
        # their store step; ``gateway.cache.operations.tags`` finds them); the empty frozenset
        # is shared, so untagged blocks cost nothing beyond the slot.
        self.tags: frozenset[str] = frozenset()
        # The one session whose requests alone stored or read this block, "" once anyone else
        # has, None while nobody has (``gateway.cache.sessions``).
        self.session: str | None = None

    @property
    def namespace(self) -> Namespace:
        return self.edge.tree.namespace

    @property
    def parent(self) -> BlockRecord | None:
        edge = self.edge
        pos = self.depth - edge.start_depth
        if pos > 0:
            return edge.blocks[pos - 1]
        parent_edge = edge.parent
        return parent_edge.blocks[-1] if parent_edge is not None and parent_edge.blocks else None

    def expires_at(self) -> float | None:
        """When this block stops being served (sliding TTL); None if never (or pinned)."""
        if self.ttl_s is None or self.is_pinned:
            return None
        return self.last_access + self.ttl_s

    def is_expired(self, now: float) -> bool:
        expiry = self.expires_at()
        return expiry is not None and expiry <= now

    def add_tag(self, tag: str) -> None:
        """Record ``tag`` on this block (a set: a tag it has already changes nothing)."""
        if tag not in self.tags:
            self.tags = self.tags | {tag}


class _Edge:
    """A run of blocks between two branching points (the root edge holds none)."""

    __slots__ = ("tree", "parent", "blocks", "children", "start_depth")

    def __init__(self, tree: _Tree, parent: _Edge | None, start_depth: int) -> None:
        self.tree = tree
        self.parent = parent
        self.blocks: list[BlockRecord] = []
        self.children: dict[BlockKey, _Edge] = {}
        self.start_depth = start_depth


class _Tree:
    __slots__ = ("namespace", "root")

    def __init__(self, namespace: Namespace) -> None:
        self.namespace = namespace
        self.root = _Edge(self, None, 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockSpec:
    """A block to insert: its key, its token bytes, and its payload size."""

    key: BlockKey
    tokens: bytes
    num_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class MatchResult:
    """Longest cached prefix of a request, as internal records (for the prefix cache)."""

    records: tuple[BlockRecord, ...]
    num_token_mismatches: int = 0
    """1 if the walk stopped at a key whose tokens differ (a collision), else 0."""


class RadixIndex:
    """Per-namespace radix tries over token blocks, plus key -> record."""

    def __init__(self) -> None:
        self._trees: dict[bytes, _Tree] = {}
        self._records: dict[BlockKey, BlockRecord] = {}

    # ---- lookup -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def get(self, key: BlockKey) -> BlockRecord | None:
        return self._records.get(key)

    def namespaces(self) -> list[Namespace]:
        return [tree.namespace for tree in self._trees.values()]

    def match(
        self,
        namespace: Namespace,
        keys: Sequence[BlockKey],
        block_tokens: Sequence[bytes] | None = None,
        *,
        token_data: bytes | memoryview | None = None,
        block_bytes: int = 0,
    ) -> MatchResult:
        """Longest run of ``keys`` (from block 0) present in ``namespace``, tokens verified.

        Token bytes of block i come either from ``block_tokens[i]`` or from the slice
        ``token_data[i*block_bytes:(i+1)*block_bytes]`` (no per-block copies on the hot path).
        """
        tree = self._trees.get(namespace.digest)
        if tree is None or not keys:
            return MatchResult(records=())
        matched: list[BlockRecord] = []
        edge = tree.root
        i = 0
        n = len(keys)
        while i < n:
            child = edge.children.get(keys[i])
            if child is None:
                break
            for record in child.blocks:
                if i == n or record.key != keys[i]:
                    return MatchResult(records=tuple(matched))
                expected = (
                    block_tokens[i]
                    if block_tokens is not None
                    else token_data[i * block_bytes : (i + 1) * block_bytes]  # type: ignore[index]
                )
                if record.tokens != expected:
                    return MatchResult(records=tuple(matched), num_token_mismatches=1)
                matched.append(record)
                i += 1
            edge = child
        return MatchResult(records=tuple(matched))

    # ---- structure ------------------------------------------------------------------------

    def insert(
        self,
        namespace: Namespace,
        parent: BlockRecord | None,
        blocks: Sequence[BlockSpec],
        *,
        now: float,
        ttl_s: float | None,
    ) -> list[BlockRecord]:
        """Insert ``blocks`` as the continuation of ``parent`` (None: from the root).

        Blocks already present (same key and tokens) are reused. Insertion stops at the first
        block whose key is present with other tokens (a collision) or is held elsewhere in the
        index: such a block is never linked under a parent it was not computed for.

        Returns:
            The records of ``blocks`` in order, as far as insertion got; new records have
            ``tier_mask == 0`` until the caller adds a tier.
        """
        if parent is None:
            tree = self._trees.get(namespace.digest)
            if tree is None:
                tree = self._trees[namespace.digest] = _Tree(namespace)
            edge, pos = tree.root, -1
        else:
            if parent.namespace.digest != namespace.digest:
                raise IndexInvariantError("parent block belongs to another namespace")
            edge = parent.edge
            pos = parent.depth - edge.start_depth
        # The cursor (edge, pos) is the last block placed: edge.blocks[pos] (pos -1: the root).
        root = edge.tree.root
        out: list[BlockRecord] = []
        for spec in blocks:
            depth = edge.start_depth + pos + 1
            if pos + 1 < len(edge.blocks):
                following = edge.blocks[pos + 1]
                if following.key == spec.key:
                    if following.tokens != spec.tokens:
                        break  # a key collision: never served, never linked
                    out.append(following)
                    pos += 1
                    continue
                if spec.key in self._records:
                    break  # the same key under another parent: a collision, never linked
                self._split(edge, depth)
            else:
                child = edge.children.get(spec.key)
                if child is not None:
                    if child.blocks[0].tokens != spec.tokens:
                        break
                    out.append(child.blocks[0])
                    edge, pos = child, 0
                    continue
                if spec.key in self._records:
                    break
            if edge is not root and not edge.children:
                target = edge  # extend a leaf edge in place: keeps runs compressed
            else:
                target = _Edge(edge.tree, edge, depth)
                edge.children[spec.key] = target
            record = BlockRecord(
                key=spec.key,
                tokens=spec.tokens,
                depth=depth,
                edge=target,
                num_bytes=spec.num_bytes,
                now=now,
                ttl_s=ttl_s,
            )
            target.blocks.append(record)
            self._records[spec.key] = record
            out.append(record)
            edge, pos = target, len(target.blocks) - 1
        return out

    def _split(self, edge: _Edge, at_depth: int) -> _Edge:
        """Cut ``edge`` so that its block at ``at_depth`` starts a child edge; return the head.

        The head keeps ``edge``'s identity (its parent's children dict still points at it).
        """
        pos = at_depth - edge.start_depth
        if pos <= 0 or pos >= len(edge.blocks):
            raise IndexInvariantError(f"cannot split an edge of {len(edge.blocks)} at {pos}")
        tail = _Edge(edge.tree, edge, at_depth)
        tail.blocks = edge.blocks[pos:]
        tail.children = edge.children
        for grandchild in tail.children.values():
            grandchild.parent = tail
        for record in tail.blocks:
            record.edge = tail
        del edge.blocks[pos:]
        edge.children = {tail.blocks[0].key: tail}
        return edge

    def _merge_with_only_child(self, edge: _Edge) -> None:
        """Re-compress after a removal: an edge with one child and no branch absorbs it."""
        if edge.parent is None or len(edge.children) != 1 or not edge.blocks:
            return
        (child,) = edge.children.values()
        for record in child.blocks:
            record.edge = edge
        edge.blocks.extend(child.blocks)
        edge.children = child.children
        for grandchild in edge.children.values():
            grandchild.parent = edge

    def has_children(self, record: BlockRecord) -> bool:
        edge = record.edge
        return record is not edge.blocks[-1] or bool(edge.children)

    def children(self, record: BlockRecord) -> list[BlockRecord]:
        edge = record.edge
        pos = record.depth - edge.start_depth
        if pos + 1 < len(edge.blocks):
            return [edge.blocks[pos + 1]]
        return [child.blocks[0] for child in edge.children.values()]

    def has_child_in(self, record: BlockRecord, tier_bit: int) -> bool:
        """Whether any child of ``record`` is held in the tier with bit ``tier_bit``."""
        return any(child.tier_mask & tier_bit for child in self.children(record))

    def remove(self, record: BlockRecord) -> None:
        """Remove a block that has no children and no references.

        Raises:
            IndexInvariantError: the block has children or is referenced (a caller bug).
        """
        if self.has_children(record):
            raise IndexInvariantError("only leaves can be removed from the index")
        if record.refcount:
            raise IndexInvariantError(f"block in use (refcount {record.refcount}) removed")
        if self._records.pop(record.key, None) is not record:
            raise IndexInvariantError("block is not in the index")
        edge = record.edge
        edge.blocks.pop()
        if edge.blocks:
            return
        parent = edge.parent
        assert parent is not None  # the root edge holds no blocks
        del parent.children[record.key]
        if not parent.children and parent.parent is None:
            del self._trees[parent.tree.namespace.digest]
            return
        self._merge_with_only_child(parent)

    # ---- iteration ---------------------------------------------------------------------

    def records(self) -> Iterator[BlockRecord]:
        return iter(self._records.values())

    def subtree(self, namespace: Namespace, under: BlockRecord | None = None) -> Iterator[
        BlockRecord
    ]:
        """Every block of ``namespace`` at or below ``under`` (all of them when None),
        parents before children."""
        tree = self._trees.get(namespace.digest)
        if tree is None:
            return
        if under is None:
            stack = list(tree.root.children.values())
        else:
            if under.namespace.digest != namespace.digest:
                return
            edge = under.edge
            pos = under.depth - edge.start_depth
            yield from edge.blocks[pos:]
            stack = list(edge.children.values())
        while stack:
            edge = stack.pop()
            yield from edge.blocks
            stack.extend(edge.children.values())

    def leaves_of_tier(self, tier_bit: int) -> Iterator[BlockRecord]:
        """Blocks held in the tier that have no child held in it."""
        for record in self._records.values():
            if record.tier_mask & tier_bit and not self.has_child_in(record, tier_bit):
                yield record

    def check_invariants(self) -> None:
        """Walk every tree and assert the structure (tests and debugging only)."""
        seen = 0
        for digest, tree in self._trees.items():
            if tree.namespace.digest != digest:
                raise IndexInvariantError("tree filed under the wrong digest")
            stack = [tree.root]
            while stack:
                edge = stack.pop()
                if edge is not tree.root and not edge.blocks:
                    raise IndexInvariantError("empty non-root edge")
                if (
                    edge.parent is not None
                    and edge.parent.parent is not None
                    and len(edge.parent.children) == 1
                ):
                    raise IndexInvariantError("uncompressed edge: single child of a non-root")
                for i, record in enumerate(edge.blocks):
                    seen += 1
                    if record.edge is not edge or record.depth != edge.start_depth + i:
                        raise IndexInvariantError("record edge/depth out of date")
                    if self._records.get(record.key) is not record:
                        raise IndexInvariantError("record missing from the key map")
                    if record.refcount < 0:
                        raise IndexInvariantError("negative refcount")
                for key, child in edge.children.items():
                    if child.parent is not edge or child.blocks[0].key != key:
                        raise IndexInvariantError("child edge filed under the wrong key")
                    end = edge.start_depth + len(edge.blocks)
                    if child.start_depth != end:
                        raise IndexInvariantError("child edge depth does not follow its parent")
                    stack.append(child)
        if seen != len(self._records):
            raise IndexInvariantError(f"{len(self._records)} records but {seen} in the tries")
