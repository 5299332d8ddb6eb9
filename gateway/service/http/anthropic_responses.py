"""The engine's deltas and usage as Anthropic Messages objects, events and errors.

Usage says what happened to the prompt, whatever was marked (kvgate caches every full block):
``cache_read_input_tokens`` the tokens read from the cache, ``cache_creation_input_tokens``
those this request stored (split by TTL in ``cache_creation``), ``input_tokens`` the rest (the
tokens after the last full block, and any the cache did not take); the three add up to the
prompt. Beside them, kvgate's own figures (``openai_responses.kvgate_usage``)::

    "usage": {"input_tokens": 22, "output_tokens": 48, "cache_read_input_tokens": 320,
              "cache_creation_input_tokens": 0,
              "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
              "kvgate": {"cached_tokens_by_tier": {"device": 320}, "ttft_ms": 185.5, ...}}

A request without ``cache_control`` stores its blocks for 5 minutes, as the hosted API keeps a
prefix, and counts them in ``ephemeral_5m_input_tokens``; where the gateway's ``max_ttl_s`` is
shorter they get its own TTL and count in ``cache_creation_input_tokens`` and in neither
ephemeral figure. ``kvgate.cache_creation_ttl_s`` says the TTL they got.

A stream is Anthropic's events: ``message_start``, ``content_block_start``, ``ping``, one
``content_block_delta`` per piece of text, ``content_block_stop``, ``message_delta`` (the stop
reason and the whole usage: what was cached is known when the answer ends, so
``message_start`` says 0 input tokens and leaves the cache figures out), ``message_stop``. An
error after the stream began is an ``error`` event.

Errors are Anthropic's envelope, ``{"type": "error", "error": {"type", "message"}}``, with the
status the gateway's error maps to (``errors.error_answer``) and the type Anthropic gives it.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.core.requests import Usage
from gateway.service.http.cache_breakpoints import CachePlan
from gateway.service.http.errors import ErrorAnswer, error_answer
from gateway.service.http.openai_responses import kvgate_usage

_STOP_REASON = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens"}

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    499: "api_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
"""Anthropic's error type for each status the front answers with (others: ``api_error``)."""


def anthropic_error_answer(exc: BaseException, *, where: str,
                           retry_after_s: int) -> ErrorAnswer:
    """The answer to a Messages request that failed with ``exc``, in Anthropic's envelope.

    The status and headers are those of every other route (``errors.error_answer``, which
    logs faults); only the body's shape differs.
    """
    answer = error_answer(exc, where=where, retry_after_s=retry_after_s)
    inner = answer.body["error"]
    assert isinstance(inner, dict)
    body: dict[str, object] = {"type": "error", "error": {
        "type": ERROR_TYPES.get(answer.status, "api_error"), "message": inner["message"]}}
    return ErrorAnswer(status=answer.status, body=body, headers=answer.headers)


def event(payload: dict[str, object]) -> str:
    """One server-sent event named for its payload's ``type``."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {payload['type']}\ndata: {data}\n\n"


def usage_object(usage: Usage, caching: CachePlan, *, warmed_tokens: int = 0) -> dict[str, object]:
    """Anthropic's usage of a finished generation, with kvgate's figures under ``kvgate``.

    Args:
        usage: the engine's.
        caching: the request's plan: the TTL its generation stored with.
        warmed_tokens: prompt tokens stored for an hour before the generation
            (``cache_breakpoints.warm_longer_prefix``); the generation read them, and they are
            counted as created, not read.
    """
    prompt = usage.prompt_tokens
    read = max(0, usage.cached_tokens - warmed_tokens)
    warmed = min(warmed_tokens, prompt - read)
    stored = min(usage.stored_tokens, prompt - read - warmed)
    by_ttl = {"5m": 0, "1h": warmed}
    if caching.ttl is not None:
        by_ttl[caching.ttl] += stored
    return {
        "input_tokens": prompt - read - warmed - stored,
        "output_tokens": usage.completion_tokens,
        "cache_creation_input_tokens": warmed + stored,
        "cache_read_input_tokens": read,
        "cache_creation": {"ephemeral_5m_input_tokens": by_ttl["5m"],
                           "ephemeral_1h_input_tokens": by_ttl["1h"]},
        "service_tier": "standard",
        "kvgate": {**kvgate_usage(usage), "cache_creation_ttl_s": caching.ttl_s},
    }


@dataclass(slots=True, kw_only=True)
class MessagesRendering:
    """The response objects and events of one Messages request (one id throughout).

    Attributes:
        model: the model name to report.
        caching: the request's cache plan (its usage splits what was stored by TTL).
        stop_sequences: the request's (the answer names the one that stopped it where there
            is one; the engine does not say which of several did).
        warmed_tokens: see ``usage_object``.
        diagnostics: the message's ``diagnostics`` (None: the request asked for none).
        on_usage: called with the answer's usage once it is complete (None: nothing).
    """

    model: str
    caching: CachePlan = field(default_factory=CachePlan)
    stop_sequences: tuple[str, ...] = ()
    warmed_tokens: int = 0
    diagnostics: dict[str, object] | None = None
    on_usage: Callable[[str, Usage], None] | None = None
    id: str = field(default_factory=lambda: f"msg_{secrets.token_hex(12)}")

    def completion(self, text: str, usage: Usage) -> dict[str, object]:
        """The non-streamed answer: a ``message``."""
        self._done(usage)
        return {**self._message([{"type": "text", "text": text}] if text else []),
                **self._stop(usage), "usage": self._usage(usage)}

    def opening(self) -> list[str]:
        """``message_start``, the text block's start and a ``ping``."""
        start = {**self._message([]), "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": 0, "output_tokens": 0}}
        return [event({"type": "message_start", "message": start}),
                event({"type": "content_block_start", "index": 0,
                       "content_block": {"type": "text", "text": ""}}),
                event({"type": "ping"})]

    def delta(self, text: str) -> str:
        """The event of one piece of generated text."""
        return event({"type": "content_block_delta", "index": 0,
                      "delta": {"type": "text_delta", "text": text}})

    def closing(self, usage: Usage) -> list[str]:
        """The block's end, the stop reason with the whole usage, ``message_stop``."""
        self._done(usage)
        return [event({"type": "content_block_stop", "index": 0}),
                event({"type": "message_delta", "delta": self._stop(usage),
                       "usage": self._usage(usage)}),
                event({"type": "message_stop"})]

    def stream_error(self, answer: ErrorAnswer) -> str:
        """The ``error`` event that ends a stream which failed after it began."""
        return event(answer.body)

    def _message(self, content: list[dict[str, str]]) -> dict[str, object]:
        message: dict[str, object] = {"id": self.id, "type": "message", "role": "assistant",
                                      "model": self.model, "content": content}
        if self.diagnostics is not None:
            message["diagnostics"] = self.diagnostics
        return message

    def _done(self, usage: Usage) -> None:
        if self.on_usage is not None:
            self.on_usage(self.id, usage)

    def _stop(self, usage: Usage) -> dict[str, object]:
        reason = _STOP_REASON.get(usage.finish_reason, "end_turn")
        sequence = (self.stop_sequences[0] if reason == "stop_sequence"
                    and len(self.stop_sequences) == 1 else None)
        return {"stop_reason": reason, "stop_sequence": sequence}

    def _usage(self, usage: Usage) -> dict[str, object]:
        return usage_object(usage, self.caching, warmed_tokens=self.warmed_tokens)
