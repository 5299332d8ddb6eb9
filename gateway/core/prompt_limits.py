"""Bounds on a prompt's size, checked before the chat template is rendered or anything tokenised.

docs/reliability.md threat 5 (oversized requests): the token limit (``max_prompt_tokens``) can only
be checked after tokenising, and rendering a chat template over thousands of messages or
tokenising megabytes of text is the expensive part. So every front counts what a request
carries -- characters of message contents and roles, of a raw prompt and of tool schemas, and
the number of messages -- and refuses it with INVALID_ARGUMENT before any of that work.

A front with protobuf or JSON in hand measures it itself (``PromptSize``) before building
anything; ``measure`` does it for a ``PromptInput`` already built.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.core.canonical import PromptInput
from gateway.core.errors import InvalidRequest


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptLimits:
    """The most a prompt may carry.

    Attributes:
        max_chars: characters of message contents and roles, raw prompt and tool schemas.
        max_messages: number of messages.
    """

    max_chars: int = 262_144
    max_messages: int = 512

    def __post_init__(self) -> None:
        if self.max_chars < 1 or self.max_messages < 1:
            raise ValueError("max_chars and max_messages must be >= 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptSize:
    """What a request carries, counted without parsing or rendering anything."""

    num_chars: int
    num_messages: int


def check_prompt_size(size: PromptSize, limits: PromptLimits) -> None:
    """Refuse a prompt over ``limits``.

    Raises:
        InvalidRequest: too many messages or characters; the message names the limit.
    """
    if size.num_messages > limits.max_messages:
        raise InvalidRequest(
            f"the prompt has {size.num_messages} messages; send at most {limits.max_messages} "
            "(limits.max_messages)")
    if size.num_chars > limits.max_chars:
        raise InvalidRequest(
            f"the prompt has {size.num_chars} characters (messages, prompt and tools "
            f"together); send at most {limits.max_chars} (limits.max_prompt_chars)")


def check_prefix_size(prefix_text: str, limits: PromptLimits) -> None:
    """Refuse an admin eviction's prefix text over the bound of a prompt's characters.

    The text is tokenised and its blocks hashed like a prompt's (as a system message and as a
    raw prompt), here and on every replica the eviction is published to, so it is bounded like
    one; a longer prefix could not select anything, since no cached prompt is longer.

    Raises:
        InvalidRequest: too many characters; the message names the limit.
    """
    if len(prefix_text) > limits.max_chars:
        raise InvalidRequest(
            f"prefix_text has {len(prefix_text)} characters; a prefix is bounded like a "
            f"prompt: send at most {limits.max_chars} (limits.max_prompt_chars)")


def measure(prompt: PromptInput) -> PromptSize:
    """The size of a ``PromptInput`` (for fronts that build one before checking)."""
    num_chars = len(prompt.prompt) if isinstance(prompt.prompt, str) else 0
    messages = prompt.messages or ()
    for message in messages:
        if isinstance(message, Mapping):  # tool calls (JSON) count as they would be written
            num_chars += sum(len(v) if isinstance(v, str)
                             else len(json.dumps(v, separators=(",", ":"), default=str))
                             for v in message.values())
    for tool in prompt.tools or ():
        num_chars += len(json.dumps(tool, separators=(",", ":"), default=str))
    return PromptSize(num_chars=num_chars, num_messages=len(messages))
