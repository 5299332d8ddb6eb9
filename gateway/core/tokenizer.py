"""The seam between canonicalisation and the model's tokenizer.

``Tokenizer`` is all that ``gateway.core.canonical`` needs from a tokenizer: the number of
valid ids, the texts of its special (control) tokens, text → ids (with or without matching those
texts as special tokens), messages → text through the model's own chat template, and ids → text.
``HFTokenizerAdapter`` puts a Hugging Face ``transformers`` tokenizer behind it;
``gateway.core.file_tokenizer.FileTokenizer`` reads the same files without importing transformers
(the usual case: it spares every start ~2 s) and must behave exactly like the adapter, in every
point listed below (tests/gateway/core/test_file_tokenizer.py compares the two).

NOTE: this module never imports ``transformers``; the adapter is duck-typed over the object it
is handed, so only the module that loads the model depends on that library's API (which changed
shape between 4.x and 5.x). What it relies on, checked against transformers 5.23:

- ``len(tokenizer)`` is the number of valid ids, added tokens included. ``tokenizer.vocab_size``
  is not: it counts only the base vocabulary, so chat control tokens such as ``<|im_end|>``
  (often added tokens with ids past it, as in Llama 3 and Qwen2) would look out of range.
- ``apply_chat_template(..., tokenize=False)`` returns a ``str``. With ``tokenize=True`` it
  returns a ``BatchEncoding`` in 5.x (``return_dict`` now defaults to ``True``) where 4.x
  returned a list of ids; rendering to text and encoding separately avoids the difference.
- Templates reject conversations they cannot render with ``raise_exception``, which raises
  ``jinja2.exceptions.TemplateError``: that is a fault in the request and is translated here.
- ``tokenizer.decode`` silently drops ids it does not know, so ids are checked before use.
- ``added_tokens_decoder`` maps every added token's id to an ``AddedToken`` whose ``special``
  says whether it is a control token. ``all_special_tokens`` is not enough: it lists only the
  named ones (BOS, EOS...), not ``<|im_start|>`` when the tokenizer file added it.
- ``encode(..., split_special_tokens=True)`` encodes the text of a special token as ordinary
  text (transformers passes it to the fast backend's ``encode_special_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any, Protocol

from jinja2.exceptions import TemplateError, TemplateSyntaxError

from gateway.core.errors import CanonicalizationError
from gateway.core.tokens import TokenIds


class Tokenizer(Protocol):
    """The model's tokenizer, as canonicalisation uses it."""

    @property
    def vocab_size(self) -> int:
        """Number of valid token ids, special and added tokens included: ids are ``[0, n)``."""
        ...

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """The texts this tokenizer encodes as special (control) tokens, such as ``<|im_end|>``."""
        ...

    def encode(
        self, text: str, *, add_special_tokens: bool, split_special_tokens: bool = False
    ) -> list[int]:
        """Token ids of ``text``.

        Args:
            text: the text to encode.
            add_special_tokens: add the model's BOS/EOS convention.
            split_special_tokens: encode the text of a special token (``special_tokens``) as
                ordinary text instead of as that token.
        """
        ...

    def render_chat(
        self,
        messages: list[dict[str, str]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> str:
        """Render ``messages`` (and ``tools``) to text with the model's own chat template.

        Raises:
            CanonicalizationError: the model has no chat template, or its template rejects
                this conversation.
        """
        ...

    def decode(self, ids: Sequence[int] | TokenIds) -> str:
        """Text of ``ids``, special tokens included."""
        ...


class HFTokenizerAdapter:
    """A ``transformers`` tokenizer (``PreTrainedTokenizerFast`` or compatible) as a ``Tokenizer``.

    Args:
        tokenizer: the loaded tokenizer; only ``__len__``, ``encode``, ``decode``,
            ``added_tokens_decoder``, ``chat_template`` and ``apply_chat_template`` are used.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        # NOTE: len(), not .vocab_size, which leaves out added tokens (see the module docstring).
        return len(self._tokenizer)

    @cached_property
    def special_tokens(self) -> tuple[str, ...]:
        added = getattr(self._tokenizer, "added_tokens_decoder", None)
        if added is None:
            return tuple(self._tokenizer.all_special_tokens)
        return tuple(str(token) for token in added.values() if getattr(token, "special", False))

    def encode(
        self, text: str, *, add_special_tokens: bool, split_special_tokens: bool = False
    ) -> list[int]:
        ids = self._tokenizer.encode(
            text,
            add_special_tokens=add_special_tokens,
            split_special_tokens=split_special_tokens,
        )
        return [int(i) for i in ids]

    def render_chat(
        self,
        messages: list[dict[str, str]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> str:
        if not getattr(self._tokenizer, "chat_template", None):
            raise CanonicalizationError(
                "this model has no chat template, so `messages` cannot be rendered; "
                "send the text as `prompt` or the tokens as `token_ids` instead"
            )
        try:
            rendered = self._tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except TemplateSyntaxError:
            raise  # a broken template is the deployment's fault, not the request's
        except TemplateError as exc:
            raise CanonicalizationError(
                f"the model's chat template rejected these messages: {exc}"
            ) from exc
        if not isinstance(rendered, str):
            raise TypeError(
                "apply_chat_template(tokenize=False) returned "
                f"{type(rendered).__name__}, expected str"
            )
        return rendered

    def decode(self, ids: Sequence[int] | TokenIds) -> str:
        text = self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
        if not isinstance(text, str):
            raise TypeError(f"decode returned {type(text).__name__}, expected str")
        return text
