"""The fixed-shape flash attention: a prefill row's bits never depend on its chunk, a decode
row's never on what is attended beside it (docs/design.md, "Parity";
gateway.engine.attention.flash).

Bit for bit (``torch.equal``), on random queries and keys with SmolLM2's head shape (9 query
heads over 3 KV heads), across the 512-position key block.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from gateway.engine.attention.choice import attention_for
from gateway.engine.attention.flash import KEY_BLOCK, FlashBlockAttention
from gateway.engine.attention.tiled import TILE, AttentionItem, TiledAttention
from gateway.engine.forward.batched import BatchedForward
from gateway.engine.kv.sequence import CAPACITY_ALIGNMENT
from gateway.engine.models.loading import LoadedModel, load_model
from gateway.engine.parity.probe import probe_invariance
from tests.gateway.engine.kernels import ROWWISE
from tests.tiny_llama import VOCAB, save_tiny_llama

HEADS, KV_HEADS, DIM = 9, 3, 64
CAPACITY = 3 * KEY_BLOCK


@pytest.fixture(scope="module")
def sequence() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(KV_HEADS, CAPACITY, DIM, generator=generator)
    values = torch.randn(KV_HEADS, CAPACITY, DIM, generator=generator)
    queries = torch.randn(CAPACITY, HEADS, DIM, generator=generator)
    return queries, keys, values


def _attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
            end: int, *, is_decode: bool = False) -> torch.Tensor:
    item = AttentionItem.of(queries[start:end], keys, values, torch.arange(start, end),
                            is_decode=is_decode)
    return FlashBlockAttention().attend([item])[0]


@pytest.mark.parametrize("total", [40, 700, 1200])
def test_a_prompt_attended_in_any_chunks_equals_it_attended_one_shot(sequence, total) -> None:
    queries, keys, values = sequence
    one_shot = _attend(queries, keys, values, 0, total)
    rng = random.Random(total)
    for _ in range(3):
        at, parts = 0, []
        while at < total:
            size = min(total - at, rng.choice([1, 2, 3, 5, 31, 32, 33, 100, 129, 300]))
            parts.append(_attend(queries, keys, values, at, at + size))
            at += size
        assert torch.equal(torch.cat(parts), one_shot)


def test_a_decode_row_keeps_its_bits_whatever_is_attended_beside_it(sequence) -> None:
    queries, keys, values = sequence
    alone = _attend(queries, keys, values, 900, 901, is_decode=True)
    others = [AttentionItem.of(queries[i:i + 1], keys, values, torch.tensor([i]), is_decode=True)
              for i in (3, 600, 1400)]
    mine = AttentionItem.of(queries[900:901], keys, values, torch.tensor([900]), is_decode=True)
    prefill = AttentionItem.of(queries[100:300], keys, values, torch.arange(100, 300))
    together = FlashBlockAttention().attend([others[0], prefill, mine, *others[1:]])
    assert torch.equal(together[2], alone)


def test_flash_attention_equals_softmax_attention_within_float_rounding(sequence) -> None:
    queries, keys, values = sequence
    got = _attend(queries, keys, values, 500, 560)
    k = keys[:, :560].repeat_interleave(HEADS // KV_HEADS, 0)
    v = values[:, :560].repeat_interleave(HEADS // KV_HEADS, 0)
    scores = queries[500:560].transpose(0, 1) @ k.transpose(1, 2) / math.sqrt(DIM)
    hidden = torch.arange(560)[None, :] > torch.arange(500, 560)[:, None]
    expected = (scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v).transpose(0, 1)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_buffers_shorter_than_a_whole_key_block_are_refused(sequence) -> None:
    queries, keys, values = sequence
    with pytest.raises(ValueError, match="multiple of 512"):
        _attend(queries, keys[:, :100], values[:, :100], 0, 10)


def test_sequence_buffers_are_allocated_in_whole_key_blocks_and_tiles() -> None:
    assert CAPACITY_ALIGNMENT % KEY_BLOCK == 0 and CAPACITY_ALIGNMENT % TILE == 0


def test_the_cpu_gets_the_flash_attention_where_the_paged_kernel_does_not_apply() -> None:
    assert isinstance(attention_for(torch.device("cpu"), dtype=torch.bfloat16),
                      FlashBlockAttention)


def test_the_two_attentions_have_different_namespaces() -> None:
    assert FlashBlockAttention.numerics != TiledAttention.numerics


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")))


def test_the_probe_finds_the_tiny_llama_invariant_with_flash_attention(tiny) -> None:
    """With products that keep every row (``ROWWISE``), what the probe checks is the
    attention's fixed-shape calls on this machine."""
    result = probe_invariance(BatchedForward(tiny.model, FlashBlockAttention(), ROWWISE),
                              tiny.layout, VOCAB)
    assert result.is_invariant, result.failure
