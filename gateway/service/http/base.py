"""The seams of the HTTP front's routes: how an answer is written, how an error is shaped.

Each hosted API the front speaks (OpenAI's ``openai_responses``, Anthropic's
``anthropic_responses``) implements ``AnswerRendering``; ``app`` drives either the same way:
the opening events, one per piece of text, the closing ones with the usage -- or, not
streamed, one whole answer.
"""

from __future__ import annotations

from typing import Protocol

from gateway.core.requests import Usage
from gateway.service.http.errors import ErrorAnswer


class AnswerRendering(Protocol):
    """The response objects and server-sent events of one request."""

    def completion(self, text: str, usage: Usage) -> dict[str, object]:
        """The whole answer, not streamed."""
        ...

    def opening(self) -> list[str]:
        """The events before any text."""
        ...

    def delta(self, text: str) -> str:
        """The event of one piece of generated text."""
        ...

    def closing(self, usage: Usage) -> list[str]:
        """The last events, with the usage."""
        ...

    def stream_error(self, answer: ErrorAnswer) -> str:
        """The event that ends a stream which failed after it began."""
        ...


class ErrorShape(Protocol):
    """How a route answers a request that failed (``errors.error_answer``'s signature)."""

    def __call__(self, exc: BaseException, *, where: str, retry_after_s: int) -> ErrorAnswer:
        ...
