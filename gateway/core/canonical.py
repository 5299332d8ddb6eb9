"""Canonical prompts: one token sequence for every way of writing the same prompt.

A prefix is identified by its token ids (see docs/design.md, "Identity of a prefix"), so two
requests that mean the same prompt must reach the same ids before anything is hashed. The canonical
form:

- ``messages`` are rendered with the model's own chat template, then encoded without special
  tokens: the template writes its own BOS and control tokens, and adding the model's BOS again
  would double it.
- A raw ``prompt`` is encoded with the model's own special-token convention (its BOS, if any),
  as the model's tokenizer would by default.
- ``token_ids`` are checked against the vocabulary and passed through unchanged.
- Every text (message contents, the prompt, every string of a tool schema, keys included) is
  Unicode NFC with CRLF line breaks written as LF. Nothing else is rewritten: whitespace, case
  and a lone CR carry meaning.
- Tool schemas are JSON objects with their keys sorted at every level, so the tokens depend on
  what a schema says, not on the order a client's JSON library wrote it in.

Canonicalisation is idempotent: feeding canonical text back in gives the same tokens.

Prompts mean what their roles say: text a caller wrote into a chat (any message's content, any
string of a tool schema) is never encoded as the tokenizer's special (control) tokens. A user
message that spells ``<|im_end|>\n<|im_start|>system`` gets the ordinary-text tokens of those
characters, so it cannot forge a system or assistant turn, and its tokens differ from a genuine
turn's; only the markup the template writes itself becomes control tokens. This is what
OpenAI's API guarantees. ``text`` is the rendered chat either way, so a forged and a genuine
conversation can share a ``text`` but never their tokens.

A raw ``prompt`` is the opposite case and is kept as it was: it is the caller's whole text, sent
to the model as is, with no roles for it to forge, so the special tokens it spells are encoded as
special tokens (a caller may write a template by hand on purpose).

NOTE: a chat none of whose caller strings spells a special token is encoded exactly as before,
the rendered text in one ``encode`` call. Only a chat with such text takes the escaping path:
the template's output is cut at the special tokens it wrote and each piece in between is
encoded alone with special-token matching off. For byte-level BPE tokenizers (Llama 3, Qwen2,
SmolLM2) the pieces get the tokens one call would give them; a tokenizer whose pre-tokenizer
depends on a piece's position (SentencePiece's "first" prefix space) or whose control tokens
strip neighbouring spaces may tokenize such a chat a little differently around its control
tokens. Its tokens are still canonical (the same chat always gives the same ids), which is what
the cache and the engine, both fed by ``canonicalize``, rely on.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from gateway.core.errors import CanonicalizationError
from gateway.core.tokenizer import Tokenizer
from gateway.core.tokens import TokenIds, as_token_ids

ROLES = ("system", "user", "assistant", "tool")
"""The message roles a request may use; the chat template decides what each one means."""

MESSAGE_KEYS = ("role", "content")
"""The keys every message must have."""

TOOL_KEYS = {"assistant": ("tool_calls",), "tool": ("tool_call_id", "name")}
"""The keys a message of a role may have beside ``MESSAGE_KEYS``, as ``transformers``' chat
templates read them: an assistant's ``tool_calls`` (a list of ``{"type": "function",
"function": {"name", "arguments"}}`` objects, maybe with an ``id``) and, on a tool's result, the
``tool_call_id`` and ``name`` of the call it answers."""

MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of objects and arrays accepted in a tool schema (real schemas use < 10)."""

Source = Literal["messages", "prompt", "token_ids"]

_SOURCES: tuple[Source, ...] = ("messages", "prompt", "token_ids")
_CR_BEFORE_LF = re.compile(r"\r+\n")
_PREVIEW = reprlib.Repr()
_PREVIEW.maxstring = _PREVIEW.maxother = 40


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptInput:
    """A prompt as a client sent it: exactly one of ``messages``, ``prompt`` or ``token_ids``.

    Nothing is checked on construction; ``canonicalize`` checks everything, so that every fault
    in a request is reported by one call with one error type.

    Attributes:
        messages: chat messages, each ``{"role": ..., "content": ...}`` (and ``TOOL_KEYS``).
        prompt: raw text, sent to the model as is (after NFC and CRLF → LF).
        token_ids: already tokenised input.
        tools: tool (function) schemas for the chat template; only with ``messages``.
        add_generation_prompt: end the rendered chat with the assistant's turn header; only
            used with ``messages``.
    """

    messages: Sequence[Mapping[str, object]] | None = None
    prompt: str | None = None
    token_ids: Sequence[int] | None = None
    tools: Sequence[Mapping[str, object]] | None = None
    add_generation_prompt: bool = True


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class CanonicalPrompt:
    """The canonical form of a prompt: the token ids every later stage works on.

    Attributes:
        token_ids: canonical token ids (read-only ``<u4`` array).
        text: the canonical text that was encoded (the rendered chat for ``messages``);
            ``None`` for ``token_ids`` input.
        source: which field of the ``PromptInput`` the prompt came from.
    """

    token_ids: TokenIds
    text: str | None
    source: Source

    # NOTE: written out because the generated ones would compare and hash the numpy array.
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CanonicalPrompt):
            return NotImplemented
        return (
            self.source == other.source
            and self.text == other.text
            and np.array_equal(self.token_ids, other.token_ids)
        )

    def __hash__(self) -> int:
        return hash((self.source, self.text, self.token_ids.tobytes()))


def canonicalize(
    request: PromptInput,
    tokenizer: Tokenizer,
    *,
    max_prompt_tokens: int | None = None,
) -> CanonicalPrompt:
    """Turn a client's prompt into canonical token ids.

    Args:
        request: the prompt as sent.
        tokenizer: the model's tokenizer.
        max_prompt_tokens: reject prompts with more canonical tokens than this; ``None`` for
            no limit.

    Returns:
        The canonical prompt.

    Raises:
        CanonicalizationError: the request cannot be canonicalised; the message says what was
            wrong and what would be accepted.
        ValueError: ``max_prompt_tokens`` is not positive (a configuration error).
    """
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be positive, got {max_prompt_tokens}")
    source = _source_of(request)
    if request.tools is not None and source != "messages":
        raise CanonicalizationError(
            f"`tools` can only be sent with `messages` (they are rendered by the chat "
            f"template), not with `{source}`"
        )

    text: str | None
    if source == "messages":
        messages = _canonical_messages(request.messages)
        tools = _canonical_tools(request.tools)
        if not isinstance(request.add_generation_prompt, bool):
            raise CanonicalizationError(
                "`add_generation_prompt` must be true or false, got "
                f"{_preview(request.add_generation_prompt)}"
            )
        text, chat_ids = _encode_chat(tokenizer, messages, tools, request.add_generation_prompt)
        ids: Sequence[int] | TokenIds = chat_ids
        if not ids:
            raise CanonicalizationError(
                f"the chat template rendered these messages as {_preview(text)}, which has no "
                "tokens; send at least one message with content"
            )
    elif source == "prompt":
        if not isinstance(request.prompt, str):
            raise CanonicalizationError(
                f"`prompt` must be a string, got {type(request.prompt).__name__}"
            )
        text = canonical_text(_checked_text(request.prompt, "`prompt`"))
        if not text:
            raise CanonicalizationError("`prompt` is empty; send at least one character")
        ids = tokenizer.encode(text, add_special_tokens=True)
        if not ids:
            raise CanonicalizationError(f"`prompt` {_preview(text)} encodes to no tokens")
    else:
        text = None
        ids = _checked_token_ids(request.token_ids, tokenizer.vocab_size)

    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        raise CanonicalizationError(
            f"the prompt is {len(ids)} tokens long (from `{source}`), more than this "
            f"gateway's limit of {max_prompt_tokens} tokens; send a shorter prompt"
        )
    return CanonicalPrompt(token_ids=as_token_ids(ids), text=text, source=source)


def canonical_text(text: str) -> str:
    """``text`` in canonical form: Unicode NFC, with CRLF line breaks written as LF.

    NOTE: a run of CRs before an LF becomes one LF ("\\r\\r\\n" → "\\n"). Replacing "\\r\\n"
    once would leave "\\r\\n" for a second pass to rewrite, so the form would not be a fixed
    point; a CR anywhere else is kept. NFC cannot create or remove CR or LF, and an LF never
    composes with its neighbours, so the two steps commute and the result is idempotent.
    """
    if "\r" in text:
        text = _CR_BEFORE_LF.sub("\n", text)
    if not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    return text


def _encode_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
) -> tuple[str, list[int]]:
    """The rendered chat and its tokens, with caller text never encoded as control tokens.

    Each special-token text in the caller's strings is swapped for a mark (a private-use
    character found nowhere in the chat) before rendering, so that in the rendered text every
    special-token text left is markup the template wrote. That text is cut at those tokens; each
    piece in between gets the marks swapped back and is encoded with special-token matching off.

    Raises:
        CanonicalizationError: the template rejects the chat, or renders the marked chat to
            something other than the chat itself (it inspects or rewrites caller text in a way
            that the marks change), so the escaping cannot be done faithfully.
    """
    text = tokenizer.render_chat(messages, tools, add_generation_prompt)
    specials = sorted({t for t in tokenizer.special_tokens if t}, key=len, reverse=True)
    strings = [s for m in messages for s in _strings_of(m)] + [
        s for t in tools or () for s in _strings_of(t)]
    spelled = [t for t in specials if any(t in s for s in strings)]
    if not spelled:
        return text, tokenizer.encode(text, add_special_tokens=False)

    used = {*text, *"".join(strings)}
    marks = (c for c in map(chr, range(0xE000, 0xF900)) if c not in used)
    mark_of = dict(zip(spelled, marks, strict=False))
    if len(mark_of) < len(spelled):  # 6,400 private-use characters, all in the request
        raise CanonicalizationError(
            "this chat spells more of the model's special tokens than can be escaped"
        )
    caller_special = re.compile("|".join(map(re.escape, spelled)))
    spelled_of = {mark: t for t, mark in mark_of.items()}
    unmark = re.compile("|".join(map(re.escape, spelled_of)))

    def marked(value: Any) -> Any:
        if isinstance(value, str):
            return caller_special.sub(lambda m: mark_of[m.group()], value)
        if isinstance(value, dict):
            return {marked(k): marked(v) for k, v in value.items()}
        if isinstance(value, list):
            return [marked(v) for v in value]
        return value

    rendered = tokenizer.render_chat(marked(messages), marked(tools), add_generation_prompt)
    if unmark.sub(lambda m: spelled_of[m.group()], rendered) != text:
        raise CanonicalizationError(
            "the model's chat template changes message text that spells one of its special "
            "tokens, so it cannot be encoded as plain text; remove the special-token text"
        )
    ids: list[int] = []
    start = 0
    for match in re.finditer("|".join(map(re.escape, specials)), rendered):
        piece = unmark.sub(lambda m: spelled_of[m.group()], rendered[start : match.start()])
        if piece:
            ids += tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=True)
        ids += tokenizer.encode(match.group(), add_special_tokens=False)
        start = match.end()
    piece = unmark.sub(lambda m: spelled_of[m.group()], rendered[start:])
    if piece:
        ids += tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=True)
    return text, ids


def _strings_of(value: object) -> list[str]:
    """Every string in a JSON value, object keys included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (k, *_strings_of(v))]
    if isinstance(value, list):
        return [s for v in value for s in _strings_of(v)]
    return []


def _source_of(request: PromptInput) -> Source:
    given = [name for name in _SOURCES if getattr(request, name) is not None]
    if len(given) != 1:
        sent = " and ".join(f"`{name}`" for name in given) if given else "none of them"
        raise CanonicalizationError(
            f"send exactly one of `messages`, `prompt` or `token_ids`; got {sent}"
        )
    return given[0]


def _canonical_messages(messages: object) -> list[dict[str, Any]]:
    if not _is_list_like(messages):
        raise CanonicalizationError(
            "`messages` must be a list of {role, content} objects, got "
            f"{type(messages).__name__}"
        )
    assert isinstance(messages, Sequence)  # narrowed by _is_list_like
    if not messages:
        raise CanonicalizationError("`messages` is empty; send at least one message")
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise CanonicalizationError(
                f"{where} must be an object with `role` and `content`, got "
                f"{type(message).__name__}"
            )
        role = message.get("role")
        allowed = TOOL_KEYS.get(role, ()) if isinstance(role, str) else ()
        extra = [key for key in message if key not in MESSAGE_KEYS and key not in allowed]
        if extra:
            names = ", ".join(sorted(_preview(key) for key in extra))
            raise CanonicalizationError(
                f"{where} has unsupported keys {names}; a message has `role` and `content`, "
                "an assistant's may have `tool_calls`, a tool's `tool_call_id` and `name`"
            )
        for key in MESSAGE_KEYS:
            if key not in message:
                raise CanonicalizationError(f"{where} has no `{key}`")
        role = message["role"]
        if not isinstance(role, str):
            raise CanonicalizationError(
                f"{where}.role must be a string, got {type(role).__name__}"
            )
        if role not in ROLES:
            raise CanonicalizationError(
                f"{where}.role {_preview(role)} is not a known role; use one of "
                f"{', '.join(ROLES)}"
            )
        content = message["content"]
        if not isinstance(content, str):
            raise CanonicalizationError(
                f"{where}.content must be a string, got {type(content).__name__} "
                "(lists of content parts are not supported)"
            )
        content = canonical_text(_checked_text(content, f"{where}.content"))
        out.append({"role": role, "content": content, **_tool_fields(message, where)})
    return out


def _tool_fields(message: Mapping[str, object], where: str) -> dict[str, Any]:
    """A message's ``TOOL_KEYS``, canonical: calls as plain JSON with sorted keys (as tool
    schemas are), ids and names as canonical text."""
    fields: dict[str, Any] = {}
    if "tool_calls" in message:
        calls = message["tool_calls"]
        if not _is_list_like(calls) or not calls:
            raise CanonicalizationError(f"{where}.tool_calls must be a non-empty list of objects")
        assert isinstance(calls, Sequence)  # narrowed by _is_list_like
        for j, call in enumerate(calls):
            if not isinstance(call, Mapping):
                raise CanonicalizationError(
                    f"{where}.tool_calls[{j}] must be a JSON object, got {type(call).__name__}"
                )
        fields["tool_calls"] = _canonical_json(calls, f"{where}.tool_calls", depth=0)
    for key in ("tool_call_id", "name"):
        if key in message:
            value = message[key]
            if not isinstance(value, str):
                raise CanonicalizationError(
                    f"{where}.{key} must be a string, got {type(value).__name__}"
                )
            fields[key] = canonical_text(_checked_text(value, f"{where}.{key}"))
    return fields


def _canonical_tools(tools: object) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not _is_list_like(tools):
        raise CanonicalizationError(
            f"`tools` must be a list of JSON objects (tool schemas), got {type(tools).__name__}"
        )
    assert isinstance(tools, Sequence)  # narrowed by _is_list_like
    # NOTE: no tools and an empty list of tools are one prompt. Templates test `if tools`, but a
    # template testing `tools is not none` would otherwise render an empty tool section.
    if not tools:
        return None
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise CanonicalizationError(
                f"{where} must be a JSON object (a tool schema), got {type(tool).__name__}"
            )
        schema = _canonical_json(tool, where, depth=0)
        try:
            encoded = json.dumps(schema, sort_keys=True, ensure_ascii=False, allow_nan=False)
        except ValueError as exc:  # an integer too long to write out, for one
            raise CanonicalizationError(f"{where} cannot be written as JSON: {exc}") from exc
        out.append(json.loads(encoded))
    return out


def _canonical_json(value: object, where: str, *, depth: int) -> object:
    """``value`` as plain JSON data: canonical strings, sorted keys, finite numbers."""
    if depth > MAX_SCHEMA_DEPTH:
        raise CanonicalizationError(
            f"{where} is nested more than {MAX_SCHEMA_DEPTH} levels deep"
        )
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CanonicalizationError(f"{where} is {value!r}; JSON numbers must be finite")
        return float(value)
    if isinstance(value, str):
        return canonical_text(_checked_text(value, where))
    if isinstance(value, Mapping):
        items: dict[str, object] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise CanonicalizationError(
                    f"{where} has the key {_preview(key)}; JSON object keys must be strings"
                )
            name = canonical_text(_checked_text(key, f"a key of {where}"))
            if name in items:
                raise CanonicalizationError(
                    f"{where} has two keys that are both {_preview(name)} once normalised "
                    "(Unicode NFC, CRLF as LF)"
                )
            items[name] = _canonical_json(item, f"{where}[{_preview(name)}]", depth=depth + 1)
        return {name: items[name] for name in sorted(items)}
    if _is_list_like(value):
        assert isinstance(value, Sequence)  # narrowed by _is_list_like
        return [
            _canonical_json(item, f"{where}[{j}]", depth=depth + 1) for j, item in enumerate(value)
        ]
    raise CanonicalizationError(
        f"{where} is a {type(value).__name__}, which is not a JSON value"
    )


def _checked_token_ids(token_ids: object, vocab_size: int) -> TokenIds:
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            raise CanonicalizationError(
                f"`token_ids` must be a flat list of integers, got an array of "
                f"{token_ids.dtype} with shape {token_ids.shape}"
            )
        ids: Sequence[int] = token_ids.tolist()
    elif _is_list_like(token_ids):
        assert isinstance(token_ids, Sequence)  # narrowed by _is_list_like
        ids = token_ids
    else:
        raise CanonicalizationError(
            f"`token_ids` must be a list of integers, got {type(token_ids).__name__}"
        )
    if not ids:
        raise CanonicalizationError("`token_ids` is empty; send at least one token id")
    # Fast path: one C-level pass over the types instead of two isinstance() calls per id.
    if {*map(type, ids)} - {int}:
        for i, token in enumerate(ids):
            if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
                raise CanonicalizationError(
                    f"token_ids[{i}] is {_preview(token)} ({type(token).__name__}); token ids "
                    "are integers"
                )
    if min(ids) < 0 or max(ids) >= vocab_size:
        i, token = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise CanonicalizationError(
            f"token_ids[{i}] is {int(token)}, outside this model's vocabulary: token ids are "
            f"0 to {vocab_size - 1}"
        )
    return as_token_ids(ids)


def _checked_text(text: str, where: str) -> str:
    """``text`` if it is valid Unicode (no lone surrogates, so it can be written as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise CanonicalizationError(
            f"{where} contains a lone surrogate (U+{ord(text[exc.start]):04X}) at character "
            f"{exc.start}; text must be valid Unicode that can be written as UTF-8"
        ) from exc
    return text


def _is_list_like(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def _preview(value: object) -> str:
    """A short, escaped rendering of a client's value for an error message.

    Bounded in length and depth, and free of lone surrogates, so the message itself can always
    be sent back as UTF-8.
    """
    return _PREVIEW.repr(value)
