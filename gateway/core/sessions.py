"""Session ids: an app's name for one conversation ("chat-8f2c"), checked the same way everywhere.

A request may name the session it belongs to (gRPC ``CacheOptions.session_id``, the OpenAI
front's ``X-Session-Id`` header or, where configured, the body's ``user``). The blocks only that
session's requests stored or read, and its conversation tail, then belong to it
(``gateway.cache.sessions``): they expire after ``[cache] session_ttl_s`` without a request of
the session, and ``kvgate admin sessions reset`` drops them from every tier.

A session lives inside the caller's tenant: two tenants naming the same id have two unrelated
sessions, so an id says nothing across tenants. The id is short and printable on purpose: it
appears in listings, in the Redis event stream and on command lines.
"""

from __future__ import annotations

from gateway.core.identifiers import IdentifierRule

MAX_SESSION_ID_CHARS = 128
SESSION_ID_RULE = IdentifierRule(noun="session id", max_chars=MAX_SESSION_ID_CHARS,
                                 marks="._:@-", example="chat-8f2c")


def session_id_problem(session_id: str) -> str | None:
    """What is wrong with ``session_id`` as a session id, or None if it is one."""
    return SESSION_ID_RULE.problem(session_id)


def checked_session_id(session_id: str, field_name: str = "session_id") -> str:
    """``session_id`` if it is a valid session id.

    Raises:
        InvalidRequest: it is not (the message names ``field_name`` and what is accepted).
    """
    return SESSION_ID_RULE.checked(session_id, field_name)


def session_use_problem(*, is_shared: bool, no_cache: bool) -> str | None:
    """Why a request may not name a session as sent, or None: a session is a tenant's
    conversation (the shared scope has none), and it owns what its requests store (``no_cache``
    stores nothing)."""
    if is_shared:
        return ("a session is a tenant's conversation and the shared scope has none: send the "
                "session in the tenant's own scope, or no session")
    if no_cache:
        return ("a session owns the blocks its requests store, and no_cache stores none: send "
                "one of them")
    return None


def session_problems(session_id: str, *, is_shared: bool, no_cache: bool) -> list[str]:
    """Every problem with a request's ``session_id`` (empty if it may name it)."""
    problems = []
    problem = session_id_problem(session_id)
    if problem is not None:
        problems.append(f"session_id: {problem}")
    use = session_use_problem(is_shared=is_shared, no_cache=no_cache)
    if use is not None:
        problems.append(use)
    return problems
