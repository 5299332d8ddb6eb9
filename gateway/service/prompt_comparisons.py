"""The shapes of recent requests, kept by their answers' ids, and comparisons with them: one
object shared by every surface of a gateway.

The composition root makes one ``PromptComparisons`` and hands it to the HTTP front and the
gRPC server alike, so that an id one surface kept can be named through another: a
``/v1/messages`` id or a ``/v1/responses`` id in a gRPC ``Lookup`` (``kvgate explain``), a gRPC
``Generate``'s ``request_id`` likewise. What is compared, and how, is ``miss_diagnosis``'s;
this module only keeps and finds shapes per tenant.

A shape is kept once its answer is complete, with the tokens the answer left in the cache.
Comparing tokenises the prompt cut before its first differing message (only where messages
differ): callers run it off the event loop.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Protocol

from gateway.core.canonical import PromptInput
from gateway.core.requests import Usage
from gateway.core.tokens import TokenIds
from gateway.service.miss_diagnosis import (
    Diagnosis,
    KeptShape,
    KeptShapes,
    PromptShape,
    ShapeDigests,
    diagnose,
)

KeepShape = Callable[[str, Usage], None]
"""Called with an answer's id and usage once it is complete: keeps the request's shape."""

REQUEST_ID_PREFIX = "gen_"
"""How the ids of gRPC ``Generate`` calls begin (``msg_`` and ``resp_`` are the HTTP routes')."""


class Tokenizer(Protocol):
    def prompt_tokens(self, prompt: PromptInput) -> TokenIds: ...


class PromptComparisons:
    """Shapes of recent requests per tenant, and comparisons of prompts with them.

    Args:
        block_tokens: tokens per cache block (``[cache] block_tokens``), to name blocks.
        kept: where shapes are kept (default: 1,000 per tenant, an hour after their last use).
        digests: how parts are digested (default: under a key drawn now).
    """

    def __init__(self, *, block_tokens: int, kept: KeptShapes | None = None,
                 digests: ShapeDigests | None = None) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self._block_tokens = block_tokens
        self._kept = kept if kept is not None else KeptShapes()
        self._digests = digests if digests is not None else ShapeDigests()

    def shape(self, *, model: str, prompt: PromptInput,
              prompt_cache_key: str | None = None) -> PromptShape:
        """``prompt``'s shape, as it is kept and compared (digests only)."""
        return self._digests.shape(model=model, prompt=prompt,
                                   prompt_cache_key=prompt_cache_key)

    def keeper(self, tenant: str, shape: PromptShape, prompt: PromptInput,
               tokenizer: Tokenizer) -> KeepShape:
        """What keeps ``shape`` for ``tenant`` under its answer's id, once the answer is whole,
        with the digests of ``prompt``'s blocks (tokenised then: after the answer, off its
        path)."""
        def keep(answer_id: str, usage: Usage) -> None:
            blocks = self._digests.blocks(tokenizer.prompt_tokens(prompt), self._block_tokens)
            self._kept.put(tenant, answer_id, KeptShape(
                shape=shape, reusable_tokens=usage.cached_tokens + usage.stored_tokens,
                blocks=blocks))
        return keep

    def diagnose(self, tenant: str, earlier_id: str, shape: PromptShape, prompt: PromptInput,
                 tokenizer: Tokenizer, *, compare_cache_key: bool = True) -> Diagnosis:
        """``prompt`` (whose shape is ``shape``) compared with ``tenant``'s request
        ``earlier_id`` (``miss_diagnosis.diagnose``; ``UNKNOWN`` for an id the tenant did not
        make, or made and has not used for the kept shapes' TTL)."""
        return diagnose(self._kept.get(tenant, earlier_id), shape, prompt,
                        lambda cut: len(tokenizer.prompt_tokens(cut)),
                        block_tokens=self._block_tokens, compare_cache_key=compare_cache_key,
                        blocks_of=lambda: self._digests.blocks(tokenizer.prompt_tokens(prompt),
                                                               self._block_tokens))


def new_request_id() -> str:
    """An id for a gRPC ``Generate``: 96 random bits, so that no caller can guess another's."""
    return REQUEST_ID_PREFIX + secrets.token_hex(12)
