"""Anthropic Messages request bodies (``POST /v1/messages``) -> the engine's ``GenerateRequest``.

Like the OpenAI routes (``openai_requests``), every field is served or refused with a 400
naming it, never silently ignored. A prompt is rendered exactly as a chat completion's:
``system`` becomes the first message, a message's text blocks are joined by ``"\\n"`` (as an
OpenAI message's text parts are), so the same conversation sent to either route is the same
tokens and the same cache blocks.

Served: ``model``, ``max_tokens`` (required, as Anthropic requires it), ``messages`` (``user``
and ``assistant``; content a string or ``text``, ``tool_use`` and ``tool_result`` blocks, as
``anthropic_content`` renders them), ``system`` (a string or ``text`` blocks), ``temperature``,
``top_p``, ``top_k``, ``stop_sequences``, ``stream``, ``metadata.user_id`` (it names the
request's session where ``[http] session_from_user`` says so, as OpenAI's ``user`` does),
``cache_control`` on blocks and at the top level (``cache_breakpoints``), custom ``tools``
(rendered by the chat template as the OpenAI route renders function tools: the same schemas,
the same prompt) with ``tool_choice`` ``auto`` or ``none``. Whether the model's template
renders tools and tool calls at all is checked before the request runs (``template_tools``).

Refused, each with a 400 saying why: images and documents (the model reads text), a forced
``tool_choice`` (kvgate returns the model's text and never parses it into tool calls), server
tools, a breakpoint on a tool (the template decides where tool definitions go), thinking, a
last ``assistant`` message (prefilling the answer: the chat template closes the assistant's
turn), citations, and any field or block type Anthropic's API does not have.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.config.keys import Principal
from gateway.core.canonical import PromptInput
from gateway.core.errors import InvalidRequest
from gateway.core.prompt_limits import PromptLimits, check_prompt_size, measure
from gateway.core.requests import CacheOptions, GenerateRequest, SamplingParams
from gateway.service.edge import EdgeLimits, check_num_tools, deadline_within, scope_of
from gateway.service.http.anthropic_content import Conversation
from gateway.service.http.cache_breakpoints import (
    Breakpoint,
    CachePlan,
    parse_cache_control,
    plan_of,
)
from gateway.service.http.errors import InvalidParam
from gateway.service.http.json_fields import optional_field, type_name

_FIELDS = frozenset({"model", "max_tokens", "messages", "system", "temperature", "top_p",
                     "top_k", "stop_sequences", "stream", "metadata", "cache_control", "tools",
                     "tool_choice", "diagnostics"})

_REFUSED_FIELDS = {
    "thinking": "extended thinking is not supported",
    "mcp_servers": "MCP servers are not supported",
    "container": "containers are not supported",
    "service_tier": "service tiers are not supported: every request is served alike",
    "output_config": "output configuration is not supported",
    "context_management": "context management is not supported",
    "inference_geo": "inference regions are not supported",
}
"""Anthropic fields kvgate does not serve, and why (anything else unknown is refused too)."""

_ROLES = ("user", "assistant")


@dataclass(frozen=True, slots=True, kw_only=True)
class MessagesCall:
    """A validated ``POST /v1/messages`` request.

    Attributes:
        model: the model name the client asked for (checked against the served one).
        request: what the engine runs (its ``cache.ttl_s`` is ``caching.ttl_s``).
        stream: answer with Anthropic's server-sent events.
        user: ``metadata.user_id`` as sent (a session's name where ``[http]
            session_from_user`` says so: ``with_session``).
        caching: how long the request's blocks are kept (its ``cache_control`` breakpoints).
        stop_sequences: as sent (the answer names the one that stopped it, where it can tell).
        diagnose: the request sent ``diagnostics``: its shape is kept for later requests to
            be compared with, and its answer carries ``diagnostics``.
        previous_message_id: ``diagnostics.previous_message_id``: the earlier message this
            request's prompt is compared with (None: the first turn).
    """

    model: str
    request: GenerateRequest
    stream: bool
    user: object = None
    caching: CachePlan = CachePlan()
    stop_sequences: tuple[str, ...] = ()
    diagnose: bool = False
    previous_message_id: str | None = None


def parse_messages(body: Mapping[str, Any], principal: Principal, *,
                   limits: EdgeLimits) -> MessagesCall:
    """The engine request of a ``/v1/messages`` body.

    Raises:
        InvalidParam: a field is missing, of the wrong type, out of range or not supported.
    """
    fields = {name: value for name, value in body.items() if value is not None}
    for name in fields:
        if name in _FIELDS:
            continue
        if name in _REFUSED_FIELDS:
            raise InvalidParam(name, f"{name}: {_REFUSED_FIELDS[name]}; leave it out")
        raise InvalidParam(name, f"{name}: Extra inputs are not permitted (kvgate serves "
                                 f"{', '.join(sorted(_FIELDS))})")
    model = fields.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidParam("model", "model: Field required: the name GET /v1/models lists")
    max_tokens = optional_field(fields, "max_tokens", int, "an integer")
    if max_tokens is None:
        raise InvalidParam("max_tokens", "max_tokens: Field required")
    chat = Conversation()
    if "system" in fields:
        chat.add_system(fields["system"])
    _conversation(fields.get("messages"), limits.prompt, chat)
    if "cache_control" in fields:
        chat.breakpoints.append(Breakpoint(ttl=parse_cache_control(fields["cache_control"],
                                                                   "cache_control"),
                                           where="cache_control"))
    tools = _tools(fields.get("tools"))
    _tool_choice(fields.get("tool_choice"))
    caching = plan_of(chat.breakpoints, chat.messages, chat.parts, limits, tools=tools)
    prompt = PromptInput(messages=chat.messages, tools=tools)
    try:  # bounded before the chat template renders or anything is tokenised
        check_prompt_size(measure(prompt), limits.prompt)
    except InvalidRequest as exc:
        raise InvalidParam("messages", f"messages: {exc}") from None
    stops = _stop_sequences(fields.get("stop_sequences"))
    sampling = _sampling(fields, max_tokens, stops)
    request = GenerateRequest(
        prompt=prompt,
        scope=scope_of(principal, is_shared=False),
        sampling=sampling,
        cache=CacheOptions(ttl_s=caching.ttl_s),
        deadline=deadline_within(limits, None),
    )
    return MessagesCall(model=model, request=request,
                        stream=bool(optional_field(fields, "stream", bool, "true or false")),
                        user=_user_id(fields.get("metadata")), caching=caching,
                        stop_sequences=stops, diagnose="diagnostics" in fields,
                        previous_message_id=_previous_message_id(fields.get("diagnostics")))


def _previous_message_id(value: object) -> str | None:
    """``diagnostics.previous_message_id`` (None: no diagnostics asked, or the first turn)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidParam("diagnostics", f"diagnostics: must be an object, got "
                                          f"{type_name(value)}")
    unknown = sorted(set(value) - {"previous_message_id"})
    if unknown:
        raise InvalidParam(f"diagnostics.{unknown[0]}", f"diagnostics.{unknown[0]}: Extra "
                           "inputs are not permitted (diagnostics takes previous_message_id)")
    previous = value.get("previous_message_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise InvalidParam("diagnostics.previous_message_id", "diagnostics.previous_message_id: "
                           "must be the id of an earlier message (msg_...) or null")
    return previous


def _conversation(value: object, limits: PromptLimits, chat: Conversation) -> None:
    if value is None:
        raise InvalidParam("messages", "messages: Field required: a list of {role, content}")
    if not isinstance(value, list):
        raise InvalidParam("messages", f"messages: must be a list, got {type_name(value)}")
    if not value:
        raise InvalidParam("messages", "messages: at least one message is required")
    if len(value) > limits.max_messages:  # before each one is read
        raise InvalidParam("messages", f"messages: the prompt has {len(value)} messages; send "
                                       f"at most {limits.max_messages} (limits.max_messages)")
    for i, message in enumerate(value):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise InvalidParam(where, f"{where}: must be an object with `role` and `content`, "
                                      f"got {type_name(message)}")
        unknown = sorted(set(message) - {"role", "content"})
        if unknown:
            raise InvalidParam(where, f"{where}: unknown keys {unknown}; a message is "
                                      "{role, content}")
        role = message.get("role")
        if role not in _ROLES:
            raise InvalidParam(f"{where}.role", f"{where}.role: must be \"user\" or "
                                                f"\"assistant\", got {role!r} (the system "
                                                "prompt goes in the top-level `system`)")
        chat.add(role, message.get("content"), f"{where}.content")
    if chat.messages[-1]["role"] == "assistant":
        raise InvalidParam(f"messages.{len(value) - 1}", f"messages.{len(value) - 1}: a final "
                           "assistant message (prefilling the answer) is not supported: the chat "
                           "template closes the assistant's turn; end with a user message")
    if len(chat.messages) > limits.max_messages:
        raise InvalidParam("messages", f"messages: the prompt has {len(chat.messages)} messages "
                                       "once each tool result is one; send at most "
                                       f"{limits.max_messages} (limits.max_messages)")


def _tools(value: object) -> list[Mapping[str, object]] | None:
    """Anthropic's tool definitions as the chat template's function schemas: the same
    ``{"type": "function", "function": {name, description, parameters}}`` the OpenAI route
    takes, so the same tools through either route render the same prompt."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidParam("tools", f"tools: must be a list of tool definitions, got "
                                    f"{type_name(value)}")
    try:
        check_num_tools(len(value))
    except InvalidRequest as exc:
        raise InvalidParam("tools", f"tools: {exc}") from None
    schemas: list[Mapping[str, object]] = []
    for i, tool in enumerate(value):
        at = f"tools.{i}"
        if not isinstance(tool, dict):
            raise InvalidParam(at, f"{at}: must be a tool definition object, got "
                                   f"{type_name(tool)}")
        if tool.get("type", "custom") != "custom":
            raise InvalidParam(f"{at}.type", f"{at}: server tools ({tool.get('type')!r}) are not "
                                             "supported; define a custom tool")
        if tool.get("cache_control") is not None:
            raise InvalidParam(f"{at}.cache_control", f"{at}.cache_control: a breakpoint on a "
                               "tool is not supported (the chat template decides where tool "
                               "definitions go in the prompt); mark the system prompt's last "
                               "block instead")
        unknown = sorted(set(tool) - {"type", "name", "description", "input_schema",
                                      "cache_control"})
        if unknown:
            raise InvalidParam(at, f"{at}: unsupported keys {unknown}; a tool is {{name, "
                                   "description, input_schema}}")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise InvalidParam(f"{at}.name", f"{at}.name: Field required (a string)")
        if not isinstance(schema, dict):
            raise InvalidParam(f"{at}.input_schema", f"{at}.input_schema: must be a JSON schema "
                                                     f"object, got {type_name(schema)}")
        function: dict[str, object] = {"name": name, "parameters": schema}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        schemas.append({"type": "function", "function": function})
    return schemas or None


def _tool_choice(value: object) -> None:
    kind = value.get("type") if isinstance(value, dict) else value
    if value is not None and kind not in ("auto", "none"):
        raise InvalidParam("tool_choice", "tool_choice: may be {\"type\": \"auto\"} or "
                           "{\"type\": \"none\"}: kvgate returns the model's text and "
                           "cannot force a tool call")


def _stop_sequences(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InvalidParam("stop_sequences", f"stop_sequences: must be a list of strings, got "
                                             f"{type_name(value)}")
    return tuple(value)


def _sampling(fields: Mapping[str, Any], max_tokens: int,
              stops: tuple[str, ...]) -> SamplingParams:
    defaults = SamplingParams()
    temperature = optional_field(fields, "temperature", float, "a number")
    top_p = optional_field(fields, "top_p", float, "a number")
    top_k = optional_field(fields, "top_k", int, "an integer")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=defaults.temperature if temperature is None else temperature,
        top_p=defaults.top_p if top_p is None else top_p,
        top_k=defaults.top_k if top_k is None else top_k,
        stop=stops,
    )
    problems = params.problems()
    if problems:
        param = next((name for name in ("max_tokens", "temperature", "top_p", "top_k")
                      if problems[0].startswith(name)), "stop_sequences")
        raise InvalidParam(param, f"{param}: " + "; ".join(problems))
    return params


def _user_id(metadata: object) -> object:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise InvalidParam("metadata", f"metadata: must be an object, got "
                                       f"{type_name(metadata)}")
    unknown = sorted(set(metadata) - {"user_id"})
    if unknown:
        raise InvalidParam("metadata", f"metadata: unknown keys {unknown}; kvgate knows "
                                       "user_id")
    user = metadata.get("user_id")
    if user is not None and not isinstance(user, str):
        raise InvalidParam("metadata.user_id", f"metadata.user_id: must be a string, got "
                                               f"{type_name(user)}")
    return user



def credentials(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """``headers`` with an ``x-api-key`` (how Anthropic's SDKs send a key) written as the
    ``Authorization: Bearer`` the gateway's keys are checked on; a key sent both ways is two
    ``authorization`` headers, which the authenticator refuses."""
    return [("authorization", f"Bearer {value}") if name.lower() == "x-api-key"
            else (name, value) for name, value in headers]
