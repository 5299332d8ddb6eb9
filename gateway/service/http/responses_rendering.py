"""The engine's deltas and usage as OpenAI Responses objects and events.

A response has one ``message`` output item with one ``output_text`` part. Usage is the
Responses API's (``input_tokens``, ``input_tokens_details.cached_tokens``, ``output_tokens``,
``total_tokens``) plus kvgate's ``kvgate`` object (``openai_responses.kvgate_usage``). A
stream is ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, one ``response.output_text.delta`` per piece of text, then
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``
and ``response.completed`` (each event numbered by ``sequence_number``); an error after the
stream began is an ``error`` event.

The rendering calls ``on_done`` with the finished response object and its text once the answer
is complete, so that the route keeps it (``store``).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.core.requests import Usage
from gateway.service.http.errors import ErrorAnswer
from gateway.service.http.openai_responses import kvgate_usage
from gateway.service.http.responses_requests import ResponsesCall


def usage_object(usage: Usage) -> dict[str, object]:
    """The Responses API's usage, with kvgate's per-tier figures under ``kvgate``."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "kvgate": kvgate_usage(usage),
    }


@dataclass(slots=True, kw_only=True)
class ResponsesRendering:
    """The response object and events of one ``POST /v1/responses``.

    Attributes:
        model: the model name to report.
        call: the request (its fields are echoed in the response).
        on_done: called with the finished response object and its text (None: nothing).
        on_usage: called with the response's id and usage once it is complete (None: nothing).
        cache_diagnostics: its ``prompt_cache_diagnostics`` (None: the request asked none).
    """

    model: str
    call: ResponsesCall
    on_done: Callable[[dict[str, object], str], None] | None = None
    on_usage: Callable[[str, Usage], None] | None = None
    cache_diagnostics: dict[str, object] | None = None
    id: str = field(default_factory=lambda: f"resp_{secrets.token_hex(12)}")
    item_id: str = field(default_factory=lambda: f"msg_{secrets.token_hex(12)}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    _text: list[str] = field(default_factory=list)
    _sequence: int = 0

    def completion(self, text: str, usage: Usage) -> dict[str, object]:
        """The non-streamed answer: a completed ``response``."""
        return self._finished(text, usage)

    def opening(self) -> list[str]:
        """``response.created``, ``response.in_progress``, the output item and part added."""
        pending = self._response("in_progress", output=[], usage=None)
        return [self._event("response.created", response=pending),
                self._event("response.in_progress", response=pending),
                self._event("response.output_item.added", output_index=0,
                            item=self._item("", "in_progress")),
                self._event("response.content_part.added", item_id=self.item_id,
                            output_index=0, content_index=0, part=self._part(""))]

    def delta(self, text: str) -> str:
        """The event of one piece of generated text."""
        self._text.append(text)
        return self._event("response.output_text.delta", item_id=self.item_id, output_index=0,
                           content_index=0, delta=text, logprobs=[])

    def closing(self, usage: Usage) -> list[str]:
        """The text, part and item done, and ``response.completed`` with the usage."""
        text = "".join(self._text)
        return [self._event("response.output_text.done", item_id=self.item_id, output_index=0,
                            content_index=0, text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=self.item_id,
                            output_index=0, content_index=0, part=self._part(text)),
                self._event("response.output_item.done", output_index=0,
                            item=self._item(text, "completed")),
                self._event("response.completed", response=self._finished(text, usage))]

    def stream_error(self, answer: ErrorAnswer) -> str:
        """The ``error`` event that ends a stream which failed after it began."""
        inner = answer.body["error"]
        assert isinstance(inner, dict)
        return self._event("error", code=inner.get("code"), message=inner.get("message"),
                           param=inner.get("param"))

    def _finished(self, text: str, usage: Usage) -> dict[str, object]:
        is_cut = usage.finish_reason == "length"
        body = self._response("incomplete" if is_cut else "completed",
                              output=[self._item(text, "completed")], usage=usage_object(usage))
        if is_cut:
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.on_usage is not None:
            self.on_usage(self.id, usage)
        if self.on_done is not None:
            self.on_done(body, text)
        return body

    def _response(self, status: str, *, output: list[object],
                  usage: dict[str, object] | None) -> dict[str, object]:
        call = self.call
        sampling = call.request.sampling
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "model": self.model, "output": output, "usage": usage,
                "error": None, "incomplete_details": None,
                "instructions": call.instructions,
                "previous_response_id": call.previous_response_id,
                "max_output_tokens": call.max_output_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p,
                "store": call.store, "metadata": dict(call.metadata or {}),
                "parallel_tool_calls": False, "tool_choice": call.tool_choice,
                "tools": [dict(tool) for tool in call.tools],
                "text": {"format": {"type": "text"}}, "truncation": "disabled",
                "prompt_cache_key": call.prompt_cache_key,
                **({} if self.cache_diagnostics is None
                   else {"prompt_cache_diagnostics": self.cache_diagnostics})}

    def _item(self, text: str, status: str) -> dict[str, object]:
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [self._part(text)]}

    def _part(self, text: str) -> dict[str, object]:
        return {"type": "output_text", "text": text, "annotations": []}

    def _event(self, kind: str, **fields: object) -> str:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n"
