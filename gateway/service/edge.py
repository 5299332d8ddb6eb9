"""What both request surfaces (gRPC ``kvgate.v1`` and the OpenAI-compatible HTTP front) check
and do the same way at the edge, written once.

The two surfaces differ only in their wire format; everything a request means is decided here
or below, so a prompt sent over HTTP reaches exactly the engine record the same prompt sent
over gRPC does (the same canonical tokens, hence the same cache blocks):

- ``EdgeLimits``: the server's bounds on deadlines, TTLs and prompt size;
- ``checked_ttl``, ``deadline_within``: a request's TTL and deadline checked against them;
- ``scope_of``: the cache scope of a call, from the authenticated key only (docs/reliability.md,
  threat 1): the tenant's own, or ``shared`` for admin keys;
- ``check_num_tools``: the bound on tool schemas a prompt may carry;
- ``Generation``: one generation's handle with the cancellation rule both surfaces follow (a
  caller that goes away cancels it, unless its answer was already delivered).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from gateway.config.keys import Principal
from gateway.core.errors import InvalidRequest
from gateway.core.fingerprint import Scope
from gateway.core.prompt_limits import PromptLimits
from gateway.core.requests import TokenDelta, Usage
from gateway.engine.scheduling.jobs import RequestHandle

MAX_TOOLS = 128
"""Most tool schemas one prompt may carry."""

DEFAULT_PROMPT_LIMITS = PromptLimits()


@dataclass(frozen=True, slots=True, kw_only=True)
class EdgeLimits:
    """Bounds the edge enforces on what the wire formats cannot bound.

    Attributes:
        max_deadline_s: the longest a generation may run, whatever deadline the client sent
            (none at all included).
        max_ttl_s: the longest TTL a request may ask for its blocks.
        prompt: the most characters and messages a prompt may carry.
    """

    max_deadline_s: float = 600.0
    max_ttl_s: float = 7 * 24 * 3600.0
    prompt: PromptLimits = DEFAULT_PROMPT_LIMITS

    def __post_init__(self) -> None:
        for name in ("max_deadline_s", "max_ttl_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")


HOSTED_API_TTL_S = 300.0
"""The hosted APIs' convention for a prefix nobody asked to keep longer: 5 minutes after its last
use, each hit refreshing it (kvgate's TTLs slide). ``/v1/messages`` and ``/v1/responses`` keep
their blocks so by default; gRPC and Chat Completions keep ``[engine] default_ttl_s``."""


def hosted_api_ttl(limits: EdgeLimits) -> float | None:
    """The TTL of a hosted-API request that names none: ``HOSTED_API_TTL_S``, or the server's
    own default (None) where ``limits.max_ttl_s`` is shorter -- the client asked for nothing, so
    nothing is refused."""
    return HOSTED_API_TTL_S if HOSTED_API_TTL_S <= limits.max_ttl_s else None


def checked_ttl(ttl_s: float | None, limits: EdgeLimits) -> float | None:
    """``ttl_s`` if it is within ``limits`` (None: the server's default TTL).

    Raises:
        InvalidRequest: not more than 0, not finite, or over ``limits.max_ttl_s``.
    """
    if ttl_s is None:
        return None
    ttl = float(ttl_s)
    if not (math.isfinite(ttl) and 0 < ttl <= limits.max_ttl_s):
        raise InvalidRequest(f"ttl_s must be more than 0 and at most {limits.max_ttl_s:g} "
                             f"seconds, got {ttl}")
    return ttl


def deadline_within(limits: EdgeLimits, remaining_s: float | None) -> float:
    """min(the client's remaining time, the server's maximum), as a ``time.monotonic`` time."""
    budget = limits.max_deadline_s
    if remaining_s is not None:
        budget = min(budget, max(0.0, float(remaining_s)))
    return time.monotonic() + budget


def scope_of(principal: Principal, *, is_shared: bool) -> Scope:
    """The cache scope of a call: the key's tenant, or shared (admin keys only).

    Raises:
        PermissionDenied: the shared scope without an admin key.
    """
    if is_shared:
        principal.require_admin("the shared scope")
        return Scope.shared()
    return Scope.of_tenant(principal.tenant)


def check_num_tools(num_tools: int) -> None:
    """Raises ``InvalidRequest`` when a prompt carries more than ``MAX_TOOLS`` tool schemas."""
    if num_tools > MAX_TOOLS:
        raise InvalidRequest(f"send at most {MAX_TOOLS} tools, got {num_tools}")


class Generation:
    """A submitted generation as an edge streams it: deltas, then one ``Usage``.

    ``cancel_unless_delivered`` is what a surface calls when its caller goes away or it stops
    reading: the engine stops the request at its next step and releases its blocks.

    NOTE: a generation whose ``Usage`` was delivered is not cancelled. The call ends right after
    the last message while the engine is still storing the blocks the answer filled: cancelling
    then would drop them, and the next turn of the chat would miss.

    Args:
        handle: what ``Engine.generate`` returned.
    """

    def __init__(self, handle: RequestHandle) -> None:
        self._handle = handle
        self._is_delivered = threading.Event()
        self._items: Iterator[TokenDelta | Usage] = iter(handle)

    def next_item(self) -> TokenDelta | Usage | None:
        """The next delta or the usage (blocks until the engine has it); None after the usage.

        Raises:
            GatewayError: the request failed, was cancelled or ran past its deadline.
        """
        item = next(self._items, None)
        if isinstance(item, Usage):
            self._is_delivered.set()
        return item

    def __iter__(self) -> Iterator[TokenDelta | Usage]:
        while (item := self.next_item()) is not None:
            yield item

    @property
    def is_delivered(self) -> bool:
        return self._is_delivered.is_set()

    def cancel_unless_delivered(self) -> None:
        if not self._is_delivered.is_set():
            self._handle.cancel()
