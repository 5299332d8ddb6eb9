"""The hosted routes' cache diagnostics over one gateway: each request's shape kept by its
answer's id, and compared with the earlier one a request names (``miss_diagnosis``).

``/v1/messages`` keeps the shape of a request that sent ``diagnostics`` (as Anthropic does);
``/v1/responses`` keeps every response's (a later one may name any as its
``comparison_response_id``). A shape is kept once its answer is complete, with the tokens the
answer left in the cache; it is compared on a worker thread, before the generation starts (a
divergence in the messages tokenises the prompt cut before it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from gateway.core.canonical import PromptInput
from gateway.core.requests import Usage
from gateway.core.tokens import TokenIds
from gateway.service.http.anthropic_requests import MessagesCall
from gateway.service.http.miss_diagnosis import (
    Divergence,
    KeptShape,
    KeptShapes,
    PromptShape,
    ShapeDigests,
    anthropic_diagnostics,
    compare,
    responses_diagnostics,
)
from gateway.service.http.responses_requests import ResponsesCall

KeepShape = Callable[[str, Usage], None]
"""Called with an answer's id and usage once it is complete: keeps the request's shape."""


class Tokenizer(Protocol):
    def prompt_tokens(self, prompt: PromptInput) -> TokenIds: ...


class PromptComparisons:
    """Shapes of recent requests per tenant, and the diagnostics of requests naming them."""

    def __init__(self, kept: KeptShapes | None = None, digests: ShapeDigests | None = None
                 ) -> None:
        self._kept = kept if kept is not None else KeptShapes()
        self._digests = digests if digests is not None else ShapeDigests()

    def messages(self, call: MessagesCall, engine: Tokenizer
                 ) -> tuple[dict[str, object] | None, KeepShape | None]:
        """``call``'s ``diagnostics`` and what keeps its shape (None, None: it asked none)."""
        if not call.diagnose:
            return None, None
        shape = self._digests.shape(model=call.model, prompt=call.request.prompt)
        keep = self._keeper(call.request.scope.owner, shape)
        if call.previous_message_id is None:
            return {"cache_miss_reason": None}, keep
        return anthropic_diagnostics(*self._compared(
            call.request.scope.owner, call.previous_message_id, shape, call.request.prompt,
            engine)), keep

    def responses(self, call: ResponsesCall, engine: Tokenizer
                  ) -> tuple[dict[str, object] | None, KeepShape]:
        """``call``'s ``prompt_cache_diagnostics`` (None: it asked none), and what keeps its
        shape."""
        shape = self._digests.shape(model=call.model, prompt=call.request.prompt,
                                    prompt_cache_key=call.prompt_cache_key)
        keep = self._keeper(call.request.scope.owner, shape)
        if call.comparison_response_id is None:
            return None, keep
        return responses_diagnostics(*self._compared(
            call.request.scope.owner, call.comparison_response_id, shape, call.request.prompt,
            engine)), keep

    def _compared(self, tenant: str, earlier_id: str, shape: PromptShape, prompt: PromptInput,
                  engine: Tokenizer) -> tuple[KeptShape | None, Divergence | None, int]:
        return compare(self._kept.get(tenant, earlier_id), shape, prompt,
                       lambda cut: len(engine.prompt_tokens(cut)))

    def _keeper(self, tenant: str, shape: PromptShape) -> KeepShape:
        def keep(answer_id: str, usage: Usage) -> None:
            self._kept.put(tenant, answer_id, KeptShape(
                shape=shape, reusable_tokens=usage.cached_tokens + usage.stored_tokens))
        return keep
