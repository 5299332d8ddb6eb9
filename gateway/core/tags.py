"""Tags: an operator's name for a set of blocks ("docs-v3"), checked the same way everywhere.

Operators think in documents and releases, not block keys. A request (``kvgate prewarm --tag``,
the ``tag`` field of Warm and Generate) names a tag; the blocks of its prompt carry it in the
radix index, and ``kvgate admin evict --tag`` drops them. A tag lives beside a block in its own
namespace, so a tenant's tag only ever marks (and so only ever selects) that tenant's blocks.

The name is short and printable on purpose: it appears in listings, in the Redis event stream
and on command lines, where spaces, control characters or a megabyte of text would do harm.
"""

from __future__ import annotations

from gateway.core.identifiers import IdentifierRule

MAX_TAG_CHARS = 64
TAG_RULE = IdentifierRule(noun="tag", max_chars=MAX_TAG_CHARS, marks="._-", example="docs-v3",
                          named=True)


def tag_problem(tag: str) -> str | None:
    """What is wrong with ``tag`` as a tag, or None if it is one."""
    return TAG_RULE.problem(tag)


def checked_tag(tag: str, field_name: str = "tag") -> str:
    """``tag`` if it is a valid tag.

    Raises:
        InvalidRequest: it is not (the message names ``field_name`` and what is accepted).
    """
    return TAG_RULE.checked(tag, field_name)
