"""Tags: an operator's name for a set of blocks ("docs-v3"), checked the same way everywhere.

Operators think in documents and releases, not block keys. A request (``kvgate prewarm --tag``,
the ``tag`` field of Warm and Generate) names a tag; the blocks of its prompt carry it in the
radix index, and ``kvgate admin evict --tag`` drops them. A tag lives beside a block in its own
namespace, so a tenant's tag only ever marks (and so only ever selects) that tenant's blocks.

The name is short and printable on purpose: it appears in listings, in the Redis event stream
and on command lines, where spaces, control characters or a megabyte of text would do harm.
"""

from __future__ import annotations

import re

from gateway.core.errors import InvalidRequest

MAX_TAG_CHARS = 64
_TAG = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_TAG_CHARS}}}")


def tag_problem(tag: str) -> str | None:
    """What is wrong with ``tag`` as a tag, or None if it is one."""
    if _TAG.fullmatch(tag):
        return None
    shown = tag if len(tag) <= 40 else tag[:40] + "..."
    return (f"the tag {shown!r} is not a tag: use 1 to {MAX_TAG_CHARS} letters, digits, "
            "'.', '_' or '-' (e.g. docs-v3)")


def checked_tag(tag: str, field_name: str = "tag") -> str:
    """``tag`` if it is a valid tag.

    Raises:
        InvalidRequest: it is not (the message names ``field_name`` and what is accepted).
    """
    problem = tag_problem(tag)
    if problem is not None:
        raise InvalidRequest(f"{field_name}: {problem}")
    return tag
