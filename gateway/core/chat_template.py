"""A model's chat template rendered as transformers 5.23 renders it, without transformers.

Why: ``gateway.core.file_tokenizer`` serves a checkpoint's tokenizer without importing
transformers (about 2 s of every start), and the chat template is what turns messages into the
text the model was trained on: a template rendered with other settings or other helpers gives
other text, other tokens and other block keys than the same gateway loaded through
transformers. So this module rebuilds exactly what transformers gives a template
(``utils/chat_template_utils.py``, ``_cached_compile_jinja_template`` and
``render_jinja_template``):

- a Jinja ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the
  ``loopcontrols`` extension and the ``{% generation %}`` tag (rendered as its body: the
  assistant-mask tracking is not used here);
- ``tojson`` without HTML escaping and with ``ensure_ascii=False``, ``raise_exception``
  (raises ``jinja2.exceptions.TemplateError``), ``strftime_now``, and the ``dict`` and
  ``namespace`` globals that refuse underscore names;
- the inputs rebuilt from plain JSON types, ``None`` fields dropped from messages, and
  ``reasoning_content`` aliased as transformers aliases it;
- the named special tokens (``bos_token``...) as template variables, ``documents=None``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""Names a message's reasoning is passed under (transformers' ``_REASONING_FIELDS``)."""


class _Generation(jinja2.ext.Extension):
    """The ``{% generation %}...{% endgeneration %}`` tag of transformers' ``AssistantTracker``,
    which renders its body (the tracker records offsets only when asked to, which we never do)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: jinja2.runtime.Macro) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` for templates, without attribute access to the real type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(
            "Chat templates cannot store underscore-prefixed attributes on a namespace, but got "
            f"{name!r}. Please rename the attribute.")


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` refusing dunder (underscore) attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # NOTE: no named ``self``, as in Jinja's own Namespace: ``namespace(self=...)`` works.
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def plain_template_data(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types (transformers' ``_plain_template_data``): what the
    sandbox cannot see through becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_template_data(k): plain_template_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_template_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_template_data(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_template_data(getattr(value, f.name))
                for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[Any]) -> list[Any]:
    aliased = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next((message[key] for key in _REASONING_FIELDS
                              if message.get(key) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


class ChatTemplate:
    """A tokenizer's chat template(s), compiled once.

    Args:
        templates: the template, or several by name (transformers' dict form: ``default``,
            ``tool_use``...).
        special_tokens_map: the named special tokens' texts, passed to every render.

    Raises:
        jinja2.exceptions.TemplateSyntaxError: a template does not compile.
    """

    def __init__(self, templates: str | Mapping[str, str],
                 special_tokens_map: Mapping[str, str]) -> None:
        env = _environment()
        if isinstance(templates, str):
            self._compiled: jinja2.Template | dict[str, jinja2.Template] = env.from_string(
                templates)
        else:
            self._compiled = {name: env.from_string(text) for name, text in templates.items()}
        self._special_tokens_map = dict(special_tokens_map)

    def _pick(self, tools: list[dict[str, Any]] | None) -> jinja2.Template:
        """The template ``get_chat_template`` picks when none is named."""
        if isinstance(self._compiled, jinja2.Template):
            return self._compiled
        if tools is not None and "tool_use" in self._compiled:
            return self._compiled["tool_use"]
        if "default" in self._compiled:
            return self._compiled["default"]
        raise ValueError(
            "This model has multiple chat templates with no default specified! Please either pass "
            "a chat template or the name of the template you wish to use to the `chat_template` "
            f"argument. Available template names are {sorted(self._compiled)}.")

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool) -> str:
        """The text of ``messages`` (and ``tools``), as ``apply_chat_template(...,
        tokenize=False)`` renders it.

        Raises:
            jinja2.exceptions.TemplateError: the template rejects the conversation.
            ValueError: the conversation is empty, or no template applies.
        """
        template = self._pick(tools)
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at "
                             "least one message.")
        chat = [{k: v for k, v in message.items() if v is not None} for message in messages]
        chat = _alias_reasoning(plain_template_data(chat))
        return template.render(messages=chat, tools=plain_template_data(tools), documents=None,
                               add_generation_prompt=add_generation_prompt,
                               **plain_template_data(self._special_tokens_map))
