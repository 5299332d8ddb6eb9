"""A small, real, offline tokenizer for tests: byte-level BPE behind a ChatML chat template.

Built in memory with the ``tokenizers`` library and wrapped in
``transformers.PreTrainedTokenizerFast``, so tests exercise the same code paths (chat-template
rendering, added special tokens, BOS handling) that a Hub tokenizer would, without a download.

The model is byte-level, so any string, including any Unicode a property test can generate,
encodes without unknown tokens, and a non-empty string to at least one token. Its vocabulary is
the 256 byte symbols plus the merges a BPE trainer learns from a fixed corpus (ids 0-399), then
the three special tokens as added tokens (ids 400-402). Training is deterministic (ties are
broken by pair order), so every run builds the same tokenizer, in a few milliseconds.

NOTE: unlike SmolLM2, this tokenizer prepends ``<|endoftext|>`` as a BOS token when asked to add
special tokens (as Llama's do), and its template writes ``bos_token`` itself. That makes the
canonical rule "a template carries its own BOS; a raw prompt gets the model's" observable in
tests: rendered messages start with exactly one BOS, and so does a raw prompt.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gateway.core.tokenizer import HFTokenizerAdapter

BOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (BOS, IM_START, IM_END)
NUM_BASE_TOKENS = 400
NUM_TOKENS = NUM_BASE_TOKENS + len(SPECIAL_TOKENS)

# A ChatML template in the manner of SmolLM2-Instruct and Qwen2.5: tools, when given, are listed
# one JSON object per line (``tojson``) inside the system turn, and an assistant's tool calls
# follow its text as Qwen2.5 writes them (``<tool_call>`` JSON); a tool's result is a ``tool``
# turn. Like many Hub templates it rejects some conversations with ``raise_exception``.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{ '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('a system message is only allowed as the first message') }}"
    "{%- endif %}"
    "{%- if not (message['role'] == 'system' and tools) %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{ (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

PLAIN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""SmolLM2-Instruct's kind of template: roles and contents only, tools and tool calls never read."""

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. You are a helpful assistant.\n",
    "system user assistant tool tools function name description parameters type object\n",
    '{"type": "function", "function": {"name": "get_weather", "parameters": {}}}\n',
    "Hello, world! How are you today? I am fine, thank you. What is the weather like?\n",
    "Caching shared prompt prefixes saves the prefill of every request that repeats them.\n",
)


def make_hf_tokenizer(*, with_chat_template: bool = True,
                      chat_template: str = CHAT_TEMPLATE) -> Any:
    """Build the test tokenizer as a ``transformers`` tokenizer (``PreTrainedTokenizerFast``).

    Args:
        with_chat_template: attach ``chat_template``; ``False`` gives a base-model tokenizer.
        chat_template: the template (``CHAT_TEMPLATE`` unless a test needs another).
    """
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=NUM_BASE_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS * 4, trainer=trainer)
    # Added after training, so they take ids after the learned vocabulary, as Llama 3's and
    # Qwen2's do (SmolLM2's sit at ids 0-2 inside it): the tokenizer's ``vocab_size`` then
    # counts 400 while 403 ids are valid, the difference the adapter must get right.
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    # transformers' constructors are unannotated; called through Any so mypy takes them as is.
    tokenizer_class: Any = PreTrainedTokenizerFast
    return tokenizer_class(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=IM_END,
        add_bos_token=True,
        chat_template=chat_template if with_chat_template else None,
    )


def make_test_tokenizer(*, with_chat_template: bool = True) -> HFTokenizerAdapter:
    """The test tokenizer behind the gateway's ``Tokenizer`` seam."""
    return HFTokenizerAdapter(make_hf_tokenizer(with_chat_template=with_chat_template))
