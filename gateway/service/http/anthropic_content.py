"""An Anthropic conversation's content blocks -> the chat template's messages.

A message's ``text`` blocks are joined with ``"\\n"`` (as an OpenAI message's text parts are).
Tool use goes where ``transformers``' chat templates read it, as the OpenAI routes would send
it:

- an assistant's ``tool_use`` blocks are its ``tool_calls``: ``{"id", "type": "function",
  "function": {"name", "arguments"}}``, ``arguments`` the ``input`` object (templates write it
  with ``tojson``); its text blocks, which must come before them, are its ``content``;
- a user's ``tool_result`` blocks, which must come first (as Anthropic requires), are each a
  ``tool`` message ``{"role": "tool", "content", "tool_call_id", "name"}`` (the name of the
  ``tool_use`` it answers, which must be earlier in the conversation), and the text blocks after
  them one ``user`` message.

So one Anthropic message may be several template messages; a block's ``cache_control`` marks the
template message it went into (``cache_breakpoints.Breakpoint``), a ``tool_use`` block's the
whole assistant message. ``is_error`` on a result is accepted and not rendered: chat templates
have no such flag, so a failure is said in the result's content.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.service.http.cache_breakpoints import Breakpoint, parse_cache_control
from gateway.service.http.errors import InvalidParam
from gateway.service.http.json_fields import type_name

REFUSED_BLOCKS = {
    "image": "images are not supported: kvgate serves a text-only model; send text blocks",
    "document": "documents are not supported: kvgate serves a text-only model; send the "
                "document's text as a text block",
    "server_tool_use": "server tools are not supported",
    "web_search_tool_result": "server tools are not supported",
    "thinking": "thinking blocks are not supported",
    "redacted_thinking": "thinking blocks are not supported",
    "search_result": "search results are not supported; send their text as a text block",
    "container_upload": "containers are not supported",
}
"""Content block types Anthropic's API has and kvgate refuses, and why."""

_BLOCK_KEYS = {
    "text": ("type", "text", "cache_control"),
    "tool_use": ("type", "id", "name", "input", "cache_control"),
    "tool_result": ("type", "tool_use_id", "content", "is_error", "cache_control"),
}


class Conversation:
    """The template messages of a request, built message by message.

    Attributes:
        messages: the chat template's messages, in order.
        parts: each message's text blocks (its ``content`` is them joined by ``"\\n"``).
        breakpoints: every ``cache_control`` met, in prompt order.
    """

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.parts: list[list[str]] = []
        self.breakpoints: list[Breakpoint] = []
        self._calls: dict[str, str] = {}

    def add_system(self, value: object) -> None:
        """The top-level ``system``: a string or text blocks."""
        texts = [value] if isinstance(value, str) else self._texts(value, "system")
        self._append({"role": "system"}, texts)

    def add(self, role: str, value: object, where: str) -> None:
        """One Anthropic message (``role`` user or assistant) and its content."""
        if isinstance(value, str):
            self._append({"role": role}, [value])
            return
        blocks = self._block_list(value, where)
        if role == "assistant":
            self._assistant(blocks, where)
        else:
            self._user(blocks, where)

    # ---- roles ------------------------------------------------------------------------

    def _assistant(self, blocks: list[tuple[str, dict[str, Any]]], where: str) -> None:
        texts: list[str] = []
        calls: list[dict[str, object]] = []
        marks: list[tuple[str, object, int]] = []
        for at, block in blocks:
            kind = block["type"]
            if kind == "text":
                if calls:
                    raise InvalidParam(at, f"{at}: a text block after a tool_use block cannot be "
                                           "rendered in order by a chat template (it writes an "
                                           "assistant's text, then its tool calls); put the text "
                                           "first")
                texts.append(_text(block, at))
                marks.append((at, block.get("cache_control"), len(texts)))
            elif kind == "tool_use":
                calls.append(self._tool_use(block, at))
                marks.append((at, block.get("cache_control"), len(texts)))
            else:
                raise InvalidParam(f"{at}.type", f"{at}: a {kind} block belongs in a user "
                                                 "message")
        message: dict[str, Any] = {"role": "assistant"}
        if calls:
            message["tool_calls"] = calls
        self._mark(marks, len(self.messages))
        self._append(message, texts)

    def _user(self, blocks: list[tuple[str, dict[str, Any]]], where: str) -> None:
        texts: list[str] = []
        marks: list[tuple[str, object, int]] = []
        for at, block in blocks:
            if block["type"] == "tool_result":
                if texts:
                    raise InvalidParam(at, f"{at}: tool_result blocks must come first in a user "
                                           "message, before any text")
                self._mark([(at, block.get("cache_control"), 1)], len(self.messages))
                self._tool_result(block, at)
            elif block["type"] == "text":
                texts.append(_text(block, at))
                marks.append((at, block.get("cache_control"), len(texts)))
            else:
                raise InvalidParam(f"{at}.type", f"{at}: a {block['type']} block belongs in an "
                                                 "assistant message")
        if texts:
            self._mark(marks, len(self.messages))
            self._append({"role": "user"}, texts)

    # ---- blocks -----------------------------------------------------------------------

    def _tool_use(self, block: Mapping[str, Any], at: str) -> dict[str, object]:
        call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidParam(f"{at}.id", f"{at}.id: Field required (the tool use's id, which "
                                           "its tool_result names)")
        if not isinstance(name, str) or not name:
            raise InvalidParam(f"{at}.name", f"{at}.name: Field required (the tool's name)")
        if not isinstance(arguments, dict):
            raise InvalidParam(f"{at}.input", f"{at}.input: must be an object, got "
                                              f"{type_name(arguments)}")
        if call_id in self._calls:
            raise InvalidParam(f"{at}.id", f"{at}.id: {call_id!r} is the id of an earlier "
                                           "tool_use; each tool use has its own")
        self._calls[call_id] = name
        return {"id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}

    def _tool_result(self, block: Mapping[str, Any], at: str) -> None:
        call_id = block.get("tool_use_id")
        if not isinstance(call_id, str) or call_id not in self._calls:
            raise InvalidParam(f"{at}.tool_use_id", f"{at}.tool_use_id: must be the id of a "
                               "tool_use block earlier in the conversation, got "
                               f"{call_id!r}")
        if not isinstance(block.get("is_error", False), bool):
            raise InvalidParam(f"{at}.is_error", f"{at}.is_error: must be true or false")
        content = block.get("content", "")
        texts = ([content] if isinstance(content, str) else [""] if content == []
                 else self._texts(content, f"{at}.content", marks=False))
        self._append({"role": "tool", "tool_call_id": call_id, "name": self._calls[call_id]},
                     texts)

    def _block_list(self, value: object, where: str) -> list[tuple[str, dict[str, Any]]]:
        if value is None:
            raise InvalidParam(where, f"{where}: Field required (a string or a list of content "
                                      "blocks)")
        if not isinstance(value, list):
            raise InvalidParam(where, f"{where}: must be a string or a list of content blocks, "
                                      f"got {type_name(value)}")
        if not value:
            raise InvalidParam(where, f"{where}: send at least one content block")
        return [(f"{where}.{j}", _checked_block(block, f"{where}.{j}"))
                for j, block in enumerate(value)]

    def _texts(self, value: object, where: str, *, marks: bool = True) -> list[str]:
        """The texts of a string or a list of text blocks (a system prompt, a tool result),
        noting each block's breakpoint on the message about to be appended."""
        texts: list[str] = []
        for at, block in self._block_list(value, where):
            if block["type"] != "text":
                raise InvalidParam(f"{at}.type", f"{at}.type: a {block['type']} block cannot be "
                                                 f"in {where}; send text blocks")
            texts.append(_text(block, at))
            if block.get("cache_control") is not None:
                if not marks:
                    raise InvalidParam(f"{at}.cache_control", f"{at}.cache_control: mark the "
                                       "tool_result block itself")
                self._mark([(at, block["cache_control"], len(texts))], len(self.messages))
        return texts

    def _mark(self, marks: list[tuple[str, object, int]], message: int) -> None:
        for at, control, num_parts in marks:
            if control is not None:
                self.breakpoints.append(Breakpoint(
                    ttl=parse_cache_control(control, f"{at}.cache_control"),
                    where=f"{at}.cache_control", message=message, num_parts=num_parts))

    def _append(self, message: dict[str, Any], texts: list[str]) -> None:
        self.messages.append({**message, "content": "\n".join(texts)})
        self.parts.append(texts)


def _checked_block(block: object, at: str) -> dict[str, Any]:
    if not isinstance(block, dict):
        raise InvalidParam(at, f"{at}: must be a content block object, got {type_name(block)}")
    kind = block.get("type")
    if kind in REFUSED_BLOCKS:
        raise InvalidParam(f"{at}.type", f"{at}: {REFUSED_BLOCKS[kind]}")
    if kind not in _BLOCK_KEYS:
        raise InvalidParam(f"{at}.type", f"{at}.type: unknown content block type {kind!r}; "
                                         "kvgate serves text, tool_use and tool_result blocks")
    unknown = sorted(name for name, item in block.items() if name not in _BLOCK_KEYS[kind]
                     and not (name == "citations" and item is None))
    if unknown:
        raise InvalidParam(at, f"{at}: unsupported keys {unknown}; a {kind} block is "
                               f"{{{', '.join(_BLOCK_KEYS[kind])}}}")
    return block


def _text(block: Mapping[str, Any], at: str) -> str:
    text = block.get("text")
    if not isinstance(text, str) or not text:
        raise InvalidParam(f"{at}.text", f"{at}.text: must be a non-empty string, got "
                                         f"{type_name(text) if text != '' else 'an empty one'}")
    return text
