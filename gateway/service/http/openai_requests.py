"""OpenAI request bodies -> the engine's ``GenerateRequest``, validated at the edge.

Every field of ``/v1/chat/completions`` and ``/v1/completions`` is either served, accepted only
at the value that asks for nothing (``n: 1``, ``presence_penalty: 0``, ``logprobs: false``...),
or refused with a 400 that names it: a client never gets an answer that silently ignored part of
what it asked. A field sent as ``null`` counts as not sent, as in OpenAI's API.

What a prompt means is decided below this module, exactly as for gRPC: messages become a
``PromptInput`` of ``{role, content}`` and tool schemas, which the engine renders with the
model's chat template and canonicalises (NFC, CRLF, sorted tool keys). So the same chat sent
over HTTP and over gRPC is the same tokens, the same cache blocks and the same answer.

Mapped on purpose:

- ``developer`` messages are ``system`` messages (OpenAI's newer name for the same role);
- content given as a list of text parts is their texts joined by "\\n" (as vLLM does); other
  parts (images, audio, files) are refused: the model reads text;
- a ``tool`` message's ``tool_call_id`` is accepted and not rendered (chat templates render
  role and content); an assistant message's ``tool_calls`` are refused: kvgate returns the
  model's text and never parses it into tool calls;
- ``tool_choice`` may be ``auto`` or ``none`` (kvgate never returns structured tool calls, so
  neither can be broken); ``required`` or a named function is refused;
- ``priority`` is a body field as vLLM takes it (an integer, 0 by default, lower served
  first; with the OpenAI SDK ``extra_body={"priority": -1}``), from -1000 to 1000, and orders
  requests among the caller's tenant's own only (docs/design.md, "Priority lanes");
- a request's session (``gateway.core.sessions``) is named by the ``X-Session-Id`` header, or,
  with ``[http] session_from_user``, by the body's ``user`` (``with_session``);
- kvgate's own options live in one extension object, ``kvgate``: ``no_cache``, ``ttl_s``,
  ``scope`` (``tenant`` or ``shared``; shared needs an admin key), ``top_k``, ``timeout_s``
  (the most the request may run, capped by the server's maximum), ``allow_lossy`` (a JSON
  boolean, gRPC's ``CacheOptions.allow_lossy``: the prompt may be read from lossy copies, and
  the answer's usage then says ``"exact": false``; docs/design.md, "Lossy tiers"). With the
  OpenAI SDK: ``extra_body={"kvgate": {"no_cache": True}}``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal, Protocol, TypeVar

from gateway.config.keys import Principal
from gateway.core.canonical import PromptInput
from gateway.core.errors import InvalidRequest
from gateway.core.prompt_limits import PromptLimits, check_prompt_size, measure
from gateway.core.requests import (
    CacheOptions,
    GenerateRequest,
    SamplingParams,
    priority_problem,
)
from gateway.core.sessions import session_id_problem, session_use_problem
from gateway.service.edge import (
    EdgeLimits,
    check_num_tools,
    checked_ttl,
    deadline_within,
    scope_of,
)
from gateway.service.http.errors import HttpFailure, InvalidParam
from gateway.service.http.json_fields import is_int, is_number, optional_field, type_name

Kind = Literal["chat", "completion"]

DEFAULT_CHAT_MAX_TOKENS = SamplingParams().max_tokens
DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's own default for ``/v1/completions``."""

_COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
                     "stream_options", "n", "user", "priority", "kvgate"})
_CHAT_ONLY = frozenset({"messages", "tools", "tool_choice", "max_completion_tokens",
                        "parallel_tool_calls"})
_COMPLETION_ONLY = frozenset({"prompt"})

_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "presence_penalty": lambda v: is_number(v) and v == 0,
    "frequency_penalty": lambda v: is_number(v) and v == 0,
    "logprobs": lambda v: v is False or v == 0,
    "top_logprobs": lambda v: v == 0 and not isinstance(v, bool),
    "logit_bias": lambda v: v == {},
    "response_format": lambda v: v == {"type": "text"},
    "modalities": lambda v: v == ["text"],
    "store": lambda v: v is False,
    "echo": lambda v: v is False,
    "best_of": lambda v: v == 1 and not isinstance(v, bool),
    "suffix": lambda v: v == "",
}
"""Fields accepted only at the value that asks for nothing, and that value's test."""

_NEUTRAL_WORDS = {
    "presence_penalty": "0", "frequency_penalty": "0", "logprobs": "false", "top_logprobs": "0",
    "logit_bias": "{}", "response_format": '{"type": "text"}', "modalities": '["text"]',
    "store": "false", "echo": "false", "best_of": "1", "suffix": '""',
}
_CHAT_NEUTRAL = frozenset({"presence_penalty", "frequency_penalty", "logprobs", "top_logprobs",
                           "logit_bias", "response_format", "modalities", "store"})
_COMPLETION_NEUTRAL = frozenset({"presence_penalty", "frequency_penalty", "logprobs",
                                 "logit_bias", "echo", "best_of", "suffix"})

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool"}
_EXTENSION_KEYS = frozenset({"no_cache", "ttl_s", "scope", "top_k", "timeout_s", "allow_lossy"})


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenAICall:
    """A validated OpenAI request.

    Attributes:
        kind: chat or (text) completion.
        model: the model name the client asked for (checked against the served one).
        request: what the engine runs.
        stream: answer with server-sent events.
        include_usage: with ``stream``, end with a chunk that carries the usage.
        user: the body's ``user`` as sent (a session's name where ``[http]
            session_from_user`` says so: ``with_session``).
    """

    kind: Kind
    model: str
    request: GenerateRequest
    stream: bool
    include_usage: bool
    user: object = None


def parse_call(kind: Kind, body: Mapping[str, Any], principal: Principal, *,
               limits: EdgeLimits) -> OpenAICall:
    """The engine request of a ``/v1/chat/completions`` or ``/v1/completions`` body.

    Raises:
        InvalidParam: a field is missing, of the wrong type, out of range or not supported.
        PermissionDenied: the shared scope without an admin key.
    """
    fields = {name: value for name, value in body.items() if value is not None}
    _refuse_unsupported(kind, fields)
    model = fields.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidParam("model", "`model` is required: the name GET /v1/models lists")
    if fields.get("n", 1) != 1 or isinstance(fields.get("n"), bool):
        raise InvalidParam("n", f"`n` must be 1 (one choice per request), got {fields['n']!r}; "
                                "send the request again for another sample")
    stream = optional_field(fields, "stream", bool, "true or false")
    include_usage = _stream_options(fields, bool(stream))
    extension = _extension(fields)
    if kind == "chat":
        prompt = PromptInput(messages=_messages(fields.get("messages"), limits.prompt),
                             tools=_tools(fields.get("tools")))
        _tool_choice(fields)
        max_tokens = _chat_max_tokens(fields)
    else:
        prompt = _completion_prompt(fields.get("prompt"), limits.prompt)
        max_tokens = optional_field(fields, "max_tokens", int, "an integer")
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens
    try:  # bounded before the chat template renders or anything is tokenised
        check_prompt_size(measure(prompt), limits.prompt)
    except InvalidRequest as exc:
        raise InvalidParam("messages" if kind == "chat" else "prompt", str(exc)) from None
    sampling = _sampling(fields, max_tokens, extension)
    ttl = optional_field(extension, "ttl_s", float, "a number of seconds", where="kvgate.ttl_s")
    try:
        ttl = checked_ttl(ttl, limits)
    except InvalidRequest as exc:
        raise InvalidParam("kvgate.ttl_s", str(exc)) from None
    timeout = optional_field(extension, "timeout_s", float, "a number of seconds",
                        where="kvgate.timeout_s")
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise InvalidParam("kvgate.timeout_s", f"kvgate.timeout_s must be more than 0 seconds, "
                                               f"got {timeout}")
    scope_name = extension.get("scope", "tenant")
    if scope_name not in ("tenant", "shared"):
        raise InvalidParam("kvgate.scope", f"kvgate.scope must be \"tenant\" or \"shared\", got "
                                           f"{scope_name!r}")
    no_cache = optional_field(extension, "no_cache", bool, "true or false", where="kvgate.no_cache")
    allow_lossy = optional_field(extension, "allow_lossy", bool, "true or false (a JSON boolean)",
                            where="kvgate.allow_lossy")
    priority = optional_field(fields, "priority", int, "an integer (lower is served first)")
    if priority is not None and (problem := priority_problem(priority)) is not None:
        raise InvalidParam("priority", problem)
    request = GenerateRequest(
        prompt=prompt,
        scope=scope_of(principal, is_shared=scope_name == "shared"),
        sampling=sampling,
        cache=CacheOptions(no_cache=bool(no_cache), ttl_s=ttl, allow_lossy=bool(allow_lossy)),
        deadline=deadline_within(limits, timeout),
        priority=0 if priority is None else priority,
    )
    return OpenAICall(kind=kind, model=model, request=request, stream=bool(stream),
                      include_usage=include_usage, user=fields.get("user"))


class SessionCall(Protocol):
    """A validated call of any route: its engine request and the body field that may name its
    session (OpenAI's ``user``, Anthropic's ``metadata.user_id``)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def request(self) -> GenerateRequest: ...

    @property
    def user(self) -> object: ...


C = TypeVar("C", bound=SessionCall)


def with_session(call: C, header: str | None, *, from_user: bool,
                 user_field: str = "user") -> C:
    """``call`` in the session its ``X-Session-Id`` header names, or, with ``[http]
    session_from_user``, its ``user`` field (the header wins where both are sent); ``call``
    unchanged when neither names one (``gateway.core.sessions``).

    ``user`` names a session only where a session may be: a request with ``kvgate.no_cache``
    or in the shared scope keeps its ``user`` and has no session; the header is explicit, and
    there it is a 400.

    Args:
        call: an OpenAI or Anthropic call.
        header: the ``X-Session-Id`` header, if sent.
        from_user: ``[http] session_from_user``.
        user_field: the body field ``call.user`` came from, as errors name it.

    Raises:
        InvalidParam: the header, or ``user`` where it names the session, is not a session id;
            the header with ``kvgate.no_cache`` or ``kvgate.scope`` shared.
    """
    request = call.request
    use = session_use_problem(is_shared=request.scope.kind == "shared",
                              no_cache=request.cache.no_cache)
    if header is not None:
        where, session_id = "X-Session-Id", header
        if use is not None:
            raise InvalidParam(where, f"the {where} header: {use}")
    elif from_user and call.user is not None and use is None:
        where = user_field
        if not isinstance(call.user, str):
            raise InvalidParam(where, f"`{where}` names the request's session on this gateway "
                                      f"([http] session_from_user) and must be a string, got "
                                      f"{type_name(call.user)}")
        session_id = call.user
    else:
        return call
    problem = session_id_problem(session_id)
    if problem is not None:
        named = ("the X-Session-Id header" if where == "X-Session-Id" else
                 f"`{where}` (it names the request's session here: [http] session_from_user)")
        raise InvalidParam(where, f"{named}: {problem}")
    return replace(call, request=replace(request, cache=replace(request.cache,
                                                                session_id=session_id)))


def _refuse_unsupported(kind: Kind, fields: Mapping[str, Any]) -> None:
    own = _CHAT_ONLY if kind == "chat" else _COMPLETION_ONLY
    neutral = _CHAT_NEUTRAL if kind == "chat" else _COMPLETION_NEUTRAL
    for name, value in fields.items():
        if name in _COMMON or name in own:
            continue
        if name in neutral:
            if not _NEUTRAL[name](value):
                raise InvalidParam(name, f"`{name}` is not supported by kvgate; send "
                                         f"{_NEUTRAL_WORDS[name]} or leave it out")
            continue
        if name in ("messages", "prompt"):
            other = "/v1/chat/completions" if name == "messages" else "/v1/completions"
            raise InvalidParam(name, f"`{name}` belongs to {other}")
        what = {"audio": "audio output", "functions": "the deprecated `functions` (send "
                "`tools`)", "function_call": "the deprecated `function_call`",
                "prediction": "predicted outputs", "web_search_options": "web search"}
        raise InvalidParam(name, f"`{name}` is not supported by kvgate"
                                 + (f" ({what[name]})" if name in what else "")
                                 + "; leave it out")


def _messages(value: object, limits: PromptLimits) -> list[dict[str, str]]:
    if value is None:
        raise InvalidParam("messages", "`messages` is required: a list of {role, content}")
    if not isinstance(value, list):
        raise InvalidParam("messages", f"`messages` must be a list, got {type_name(value)}")
    if not value:
        raise InvalidParam("messages", "`messages` is empty; send at least one message")
    if len(value) > limits.max_messages:  # before each one is read
        raise InvalidParam("messages", f"the prompt has {len(value)} messages; send at most "
                                       f"{limits.max_messages} (limits.max_messages)")
    return [_message(i, message) for i, message in enumerate(value)]


def _message(index: int, message: object) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidParam(where, f"{where} must be an object with `role` and `content`, got "
                                  f"{type_name(message)}")
    role = message.get("role")
    if role not in _ROLES:
        raise InvalidParam(f"{where}.role", f"{where}.role must be one of "
                           f"{', '.join(_ROLES)}, got {role!r}")
    for key, value in message.items():
        if key in ("role", "content") or value is None:
            continue
        if key == "tool_call_id" and role == "tool":
            continue  # not rendered by the chat template (module docstring)
        if key == "refusal" or key == "name":
            raise InvalidParam(f"{where}.{key}", f"{where}.{key} is not supported: the chat "
                               "template renders only role and content; put it in the content")
        if key == "tool_calls":
            raise InvalidParam(f"{where}.tool_calls", f"{where}.tool_calls is not supported: "
                               "kvgate returns the model's text and never tool calls; send the "
                               "assistant's turn as its content")
        raise InvalidParam(f"{where}.{key}", f"{where}.{key} is not supported; a message has "
                           "`role` and `content` (and `tool_call_id` for a tool message)")
    return {"role": _ROLES[role], "content": _content(where, message.get("content"))}


def _content(where: str, content: object) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        raise InvalidParam(f"{where}.content", f"{where}.content is required (a string or a "
                           "list of text parts)")
    if not isinstance(content, list):
        raise InvalidParam(f"{where}.content", f"{where}.content must be a string or a list of "
                           f"text parts, got {type_name(content)}")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise InvalidParam(at, f"{at} must be a content part object, got {type_name(part)}")
        kind = part.get("type")
        if kind != "text":
            raise InvalidParam(at, f"{at} is a {kind!r} part; kvgate serves a text-only model: "
                               "send text parts only (images, audio and files are not "
                               "supported)")
        extra = sorted(set(part) - {"type", "text"})
        if extra:
            raise InvalidParam(at, f"{at} has unsupported keys {extra}; a text part is "
                               "{type: text, text}")
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidParam(at, f"{at}.text must be a string, got {type_name(text)}")
        texts.append(text)
    return "\n".join(texts)


def _tools(value: object) -> list[Mapping[str, object]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidParam("tools", f"`tools` must be a list of tool objects, got "
                                    f"{type_name(value)}")
    try:
        check_num_tools(len(value))
    except InvalidRequest as exc:
        raise InvalidParam("tools", str(exc)) from None
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise InvalidParam(f"tools[{i}]", f"tools[{i}] must be an object, got "
                                              f"{type_name(tool)}")
        if tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidParam(f"tools[{i}]", f"tools[{i}] must be {{\"type\": \"function\", "
                               "\"function\": {name, description, parameters}}: only function "
                               "tools are supported")
    return value or None


def _tool_choice(fields: Mapping[str, Any]) -> None:
    choice = fields.get("tool_choice", "auto")
    if choice not in ("auto", "none"):
        raise InvalidParam("tool_choice", "`tool_choice` may be \"auto\" or \"none\": kvgate "
                           "returns the model's text and cannot force a tool call")
    optional_field(fields, "parallel_tool_calls", bool, "true or false")


def _chat_max_tokens(fields: Mapping[str, Any]) -> int:
    legacy = optional_field(fields, "max_tokens", int, "an integer")
    current = optional_field(fields, "max_completion_tokens", int, "an integer")
    if legacy is not None and current is not None and legacy != current:
        raise InvalidParam("max_completion_tokens", f"`max_tokens` ({legacy}) and "
                           f"`max_completion_tokens` ({current}) disagree; send one of them")
    chosen = current if current is not None else legacy
    return DEFAULT_CHAT_MAX_TOKENS if chosen is None else chosen


def _completion_prompt(value: object, limits: PromptLimits) -> PromptInput:
    """A raw prompt: text, token ids, or a batch of one of them.

    Token ids count as one character each against ``limits.max_chars``, checked before any of
    them is read (a body of a million ids is refused at its length).
    """
    if value is None:
        raise InvalidParam("prompt", "`prompt` is required: the text to complete")
    if isinstance(value, str):
        return PromptInput(prompt=value)
    if isinstance(value, list) and len(value) > limits.max_chars:
        raise InvalidParam("prompt", f"`prompt` holds {len(value)} items; send at most "
                                     f"{limits.max_chars} token ids (limits.max_prompt_chars: "
                                     "a token id counts as one character)")
    if isinstance(value, list) and value and all(is_int(t) for t in value):
        return PromptInput(token_ids=[int(t) for t in value])
    if isinstance(value, list) and len(value) == 1:
        return _completion_prompt(value[0], limits)
    if isinstance(value, list) and len(value) > 1:
        raise InvalidParam("prompt", f"`prompt` holds {len(value)} prompts; send one per request "
                           "(batches are not supported)")
    raise InvalidParam("prompt", "`prompt` must be a string or a list of token ids, got "
                       f"{type_name(value)}")


def _sampling(fields: Mapping[str, Any], max_tokens: int,
              extension: Mapping[str, Any]) -> SamplingParams:
    defaults = SamplingParams()
    temperature = optional_field(fields, "temperature", float, "a number")
    top_p = optional_field(fields, "top_p", float, "a number")
    top_k = optional_field(extension, "top_k", int, "an integer", where="kvgate.top_k")
    seed = optional_field(fields, "seed", int, "an integer")
    stop = fields.get("stop")
    if isinstance(stop, str):
        stops: tuple[str, ...] = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    elif stop is None:
        stops = ()
    else:
        raise InvalidParam("stop", f"`stop` must be a string or a list of strings, got "
                                   f"{type_name(stop)}")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=defaults.temperature if temperature is None else temperature,
        top_p=defaults.top_p if top_p is None else top_p,
        top_k=defaults.top_k if top_k is None else top_k,
        seed=seed,
        stop=stops,
    )
    problems = params.problems()
    if problems:
        param = next((name for name in ("max_tokens", "temperature", "top_p", "top_k", "seed",
                                        "stop") if problems[0].startswith(name)), "")
        raise InvalidParam(param, "invalid sampling: " + "; ".join(problems))
    return params


def _stream_options(fields: Mapping[str, Any], stream: bool) -> bool:
    options = fields.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise InvalidParam("stream_options", "`stream_options` goes with `stream: true`")
    if not isinstance(options, dict):
        raise InvalidParam("stream_options", f"`stream_options` must be an object, got "
                                             f"{type_name(options)}")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise InvalidParam("stream_options", f"stream_options has unsupported keys {unknown}; "
                                             "kvgate knows include_usage")
    return bool(optional_field(options, "include_usage", bool, "true or false",
                          where="stream_options.include_usage"))


def _extension(fields: Mapping[str, Any]) -> dict[str, Any]:
    extension = fields.get("kvgate", {})
    if not isinstance(extension, dict):
        raise InvalidParam("kvgate", f"`kvgate` must be an object of kvgate's options, got "
                                     f"{type_name(extension)}")
    unknown = sorted(set(extension) - _EXTENSION_KEYS)
    if unknown:
        raise InvalidParam("kvgate", f"kvgate has unknown keys {unknown}; known: "
                                     f"{sorted(_EXTENSION_KEYS)}")
    return {name: value for name, value in extension.items() if value is not None}


def check_model(model: str, served: tuple[str, ...]) -> None:
    """Raise a 404 ``model_not_found`` unless ``model`` is one of the ``served`` names."""
    if model not in served:
        raise HttpFailure(status=404, type="invalid_request_error", code="model_not_found",
                          param="model",
                          message=f"the model {model!r} is not served here; this gateway "
                                  f"serves {served[0]!r} (GET /v1/models)")
