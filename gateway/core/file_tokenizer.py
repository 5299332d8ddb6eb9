"""A checkpoint's tokenizer read from ``tokenizer.json`` and ``tokenizer_config.json`` with the
``tokenizers`` library alone: the same ids, special tokens, chat text and decoded text as
``HFTokenizerAdapter`` over transformers 5.23's ``AutoTokenizer``, without importing
transformers (about 2 s of every start).

What transformers does when it loads such a tokenizer, and this module repeats
(``TokenizersBackend.__init__`` and ``PreTrainedTokenizerBase._from_pretrained``):

- the backend is ``tokenizers.Tokenizer.from_file("tokenizer.json")``; its post-processor is
  kept (``add_bos_token``/``add_eos_token`` in the config are ignored beside a
  ``tokenizer.json``), and padding and truncation are off for a single encode;
- the config's ``added_tokens_decoder`` entries, and the named special tokens (``bos_token``...,
  ``*_token`` keys, ``extra_special_tokens``) that are not added tokens yet, are added to the
  backend with ``add_tokens``, named ones marked special;
- ``encode(..., split_special_tokens=True)`` sets the backend's ``encode_special_tokens``;
  ``decode`` cleans up tokenization spaces only when the config asks and the model is not BPE;
- the chat template comes from ``chat_template.jinja`` and ``additional_chat_templates/``,
  else from the config (``gateway.core.chat_template`` renders it).

NOTE: only tokenizers that transformers itself loads as a plain ``TokenizersBackend`` are read
here: ``tokenizer_class`` ``TokenizersBackend`` or ``PreTrainedTokenizerFast``, no remote code,
no legacy side files, every special token already in ``tokenizer.json``, and a model type
(``MODEL_TYPES``) for which transformers picks no class of its own. Anything else raises
``UnsupportedTokenizer`` and the caller loads it through transformers: a model-specific
tokenizer class may rebuild the backend (``LlamaTokenizer`` hard-codes Metaspace), and
repeating that is not this module's job.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError, TemplateSyntaxError
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend
from tokenizers.processors import TemplateProcessing

from gateway.core.chat_template import ChatTemplate
from gateway.core.errors import CanonicalizationError
from gateway.core.tokens import TokenIds

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                "mask_token")
"""transformers' ``SPECIAL_TOKENS_ATTRIBUTES``, in its order."""
MODEL_TYPES = ("llama",)
"""Model types for which ``AutoTokenizer`` loads a generic ``tokenizer_class`` as a plain
``TokenizersBackend`` (others may get a registered class instead, or Mistral's regex patch)."""
_UNREAD_CONFIG_KEYS = ("auto_map", "fast_tokenizer_files", "fix_mistral_regex", "post_processor",
                       "tokenizer_padding", "tokenizer_truncation", "tokenizer_file")
_LEGACY_FILES = ("special_tokens_map.json", "added_tokens.json")
NO_TEMPLATE = ("this model has no chat template, so `messages` cannot be rendered; "
               "send the text as `prompt` or the tokens as `token_ids` instead")


class UnsupportedTokenizer(ValueError):
    """The tokenizer is not one this module reads exactly; the message says why."""


class FileTokenizer:
    """A ``gateway.core.tokenizer.Tokenizer`` over a ``tokenizers`` backend (module docstring).

    Args:
        backend: the tokenizer, with every added token transformers would add.
        chat_template: the compiled chat template, None where the model has none.
        eos_token: the named EOS token's text, if any.
        clean_up_spaces: whether ``decode`` cleans up tokenization spaces.
    """

    def __init__(self, backend: Backend, *, chat_template: ChatTemplate | None,
                 eos_token: str | None, clean_up_spaces: bool) -> None:
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        self._chat_template = chat_template
        self._eos_token = eos_token
        self._clean_up_spaces = clean_up_spaces
        # NOTE: ``encode_special_tokens`` is one flag on the shared backend, set per call.
        self._encode_lock = threading.Lock()
        added = backend.get_added_tokens_decoder()
        self._special_tokens = tuple(str(t.content) for t in added.values() if t.special)

    @classmethod
    def from_directory(cls, directory: Path) -> FileTokenizer:
        """The tokenizer of the checkpoint in ``directory``.

        Raises:
            UnsupportedTokenizer: transformers would load it otherwise than this module does.
        """
        return _read(directory)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return self._special_tokens

    @property
    def eos_token_id(self) -> int | None:
        """The named EOS token's id (transformers' ``tokenizer.eos_token_id``)."""
        return None if self._eos_token is None else self._backend.token_to_id(self._eos_token)

    def encode(self, text: str, *, add_special_tokens: bool,
               split_special_tokens: bool = False) -> list[int]:
        with self._encode_lock:
            self._backend.encode_special_tokens = split_special_tokens
            encoding = self._backend.encode(text, add_special_tokens=add_special_tokens)
        return [int(i) for i in encoding.ids]

    def render_chat(self, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None,
                    add_generation_prompt: bool) -> str:
        if self._chat_template is None:
            raise CanonicalizationError(NO_TEMPLATE)
        try:
            return self._chat_template.render(messages, tools, add_generation_prompt)
        except TemplateSyntaxError:
            raise  # a broken template is the deployment's fault, not the request's
        except TemplateError as exc:
            raise CanonicalizationError(
                f"the model's chat template rejected these messages: {exc}") from exc

    def decode(self, ids: Sequence[int] | TokenIds) -> str:
        text = self._backend.decode([int(i) for i in ids], skip_special_tokens=False)
        return clean_up_tokenization(text) if self._clean_up_spaces else text


def clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``: spaces before punctuation and English
    contractions removed."""
    return (text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",")
            .replace(" ' ", "'").replace(" n't", "n't").replace(" 'm", "'m")
            .replace(" 's", "'s").replace(" 've", "'ve").replace(" 're", "'re"))


def _json(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UnsupportedTokenizer(f"cannot read {path}: {exc}") from exc
    if not isinstance(found, dict):
        raise UnsupportedTokenizer(f"{path} is not a JSON object")
    return found


def _added_token(value: Any) -> AddedToken | str:
    """A config's token: a string, or an ``AddedToken`` from its serialised form."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        fields = {k: v for k, v in value.items() if k != "__type"}
        try:
            return AddedToken(**fields)
        except TypeError as exc:
            raise UnsupportedTokenizer(f"token {value!r}: {exc}") from exc
    raise UnsupportedTokenizer(f"token {value!r} is neither a string nor an AddedToken")


def _read(directory: Path) -> FileTokenizer:
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise UnsupportedTokenizer(f"no tokenizer.json in {directory}")
    config = _json(directory / "tokenizer_config.json")
    model_type = _json(directory / "config.json").get("model_type") if (
        directory / "config.json").is_file() else None
    if config.get("tokenizer_class") not in GENERIC_CLASSES:
        raise UnsupportedTokenizer(f"tokenizer_class {config.get('tokenizer_class')!r} is not "
                                   f"one of {GENERIC_CLASSES}")
    if model_type not in MODEL_TYPES:
        raise UnsupportedTokenizer(f"model_type {model_type!r} is not one of {MODEL_TYPES}")
    if unread := [key for key in _UNREAD_CONFIG_KEYS if key in config]:
        raise UnsupportedTokenizer(f"tokenizer_config.json sets {unread}")
    if "added_tokens_decoder" not in config and (
            legacy := [name for name in _LEGACY_FILES if (directory / name).exists()]):
        raise UnsupportedTokenizer(f"legacy tokenizer files {legacy}")
    backend = Backend.from_file(str(tokenizer_file))
    named = _named_tokens(config)
    _add_config_tokens(backend, config, named)
    if backend.post_processor is None:  # as ``update_post_processor`` leaves it: no BOS/EOS
        backend.post_processor = TemplateProcessing(single="$A:0", pair="$A:0 $B:1",
                                                    special_tokens=[])
    names = {key: str(token.content if isinstance(token, AddedToken) else token)
             for key, token in named.items()}
    template = _chat_templates(directory, config)
    model = json.loads(backend.to_str()).get("model", {}).get("type") if config.get(
        "clean_up_tokenization_spaces") else None
    clean_up = bool(config.get("clean_up_tokenization_spaces")) and (
        model != "BPE" or bool(config.get(
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")))
    try:
        chat = None if template is None else ChatTemplate(template, names)
    except TemplateError as exc:
        raise UnsupportedTokenizer(f"the chat template does not compile: {exc}") from exc
    return FileTokenizer(backend, chat_template=chat, eos_token=names.get("eos_token"),
                         clean_up_spaces=clean_up)


def _named_tokens(config: dict[str, Any]) -> dict[str, AddedToken | str]:
    """The named special tokens, in transformers' order: the seven standard ones, then the
    model-specific ``*_token`` keys (``special_tokens_map`` passes all of them to templates)."""
    named: dict[str, AddedToken | str] = {}
    for key in NAMED_TOKENS:
        if config.get(key) is not None:
            named[key] = _added_token(config[key])
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
    specific = {key: _added_token(value) for key, value in config.items()
                if key.endswith("_token") and key not in NAMED_TOKENS and value is not None
                and (isinstance(value, str) or isinstance(value, dict) and "content" in value)}
    if isinstance(extra, dict):
        specific.update({key: _added_token(value) for key, value in extra.items()})
    named.update(specific)
    return named


def _add_config_tokens(backend: Backend, config: dict[str, Any],
                       named: dict[str, AddedToken | str]) -> None:
    """Add what ``TokenizersBackend.__init__`` adds: every ``added_tokens_decoder`` entry, and
    each special token not an added token yet (named ones marked special).

    Raises:
        UnsupportedTokenizer: a token is not in ``tokenizer.json`` at all (transformers would
            give it a new id, in an order this module does not repeat).
    """
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise UnsupportedTokenizer("added_tokens_decoder is not a mapping")
    to_add: list[AddedToken | str] = [
        _added_token(token) for _, token in sorted(decoder.items(), key=lambda kv: int(kv[0]))]
    encoder = [str(t.content) for t in backend.get_added_tokens_decoder().values()]
    encoder += [_content(t) for t in to_add]
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
    extras = [_added_token(t) for t in extra] if isinstance(extra, list) else []
    for token in [*named.values(), *extras]:
        if _content(token) not in encoder and token not in to_add:
            to_add.append(token)
    named_texts = {_content(t) for t in named.values()}
    tokens: list[AddedToken] = []
    for token in to_add:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and token.content in named_texts:
            token.special = True
        if backend.token_to_id(token.content) is None:
            raise UnsupportedTokenizer(f"special token {token.content!r} is not in tokenizer.json")
        tokens.append(token)
    if tokens:
        backend.add_tokens(tokens)


def _content(token: AddedToken | str) -> str:
    return token if isinstance(token, str) else str(token.content)


def _chat_templates(directory: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """The chat template(s) as ``_from_pretrained`` finds them: files first, else the config."""
    templates: dict[str, str] = {}
    default = directory / "chat_template.jinja"
    if default.is_file():
        templates["default"] = default.read_text(encoding="utf-8")
    extra_dir = directory / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if list(templates) == ["default"]:
        return templates["default"] or None  # an empty template is none (as the adapter sees it)
    if templates:
        return templates
    found = config.get("chat_template")
    if isinstance(found, list):
        return {entry["name"]: entry["template"] for entry in found}
    if found is None or isinstance(found, str):
        return found or None
    raise UnsupportedTokenizer(f"chat_template is a {type(found).__name__}")
