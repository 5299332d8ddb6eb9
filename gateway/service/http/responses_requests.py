"""OpenAI Responses request bodies (``POST /v1/responses``) -> the engine's ``GenerateRequest``.

As on the other routes, every field is served or refused with a 400 naming it. The prompt is a
chat: ``instructions`` as its system message, then the conversation ``previous_response_id``
names (what that response's request sent and what it answered, ``stored_responses``), then
``input``. So a conversation continued through ``previous_response_id`` is the same tokens as
the same turns sent whole, or through ``/v1/chat/completions``: its earlier turns are cached
blocks, and only the new turn is computed. OpenAI does not carry a previous response's
``instructions`` over, and neither does kvgate: each request's own are the system message.

Served: ``model``, ``input`` (a string, or message items: ``role`` user, system, developer
or assistant, ``content`` a string or ``input_text`` / ``output_text`` parts), ``instructions``,
``previous_response_id``, ``store`` (default true), ``max_output_tokens``, ``temperature``,
``top_p``, ``stream``, ``metadata`` (echoed), ``prompt_cache_key`` (accepted: never part of a
block key, and not a session), ``prompt_cache_retention`` (``in_memory`` / ``in-memory``: the
blocks kept 5 minutes after their last use, as the hosted API keeps a prefix; ``24h``: a day),
``truncation: "disabled"``, function ``tools`` (rendered by the chat template as the other
routes render them) with ``tool_choice`` ``auto`` or ``none``, and ``function_call`` /
``function_call_output`` input items: a call joins the assistant message item right before it
in the same ``input`` as one of its ``tool_calls`` (else it is an assistant message of its own,
with no text), its ``arguments`` (a JSON object written as a string) parsed into the object
templates write; an output is a ``tool`` message naming its call's id and function (the call
must be earlier in the conversation). Whether the model's template renders tools and calls at
all is checked before the request runs (``template_tools``).
Refused: images, files and audio, built-in tools, reasoning, ``background``, ``conversation``
and anything else.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gateway.config.keys import Principal
from gateway.core.canonical import PromptInput
from gateway.core.errors import InvalidRequest
from gateway.core.prompt_limits import PromptLimits, check_prompt_size, measure
from gateway.core.requests import CacheOptions, GenerateRequest, SamplingParams
from gateway.service.edge import (
    EdgeLimits,
    check_num_tools,
    checked_ttl,
    deadline_within,
    hosted_api_ttl,
    scope_of,
)
from gateway.service.http.errors import InvalidParam
from gateway.service.http.json_fields import optional_field, type_name

RETENTION_TTL_S: dict[str, float | None] = {"in_memory": None, "in-memory": None,
                                            "24h": 24 * 3600.0}
"""``prompt_cache_retention``: a day, or (None) the hosted API's 5 minutes for the blocks and the
response store's own TTL for the stored response (a conversation outlives its cached blocks:
an idle one is recomputed, never lost)."""

_FIELDS = frozenset({"model", "input", "instructions", "previous_response_id", "store",
                     "prompt_cache_options",
                     "max_output_tokens", "temperature", "top_p", "stream", "metadata",
                     "prompt_cache_key", "prompt_cache_retention", "truncation", "tool_choice",
                     "tools", "parallel_tool_calls"})
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = frozenset({"input_text", "output_text"})


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponsesCall:
    """A validated ``POST /v1/responses`` request.

    Attributes:
        model: the model name the client asked for.
        request: what the engine runs (its prompt is whole once ``continued``).
        stream: answer with the Responses API's server-sent events.
        store: keep the response for ``previous_response_id`` and ``GET``.
        previous_response_id: the response this one continues (None: a new conversation).
        instructions: the system message, if any.
        turn: the messages this request adds (its ``input``).
        ttl_s: how long the stored response is kept after its last use (None: the store's own).
        metadata: echoed in the response.
        max_output_tokens: as sent (echoed).
        user: None (the Responses API names no session in its body; ``X-Session-Id`` does).
        prompt_cache_key: as sent (a routing hint; compared by ``prompt_cache_diagnostics``).
        comparison_response_id: ``prompt_cache_options.comparison_response_id``: the earlier
            response this one's prompt is compared with (None: no diagnostics asked).
    """

    model: str
    request: GenerateRequest
    stream: bool
    store: bool
    previous_response_id: str | None
    instructions: str | None
    turn: tuple[Mapping[str, Any], ...]
    ttl_s: float | None = None
    metadata: Mapping[str, object] | None = None
    max_output_tokens: int | None = None
    user: object = None
    prompt_cache_key: str | None = None
    comparison_response_id: str | None = None
    tools: tuple[Mapping[str, object], ...] = ()
    tool_choice: str = "auto"


def parse_responses(body: Mapping[str, Any], principal: Principal, *,
                    limits: EdgeLimits) -> ResponsesCall:
    """The engine request of a ``/v1/responses`` body (its earlier turns added by
    ``continued`` where ``previous_response_id`` names some).

    Raises:
        InvalidParam: a field is missing, of the wrong type, out of range or not supported.
    """
    fields = {name: value for name, value in body.items() if value is not None}
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        raise InvalidParam(unknown[0], f"`{unknown[0]}` is not supported by kvgate on "
                                       "/v1/responses; leave it out")
    model = fields.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidParam("model", "`model` is required: the name GET /v1/models lists")
    tools, schemas, tool_choice = _tools(fields)
    instructions = fields.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidParam("instructions", f"`instructions` must be a string, got "
                                           f"{type_name(instructions)}")
    turn = _input(fields.get("input"), limits.prompt)
    previous = fields.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise InvalidParam("previous_response_id", "`previous_response_id` must be the id of a "
                                                   "stored response")
    retention = fields.get("prompt_cache_retention", "in_memory")
    if retention not in RETENTION_TTL_S:
        raise InvalidParam("prompt_cache_retention", "`prompt_cache_retention` must be "
                           f"\"in_memory\" or \"24h\", got {retention!r}")
    try:
        ttl = checked_ttl(RETENTION_TTL_S[retention], limits)
    except InvalidRequest as exc:
        raise InvalidParam("prompt_cache_retention", str(exc)) from None
    blocks_ttl = hosted_api_ttl(limits) if ttl is None else ttl
    key = fields.get("prompt_cache_key")
    if key is not None and not isinstance(key, str):
        raise InvalidParam("prompt_cache_key", f"`prompt_cache_key` must be a string, got "
                                               f"{type_name(key)}")
    metadata = fields.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise InvalidParam("metadata", f"`metadata` must be an object, got "
                                       f"{type_name(metadata)}")
    if fields.get("truncation", "disabled") != "disabled":
        raise InvalidParam("truncation", "`truncation` may only be \"disabled\": kvgate never "
                                         "drops part of a conversation")
    store = optional_field(fields, "store", bool, "true or false")
    max_output_tokens = optional_field(fields, "max_output_tokens", int, "an integer")
    sampling = _sampling(fields, max_output_tokens)
    request = GenerateRequest(
        prompt=_prompt(instructions, (), turn, limits.prompt, schemas),
        scope=scope_of(principal, is_shared=False),
        sampling=sampling,
        cache=CacheOptions(ttl_s=blocks_ttl),
        deadline=deadline_within(limits, None),
    )
    return ResponsesCall(model=model, request=request,
                         stream=bool(optional_field(fields, "stream", bool, "true or false")),
                         store=True if store is None else store,
                         previous_response_id=previous, instructions=instructions,
                         turn=tuple(turn), ttl_s=ttl, metadata=metadata,
                         max_output_tokens=max_output_tokens, prompt_cache_key=key,
                         comparison_response_id=_comparison_response_id(
                             fields.get("prompt_cache_options")),
                         tools=tools, tool_choice=tool_choice)


def _comparison_response_id(value: object) -> str | None:
    """``prompt_cache_options.comparison_response_id``; the implicit mode is kvgate's (every
    full block is cached), and lifetimes are ``prompt_cache_retention``'s."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidParam("prompt_cache_options", "`prompt_cache_options` must be an object, "
                                                   f"got {type_name(value)}")
    for name, option in value.items():
        if name == "mode" and option == "implicit":
            continue
        if name != "comparison_response_id":
            raise InvalidParam(f"prompt_cache_options.{name}",
                               f"`prompt_cache_options.{name}` is not supported: kvgate caches "
                               "every full block implicitly, kept as `prompt_cache_retention` "
                               "says; it serves `comparison_response_id` and `mode: implicit`")
    compared = value.get("comparison_response_id")
    if compared is not None and (not isinstance(compared, str) or not compared):
        raise InvalidParam("prompt_cache_options.comparison_response_id",
                           "`prompt_cache_options.comparison_response_id` must be the id of an "
                           "earlier response")
    return compared


def continued(call: ResponsesCall, earlier: Sequence[Mapping[str, Any]],
              limits: PromptLimits) -> ResponsesCall:
    """``call`` with the conversation it continues (``earlier``) before its own turn.

    Raises:
        InvalidParam: the whole conversation is over the prompt's limits, or a function call's
            output names no call in it.
    """
    prompt = _prompt(call.instructions, earlier, call.turn, limits, call.request.prompt.tools)
    return replace(call, request=replace(call.request, prompt=prompt))


def conversation(call: ResponsesCall) -> list[dict[str, Any]]:
    """The messages of ``call``'s prompt without its instructions (what a stored response
    keeps, the answer then appended)."""
    messages = [dict(message) for message in call.request.prompt.messages or ()]
    return messages[1:] if call.instructions is not None else messages


def _prompt(instructions: str | None, earlier: Sequence[Mapping[str, Any]],
            turn: Sequence[Mapping[str, Any]], limits: PromptLimits,
            tools: Sequence[Mapping[str, object]] | None = None) -> PromptInput:
    head = [] if instructions is None else [{"role": "system", "content": instructions}]
    messages = _named_outputs([*head, *earlier, *turn])
    if len(messages) > limits.max_messages:
        raise InvalidParam("input", f"the conversation has {len(messages)} messages; at most "
                                    f"{limits.max_messages} (limits.max_messages)")
    prompt = PromptInput(messages=messages, tools=tools)
    try:  # bounded before the chat template renders or anything is tokenised
        check_prompt_size(measure(prompt), limits)
    except InvalidRequest as exc:
        raise InvalidParam("input", str(exc)) from None
    return prompt


def _named_outputs(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each tool output naming the function of the call it answers.

    Raises:
        InvalidParam: an output's ``call_id`` names no function call before it.
    """
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        for call in message.get("tool_calls", ()):
            names[call["id"]] = call["function"]["name"]
        if message["role"] == "tool" and "name" not in message:
            call_id = message["tool_call_id"]
            if call_id not in names:
                raise InvalidParam("input", f"a function_call_output names call_id {call_id!r}, "
                                            "but no function_call item with that call_id comes "
                                            "before it in the conversation; send the call too")
            message["name"] = names[call_id]
        out.append(message)
    return out


def _input(value: object, limits: PromptLimits) -> list[dict[str, Any]]:
    if value is None:
        raise InvalidParam("input", "`input` is required: a string or a list of message items")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidParam("input", f"`input` must be a string or a non-empty list of message "
                                    f"items, got {type_name(value)}")
    if len(value) > limits.max_messages:  # before each one is read
        raise InvalidParam("input", f"`input` has {len(value)} items; send at most "
                                    f"{limits.max_messages} (limits.max_messages)")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidParam(where, f"{where} must be an input item, got {type_name(item)}")
        kind = item.get("type", "message")
        if kind == "function_call":
            call = _function_call(where, item)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_function_output(where, item))
        elif kind == "message":
            messages.append(_item(where, item))
        else:
            raise InvalidParam(f"{where}.type", f"{where} is a {kind!r} item; kvgate takes "
                               "message, function_call and function_call_output items")
    return messages


def _item(where: str, item: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(item) - {"type", "role", "content", "id", "status"})
    if unknown:
        raise InvalidParam(where, f"{where} has unsupported keys {unknown}")
    role = item.get("role")
    if role not in _ROLES:
        raise InvalidParam(f"{where}.role", f"{where}.role must be one of {', '.join(_ROLES)}, "
                                            f"got {role!r}")
    return {"role": _ROLES[role], "content": _text_of(f"{where}.content", item.get("content"))}


def _text_of(where: str, content: object) -> str:
    """A string, or text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise InvalidParam(where, f"{where} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type_name(part)
            raise InvalidParam(at, f"{at} is a {kind!r} part; kvgate serves a text-only model: "
                                   "send input_text parts (images, files and audio are not "
                                   "supported)")
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidParam(f"{at}.text", f"{at}.text must be a string, got "
                                             f"{type_name(text)}")
        texts.append(text)
    return "\n".join(texts)


def _function_call(where: str, item: Mapping[str, Any]) -> dict[str, object]:
    """A ``function_call`` item as a template's tool call."""
    unknown = sorted(set(item) - {"type", "call_id", "name", "arguments", "id", "status"})
    if unknown:
        raise InvalidParam(where, f"{where} has unsupported keys {unknown}")
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidParam(f"{where}.call_id", f"{where}.call_id is required: the id its "
                                               "function_call_output names")
    if not isinstance(name, str) or not name:
        raise InvalidParam(f"{where}.name", f"{where}.name is required: the function's name")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else None
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict):
        raise InvalidParam(f"{where}.arguments", f"{where}.arguments must be a JSON object "
                                                 "written as a string (e.g. \"{}\")")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}


def _function_output(where: str, item: Mapping[str, Any]) -> dict[str, Any]:
    """A ``function_call_output`` item as a ``tool`` message (named later: ``_named_outputs``)."""
    unknown = sorted(set(item) - {"type", "call_id", "output", "id", "status"})
    if unknown:
        raise InvalidParam(where, f"{where} has unsupported keys {unknown}")
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidParam(f"{where}.call_id", f"{where}.call_id is required: the id of the "
                                               "function_call it answers")
    return {"role": "tool", "content": _text_of(f"{where}.output", item.get("output")),
            "tool_call_id": call_id}


def _tools(fields: Mapping[str, Any]) -> tuple[tuple[Mapping[str, object], ...],
                                               list[Mapping[str, object]] | None, str]:
    """``tools`` as sent (echoed), as the chat template's function schemas (the same the other
    routes render), and ``tool_choice``."""
    choice = fields.get("tool_choice", "auto")
    if choice not in ("auto", "none"):
        raise InvalidParam("tool_choice", "`tool_choice` may be \"auto\" or \"none\": kvgate "
                                          "returns the model's text and cannot force a call")
    optional_field(fields, "parallel_tool_calls", bool, "true or false")
    tools = fields.get("tools", [])
    if not isinstance(tools, list):
        raise InvalidParam("tools", f"`tools` must be a list, got {type_name(tools)}")
    try:
        check_num_tools(len(tools))
    except InvalidRequest as exc:
        raise InvalidParam("tools", f"tools: {exc}") from None
    schemas: list[Mapping[str, object]] = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type_name(tool)
            raise InvalidParam(at, f"{at} is a {kind!r} tool; kvgate takes function tools "
                                   "(built-in tools are not supported)")
        unknown = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
        if unknown:
            raise InvalidParam(at, f"{at} has unsupported keys {unknown}")
        name, parameters = tool.get("name"), tool.get("parameters")
        if not isinstance(name, str) or not name:
            raise InvalidParam(f"{at}.name", f"{at}.name is required: the function's name")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidParam(f"{at}.parameters", f"{at}.parameters must be a JSON schema "
                                                   f"object, got {type_name(parameters)}")
        optional_field(tool, "strict", bool, "true or false", where=f"{at}.strict")
        function: dict[str, object] = {"name": name}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        if parameters is not None:
            function["parameters"] = parameters
        schemas.append({"type": "function", "function": function})
    return tuple(tools), schemas or None, str(choice)


def _sampling(fields: Mapping[str, Any], max_tokens: int | None) -> SamplingParams:
    defaults = SamplingParams()
    temperature = optional_field(fields, "temperature", float, "a number")
    top_p = optional_field(fields, "top_p", float, "a number")
    params = SamplingParams(
        max_tokens=defaults.max_tokens if max_tokens is None else max_tokens,
        temperature=defaults.temperature if temperature is None else temperature,
        top_p=defaults.top_p if top_p is None else top_p,
    )
    problems = params.problems()
    if problems:
        param = next((name for name, said in (("max_output_tokens", "max_tokens"),
                                              ("temperature", "temperature"),
                                              ("top_p", "top_p"))
                      if problems[0].startswith(said)), "")
        raise InvalidParam(param, "invalid sampling: " + "; ".join(problems))
    return params
