"""Whether the served model's chat template renders tool definitions and tool calls.

A ``transformers`` chat template is a Jinja program: one that never reads ``tools`` (SmolLM2's,
for one) renders a request's tool definitions as nothing, and one that never reads an
assistant's ``tool_calls`` drops them, so the model would answer a conversation other than the
one sent. ``/v1/messages`` and ``/v1/responses`` refuse such a request (400) instead: the
template is asked once per model, by rendering a probe tool and a probe call and seeing
whether the tokens change, and a request using tools on a template that does not render them
is refused before anything runs or is cached.

NOTE: the probe renders through ``engine.prompt_tokens``, the canonical tokens every request
gets, so it sees exactly what a request would; it runs on a worker thread, once per model
(``TemplateProbe`` keeps the answer), and only for requests that use tools.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

from gateway.core.canonical import PromptInput
from gateway.core.errors import CanonicalizationError
from gateway.core.tokens import TokenIds
from gateway.service.http.errors import InvalidParam

_PROBE_TOOL = {"type": "function", "function": {
    "name": "kvgate_probe", "description": "Probe.",
    "parameters": {"type": "object", "properties": {}}}}
_PROBE_CALL = {"id": "kvgprobe1", "type": "function",
               "function": {"name": "kvgate_probe", "arguments": {}}}
"""NOTE: its id is 9 letters and digits, the only ids Mistral's templates accept."""
_ASK = {"role": "user", "content": "Probe."}


class Engine(Protocol):
    @property
    def model_name(self) -> str: ...

    def prompt_tokens(self, prompt: PromptInput) -> TokenIds: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class TemplateTools:
    """What a model's chat template renders.

    Attributes:
        renders_tools: tool definitions (``tools``) change the rendered prompt.
        renders_tool_calls: an assistant's ``tool_calls`` change it.
    """

    renders_tools: bool
    renders_tool_calls: bool


def uses_tools(prompt: PromptInput) -> tuple[bool, bool]:
    """Whether ``prompt`` has tool definitions, and whether it has tool calls."""
    calls = any("tool_calls" in message for message in prompt.messages or ())
    return bool(prompt.tools), calls


def probe(engine: Engine) -> TemplateTools:
    """Render probes through ``engine``'s template: with and without a tool, with and without a
    call (a template that rejects a probe renders it no better than one that ignores it)."""
    def differ(with_it: PromptInput, without: PromptInput) -> bool:
        try:
            return bool(list(engine.prompt_tokens(with_it))
                        != list(engine.prompt_tokens(without)))
        except CanonicalizationError:
            return False

    answer = {"role": "assistant", "content": "Probe."}
    after = [_ASK, answer, _ASK]
    return TemplateTools(
        renders_tools=differ(PromptInput(messages=[_ASK], tools=[_PROBE_TOOL]),
                             PromptInput(messages=[_ASK])),
        renders_tool_calls=differ(
            PromptInput(messages=[_ASK, {**answer, "tool_calls": [_PROBE_CALL]}, _ASK]),
            PromptInput(messages=after)))


class TemplateProbe:
    """Each model's ``TemplateTools``, probed once, and the check of a request against them."""

    def __init__(self) -> None:
        self._found: dict[str, TemplateTools] = {}
        self._lock = threading.Lock()

    def of(self, engine: Engine) -> TemplateTools:
        with self._lock:
            found = self._found.get(engine.model_name)
        if found is None:
            found = probe(engine)  # NOTE: two racing requests may both probe; same answer
            with self._lock:
                self._found[engine.model_name] = found
        return found

    def check(self, engine: Engine, prompt: PromptInput, *, model: str, tools_param: str,
              calls_param: str) -> None:
        """Refuse ``prompt`` where it uses tools the model's template does not render.

        Args:
            model: the model's name as the route reports it.
            tools_param: the request field of its tool definitions, as the 400 names it.
            calls_param: the field of the conversation that holds its tool calls.

        Raises:
            InvalidParam: it sends tool definitions, or tool calls, the template drops.
        """
        has_tools, has_calls = uses_tools(prompt)
        if not has_tools and not has_calls:
            return
        found = self.of(engine)
        if has_tools and not found.renders_tools:
            raise InvalidParam(tools_param, f"{tools_param}: the chat template of the model "
                               f"{model!r} does not render tool definitions, so the model would "
                               "never see them; leave them out, or serve a model whose chat "
                               "template supports tools (Qwen2.5, Llama 3.1 and later, ...)")
        if has_calls and not found.renders_tool_calls:
            raise InvalidParam(calls_param, f"{calls_param}: the chat template of the model "
                               f"{model!r} does not render an assistant's tool calls, so the "
                               "model would read another conversation than the one sent; send "
                               "tool calls and their results as text, or serve a model whose "
                               "chat template supports tool calls")

