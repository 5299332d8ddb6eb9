"""The engine's deltas and usage as OpenAI response objects and server-sent events.

Usage is OpenAI's (``prompt_tokens``, ``completion_tokens``, ``total_tokens``,
``prompt_tokens_details.cached_tokens``) plus what no peer reports: a ``kvgate`` object with the
cached prompt tokens per tier, the time to first token and the total time as the gateway
measured them, the engine's own finish reason (``eos`` and ``stop`` are both OpenAI's
``stop``), and whether the answer is the model's own (``exact``)::

    "usage": {"prompt_tokens": 342, "completion_tokens": 48, "total_tokens": 390,
              "prompt_tokens_details": {"cached_tokens": 320},
              "kvgate": {"cached_tokens_by_tier": {"device": 320}, "ttft_ms": 185.5,
                         "total_ms": 1701.7, "finish_reason": "length", "exact": true}}

``exact`` is false only for a request that sent ``kvgate.allow_lossy`` and was served lossy
(quantized) copies of its prompt (gRPC's ``Usage.lossy``; docs/design.md, "Lossy tiers"): its
answer may differ from the model's own, and ``cached_tokens_by_tier`` names the format with the
tier (``{"device": 128, "disk:int8": 1920}``). It is written on every answer, true as well, so
that a client can tell an exact answer from a gateway too old to say.

The OpenAI SDK keeps unknown fields, so ``completion.usage.kvgate`` reads it there.

A stream is ``data: <chunk JSON>`` events ending with ``data: [DONE]``: a first chunk with the
assistant role, one chunk per piece of text, a last chunk with the finish reason and, when the
client asked ``stream_options.include_usage``, a chunk with no choices and the usage (every other
chunk then carries ``"usage": null``, as OpenAI's do). An error after the stream began is one
``data: {"error": {...}}`` event, which the OpenAI SDK raises as an ``APIError``.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field

from gateway.core.requests import Usage
from gateway.service.http.errors import ErrorAnswer
from gateway.service.http.openai_requests import Kind

_OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
DONE_EVENT = "data: [DONE]\n\n"


def usage_object(usage: Usage) -> dict[str, object]:
    """OpenAI's usage object, with kvgate's per-tier figures under ``kvgate``."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "kvgate": kvgate_usage(usage),
    }


def kvgate_usage(usage: Usage) -> dict[str, object]:
    """What kvgate reports beside a hosted API's usage: the cached prompt tokens per tier, the
    time to first token and in all, the engine's finish reason, whether the answer is exact."""
    return {
        "cached_tokens_by_tier": dict(sorted(usage.cached_tokens_by_tier.items())),
        "ttft_ms": round(usage.ttft_ms, 3),
        "total_ms": round(usage.total_ms, 3),
        "finish_reason": usage.finish_reason,
        "exact": not usage.lossy,
    }


def finish_reason(usage: Usage) -> str:
    """OpenAI's finish reason for the engine's (``eos`` and ``stop`` are both ``stop``)."""
    return _OPENAI_FINISH.get(usage.finish_reason, usage.finish_reason)


def sse(payload: dict[str, object]) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass(slots=True, kw_only=True)
class Rendering:
    """The response objects of one request: same id, creation time and model in every one.

    Attributes:
        kind: chat or (text) completion.
        model: the model name to report.
        include_usage: a stream ends with a usage chunk (and other chunks say ``usage: null``).
    """

    kind: Kind
    model: str
    include_usage: bool = False
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
            self.id = f"{prefix}-{secrets.token_hex(12)}"

    # ---- whole answers -------------------------------------------------------------

    def completion(self, text: str, usage: Usage) -> dict[str, object]:
        """The non-streamed answer: ``chat.completion`` or ``text_completion``."""
        choice: dict[str, object]
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text,
                                              "refusal": None},
                      "logprobs": None, "finish_reason": finish_reason(usage)}
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": finish_reason(usage)}
        return {**self._head(stream=False), "choices": [choice], "usage": usage_object(usage)}

    # ---- streams -------------------------------------------------------------------

    def opening(self) -> list[str]:
        """The events before any text (a chat stream's first chunk names the role)."""
        if self.kind != "chat":
            return []
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def delta(self, text: str) -> str:
        """The event of one piece of generated text."""
        if self.kind == "chat":
            return self._chunk({"content": text}, None)
        return self._chunk(text, None)

    def closing(self, usage: Usage) -> list[str]:
        """The last events: the finish reason, the usage if asked for, and ``[DONE]``."""
        events = [self._chunk({} if self.kind == "chat" else "", finish_reason(usage))]
        if self.include_usage:
            events.append(sse({**self._head(stream=True), "choices": [],
                               "usage": usage_object(usage)}))
        events.append(DONE_EVENT)
        return events

    def stream_error(self, answer: ErrorAnswer) -> str:
        """The ``data: {"error": ...}`` event that ends a stream which failed after it began
        (the OpenAI SDK raises it as an ``APIError``)."""
        return f"data: {json.dumps(answer.body, ensure_ascii=False)}\n\n"

    def _chunk(self, delta: dict[str, object] | str, finish: str | None) -> str:
        choice: dict[str, object]
        if self.kind == "chat":
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
        payload: dict[str, object] = {**self._head(stream=True), "choices": [choice]}
        if self.include_usage:
            payload["usage"] = None
        return sse(payload)

    def _head(self, *, stream: bool) -> dict[str, object]:
        if self.kind == "chat":
            kind = "chat.completion.chunk" if stream else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}
