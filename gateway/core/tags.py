"""Tags: an operator's name for a set of blocks ("docs-v3"), checked the same way everywhere.

Operators think in documents and releases, not block keys. A request (``kvgate prewarm --tag``,
the ``tag`` field of Warm and Generate) names a tag; it travels with the request
(``CacheOptions.tag``, ``WarmRequest.tag``) to the step that stores its prompt's blocks, which
records it on them in the radix index, and ``kvgate admin evict --tag`` drops them. A tag lives
beside a block in its own namespace, so a tenant's tag only ever marks (and so only ever selects)
that tenant's blocks.

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


def tag_problems(tag: str, *, no_cache: bool) -> list[str]:
    """Every problem with a request's ``tag`` (empty if it may name it): a tag marks the blocks
    a request stores, and one with ``no_cache`` stores none."""
    problems = []
    problem = tag_problem(tag)
    if problem is not None:
        problems.append(f"tag: {problem}")
    if no_cache:
        problems.append("a tag marks the blocks a request stores, and no_cache stores none: "
                        "send one of them")
    return problems


def checked_tag(tag: str, field_name: str = "tag") -> str:
    """``tag`` if it is a valid tag.

    Raises:
        InvalidRequest: it is not (the message names ``field_name`` and what is accepted).
    """
    return TAG_RULE.checked(tag, field_name)
