"""The hosted routes' cache diagnostics: each request's shape kept by its answer's id, and the
``Diagnosis`` of a request naming an earlier one written in Anthropic's or OpenAI's shape.

``/v1/messages`` keeps the shape of a request that sent ``diagnostics`` (as Anthropic does);
``/v1/responses`` keeps every response's (a later one may name any as its
``comparison_response_id``). Shapes go to the gateway's one ``PromptComparisons``, which gRPC
``Lookup`` reads too. A request is compared on a worker thread, before the generation starts
(a divergence in the messages tokenises the prompt cut before it).

Shapes hold the model the gateway serves (``engine.model_name``), not the alias a request
named: every alias is the same model and the same cache blocks, and gRPC names none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from gateway.service.http.anthropic_requests import MessagesCall
from gateway.service.http.responses_requests import ResponsesCall
from gateway.service.miss_diagnosis import Diagnosis, Part
from gateway.service.prompt_comparisons import KeepShape, PromptComparisons, Tokenizer


class Served(Tokenizer, Protocol):
    """The engine as the diagnostics see it: its tokens and the model it serves."""

    @property
    def model_name(self) -> str: ...


class HostedDiagnostics:
    """The Messages and Responses routes' diagnostics over the gateway's ``PromptComparisons``."""

    def __init__(self, comparisons: PromptComparisons) -> None:
        self._comparisons = comparisons

    def messages(self, call: MessagesCall, engine: Served
                 ) -> tuple[dict[str, object] | None, KeepShape | None]:
        """``call``'s ``diagnostics`` and what keeps its shape (None, None: it asked none)."""
        if not call.diagnose:
            return None, None
        shape = self._comparisons.shape(model=engine.model_name, prompt=call.request.prompt)
        tenant = call.request.scope.owner
        keep = self._comparisons.keeper(tenant, shape, call.request.prompt, engine)
        if call.previous_message_id is None:
            return {"cache_miss_reason": None}, keep
        return anthropic_diagnostics(self._comparisons.diagnose(
            tenant, call.previous_message_id, shape, call.request.prompt, engine,
            compare_cache_key=False)), keep

    def responses(self, call: ResponsesCall, engine: Served
                  ) -> tuple[dict[str, object] | None, KeepShape]:
        """``call``'s ``prompt_cache_diagnostics`` (None: it asked none), and what keeps its
        shape."""
        shape = self._comparisons.shape(model=engine.model_name, prompt=call.request.prompt,
                                        prompt_cache_key=call.prompt_cache_key)
        tenant = call.request.scope.owner
        keep = self._comparisons.keeper(tenant, shape, call.request.prompt, engine)
        if call.comparison_response_id is None:
            return None, keep
        return responses_diagnostics(self._comparisons.diagnose(
            tenant, call.comparison_response_id, shape, call.request.prompt, engine)), keep


def anthropic_diagnostics(found: Diagnosis) -> dict[str, object]:
    """Anthropic's ``diagnostics`` object of a request that named an earlier message."""
    if not found.is_known:
        return {"cache_miss_reason": {"type": "previous_message_not_found"}}
    if found.where is None:
        return {"cache_miss_reason": None}
    return {"cache_miss_reason": {"type": f"{_ANTHROPIC_PART[found.where.part]}_changed",
                                  "cache_missed_input_tokens": found.missed_tokens}}


def responses_diagnostics(found: Diagnosis) -> dict[str, object]:
    """OpenAI's ``prompt_cache_diagnostics`` of a response compared with an earlier one."""
    if not found.is_known:
        return {"type": "comparison_response_not_found"}
    if found.where is None:
        return {"type": "cache_hit"}
    return {"type": "cache_miss", "reason": _RESPONSES_REASON[found.where.part],
            "cache_missed_tokens": found.missed_tokens,
            "comparison_reusable_tokens": found.reusable_tokens}


_ANTHROPIC_PART: Mapping[Part, str] = {
    "model": "model", "prompt_cache_key": "model", "tools": "tools", "system": "system",
    "messages": "messages"}
"""Anthropic's reasons (``model_changed`` ... ``messages_changed``); its requests carry no
cache key and are compared without one, so that row never applies."""

_RESPONSES_REASON: Mapping[Part, str] = {
    "model": "model_changed", "prompt_cache_key": "prompt_cache_key_changed",
    "tools": "tools_changed", "system": "input_changed", "messages": "input_changed"}
"""OpenAI's reasons: ``instructions`` are part of the input there."""
