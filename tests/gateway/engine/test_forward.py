"""The invariant forward: a token's K/V and logits are the same however it is chunked or batched.

Runs the tiny random Llama (tests.tiny_llama) through ``BatchedForward`` and compares bit for
bit (``torch.equal``), never within a tolerance: that is the promise (docs/design.md, "Parity").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from gateway.engine.attention.tiled import TILE, AttentionItem, TiledAttention, padded_row_count
from gateway.engine.forward.batched import BatchedForward, SequenceRows, UnsupportedModel
from gateway.engine.forward.features import DecoderFeatures, LayerFeatures
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.models.loading import LoadedModel, load_model
from gateway.engine.parity.probe import probe_invariance
from tests.gateway.engine.kernels import ROWWISE, machine_products
from tests.tiny_llama import VOCAB, save_tiny_llama

PROMPT = 300


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")))


@pytest.fixture(scope="module")
def forward(tiny: LoadedModel) -> BatchedForward:
    """The tiled attention with the products this machine's search found and the probe passed
    (``ROWWISE``, invariant by construction, where none did)."""
    return BatchedForward(tiny.model, TiledAttention(), machine_products(tiny, TiledAttention()))


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _run(forward: BatchedForward, tiny: LoadedModel, tokens: torch.Tensor, chunks: list[int],
         beside: list[KVSequence] | None = None) -> tuple[KVSequence, torch.Tensor]:
    seq = KVSequence.alone(tiny.layout, int(tokens.numel()) + 8)
    at, logits = 0, None
    for size in chunks:
        batch = [SequenceRows(sequence=other, tokens=_tokens(1 + i, at + i), wants_logits=True)
                 for i, other in enumerate(beside or [])]
        mine = len(batch) // 2  # in the middle of the step's rows
        batch.insert(mine, SequenceRows(sequence=seq, tokens=tokens[at:at + size],
                                        wants_logits=True))
        logits = forward.forward(batch)[mine]
        at += size
    assert logits is not None
    return seq, logits


def _assert_same_kv(tiny: LoadedModel, a: KVSequence, b: KVSequence) -> None:
    assert a.length == b.length
    for layer in range(tiny.layout.num_layers):
        assert torch.equal(a.keys(layer), b.keys(layer)), f"K of layer {layer}"
        assert torch.equal(a.values(layer), b.values(layer)), f"V of layer {layer}"


def test_forward_computes_what_the_transformers_model_computes(forward, tiny) -> None:
    tokens = _tokens(PROMPT, 1)
    _, logits = _run(forward, tiny, tokens, [PROMPT])
    with torch.inference_mode():
        expected = tiny.transformers_model()(input_ids=tokens[None]).logits[0, -1].float()
    assert torch.allclose(logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [256, 100, TILE, 37, 7, 5, 1])
def test_chunked_prefill_gives_the_one_shot_kv_and_logits_bit_for_bit(forward, tiny,
                                                                      chunk) -> None:
    tokens = _tokens(PROMPT, 2)
    one_shot, expected = _run(forward, tiny, tokens, [PROMPT])
    sizes = [chunk] * (PROMPT // chunk) + ([PROMPT % chunk] if PROMPT % chunk else [])
    chunked, logits = _run(forward, tiny, tokens, sizes)
    _assert_same_kv(tiny, one_shot, chunked)
    assert torch.equal(logits, expected)


def test_rows_of_other_sequences_in_the_step_change_nothing(forward, tiny) -> None:
    tokens = _tokens(PROMPT, 3)
    alone, expected = _run(forward, tiny, tokens, [200, 90, 10])
    others = []
    for i, n in enumerate((3, 70, 130)):
        seq = KVSequence.alone(tiny.layout, n + 64)
        forward.forward([SequenceRows(sequence=seq, tokens=_tokens(n, 10 + i),
                                      wants_logits=False)])
        others.append(seq)
    batched, logits = _run(forward, tiny, tokens, [200, 90, 10], beside=others)
    _assert_same_kv(tiny, alone, batched)
    assert torch.equal(logits, expected)


def test_decoding_token_by_token_writes_the_kv_a_prefill_of_the_answer_writes(forward,
                                                                            tiny) -> None:
    tokens = _tokens(PROMPT, 4)
    decoded, _ = _run(forward, tiny, tokens, [PROMPT - 6] + [1] * 6)
    prefilled, _ = _run(forward, tiny, tokens, [PROMPT])
    _assert_same_kv(tiny, decoded, prefilled)


def _decode(forward: BatchedForward, tiny: LoadedModel, tokens: torch.Tensor, prompt: int,
            beside: list[KVSequence]) -> tuple[KVSequence, list[torch.Tensor]]:
    """Prefill ``tokens[:prompt]``, then feed the rest back as decode rows, ``beside`` decoding
    in the same steps; the logits of every decode step."""
    seq = KVSequence.alone(tiny.layout, int(tokens.numel()) + 8)
    forward.forward([SequenceRows(sequence=seq, tokens=tokens[:prompt], wants_logits=False)])
    logits = []
    for at in range(prompt, int(tokens.numel())):
        batch = [SequenceRows(sequence=other, tokens=_tokens(1, at + i), wants_logits=True,
                              is_decode=True) for i, other in enumerate(beside)]
        batch.insert(len(batch) // 2, SequenceRows(sequence=seq, tokens=tokens[at:at + 1],
                                                   wants_logits=True, is_decode=True))
        got = forward.forward(batch)[len(beside) // 2]
        assert got is not None
        logits.append(got)
    return seq, logits


def _histories(forward: BatchedForward, tiny: LoadedModel, lengths: list[int]) -> list[KVSequence]:
    made = []
    for i, n in enumerate(lengths):
        other = KVSequence.alone(tiny.layout, n + 16)
        forward.forward([SequenceRows(sequence=other, tokens=_tokens(n, 50 + i),
                                      wants_logits=False)])
        made.append(other)
    return made


@pytest.mark.parametrize("num_beside", [1, 3, 7])
def test_a_decode_row_keeps_its_bits_whatever_decodes_beside_it(forward, tiny,
                                                                num_beside) -> None:
    tokens = _tokens(PROMPT, 9)
    alone, alone_logits = _decode(forward, tiny, tokens, PROMPT - 5, [])
    beside = _histories(forward, tiny, [7 + 31 * i for i in range(num_beside)])
    batched, batched_logits = _decode(forward, tiny, tokens, PROMPT - 5, beside)
    _assert_same_kv(tiny, alone, batched)
    assert all(torch.equal(a, b) for a, b in zip(alone_logits, batched_logits, strict=True))


def test_a_decode_row_keeps_its_bits_beside_a_prefill_chunk(forward, tiny) -> None:
    tokens = _tokens(PROMPT, 10)
    alone, alone_logits = _decode(forward, tiny, tokens, PROMPT - 1, [])
    seq = KVSequence.alone(tiny.layout, PROMPT + 8)
    forward.forward([SequenceRows(sequence=seq, tokens=tokens[:PROMPT - 1], wants_logits=False)])
    other = KVSequence.alone(tiny.layout, 200)
    logits = forward.forward([
        SequenceRows(sequence=other, tokens=_tokens(150, 11), wants_logits=True),
        SequenceRows(sequence=seq, tokens=tokens[PROMPT - 1:], wants_logits=True,
                     is_decode=True)])[1]
    _assert_same_kv(tiny, alone, seq)
    assert logits is not None and torch.equal(logits, alone_logits[0])


def test_a_decode_entry_of_more_than_one_token_is_refused(forward, tiny) -> None:
    seq = KVSequence.alone(tiny.layout, 16)
    with pytest.raises(ValueError, match="exactly one token"):
        forward.forward([SequenceRows(sequence=seq, tokens=_tokens(2, 1), wants_logits=True,
                                      is_decode=True)])


@pytest.mark.parametrize(("rows", "padded"), [(1, 4), (3, 4), (4, 4), (5, 8), (8, 8), (9, 12),
                                               (11, 12), (12, 12), (13, 13), (300, 300)])
def test_products_are_padded_to_row_counts_whose_rows_keep_their_bits(rows, padded) -> None:
    assert padded_row_count(rows) == padded


def test_a_step_of_three_rows_writes_three_tokens_and_finite_logits(forward, tiny) -> None:
    tokens = _tokens(3, 5)
    seq = KVSequence.alone(tiny.layout, 16)
    logits = forward.forward([SequenceRows(sequence=seq, tokens=tokens, wants_logits=True)])[0]
    assert seq.length == 3
    assert logits is not None and logits.shape == (VOCAB,) and torch.isfinite(logits).all()


def test_sequences_that_want_no_logits_get_none(forward, tiny) -> None:
    a, b = KVSequence.alone(tiny.layout, 16), KVSequence.alone(tiny.layout, 16)
    out = forward.forward([SequenceRows(sequence=a, tokens=_tokens(4, 6), wants_logits=False),
                           SequenceRows(sequence=b, tokens=_tokens(4, 7), wants_logits=True)])
    assert out[0] is None and out[1] is not None


def test_tokens_beyond_a_sequences_capacity_are_refused(forward, tiny) -> None:
    seq = KVSequence.alone(tiny.layout, 4)
    with pytest.raises(ValueError, match="do not fit"):
        forward.forward([SequenceRows(sequence=seq, tokens=_tokens(5, 8), wants_logits=True)])
    assert seq.length == 0


def test_a_model_no_family_describes_is_refused(tiny) -> None:
    class GPT2LMHeadModel:
        config = type("Config", (), {"architectures": ["GPT2LMHeadModel"]})()

    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel carries no DecoderFeatures"):
        BatchedForward(GPT2LMHeadModel(), TiledAttention(), ROWWISE)


def test_features_for_another_number_of_layers_are_refused(tiny) -> None:
    three = DecoderFeatures.uniform("llama", 3, LayerFeatures())
    with pytest.raises(UnsupportedModel, match="describes 3 layers, the model has 2"):
        BatchedForward(tiny.model, TiledAttention(), ROWWISE, three)


def test_tiled_attention_equals_softmax_attention_within_float_rounding() -> None:
    gen = torch.Generator().manual_seed(0)
    n, heads, kv_heads, dim = 150, 4, 2, 16
    q = torch.randn(n, heads, dim, generator=gen)
    k = torch.randn(kv_heads, 3 * TILE, dim, generator=gen)
    v = torch.randn(kv_heads, 3 * TILE, dim, generator=gen)
    got = TiledAttention()(q, k, v, torch.arange(n))
    rep = heads // kv_heads
    scores = torch.einsum("nhd,hkd->hnk", q, k[:, :n].repeat_interleave(rep, 0)) / math.sqrt(dim)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.einsum("hnk,hkd->nhd", scores.softmax(-1), v[:, :n].repeat_interleave(rep, 0))
    assert torch.allclose(got, expected, atol=1e-5)


def test_tiled_attention_keeps_a_query_row_whatever_its_chunk() -> None:
    gen = torch.Generator().manual_seed(1)
    n, heads, kv_heads, dim = 2 * TILE + 9, 6, 2, 32
    q = torch.randn(n, heads, dim, generator=gen)
    k = torch.randn(kv_heads, 3 * TILE, dim, generator=gen)
    v = torch.randn(kv_heads, 3 * TILE, dim, generator=gen)
    attention, positions = TiledAttention(), torch.arange(n)
    whole = attention(q, k, v, positions)
    one_by_one = torch.cat([attention(q[i:i + 1], k, v, positions[i:i + 1]) for i in range(n)])
    assert torch.equal(whole, one_by_one)


def test_tiled_attention_keeps_a_decode_row_whatever_is_attended_beside_it() -> None:
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim = 6, 2, 32
    lengths = [3, 70, 2 * TILE + 9, TILE]
    sequences = [(torch.randn(n, heads, dim, generator=gen),
                  torch.randn(kv_heads, 3 * TILE, dim, generator=gen),
                  torch.randn(kv_heads, 3 * TILE, dim, generator=gen)) for n in lengths]
    attention = TiledAttention()
    # Each sequence's whole prompt at once: its last row goes through the many-query path.
    one_shot = [attention(q, k, v, torch.arange(len(q)))[-1] for q, k, v in sequences]
    last_rows = [AttentionItem.of(q[-1:], k, v, torch.tensor([len(q) - 1]))
                 for q, k, v in sequences]
    together = attention.attend(last_rows)
    alone = [attention.attend([item])[0] for item in last_rows]
    for expected, beside, by_itself in zip(one_shot, together, alone, strict=True):
        assert torch.equal(beside[0], expected)
        assert torch.equal(by_itself[0], expected)


def test_the_probe_finds_the_tiny_llama_invariant_with_products_that_keep_every_row(
        tiny) -> None:
    result = probe_invariance(BatchedForward(tiny.model, TiledAttention(), ROWWISE),
                              tiny.layout, VOCAB)
    assert result.is_invariant, result.failure
    assert result.failure is None and result.num_checks == 8


def test_the_probe_reports_whether_decoding_writes_the_prefills_kv(forward, tiny) -> None:
    tokens = _tokens(PROMPT, 12)
    decoded = _decode(forward, tiny, tokens, PROMPT - 3, [])[0]
    prefilled, _ = _run(forward, tiny, tokens, [PROMPT])
    same = all(torch.equal(decoded.keys(layer), prefilled.keys(layer))
               and torch.equal(decoded.values(layer), prefilled.values(layer))
               for layer in range(tiny.layout.num_layers))
    assert probe_invariance(forward, tiny.layout, VOCAB).decode_kv_is_prefill_kv == same


class _ChunkDependentAttention:
    """Softmax attention over only the keys of the current call's span: depends on chunking."""

    numerics = "chunk-dependent"

    def attend(self, items: Sequence[AttentionItem]) -> list[torch.Tensor]:
        return [self._one(i.queries, i.kv.keys(), i.kv.values(), i.positions) for i in items]

    def _one(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             positions: torch.Tensor) -> torch.Tensor:
        n, heads, dim = queries.shape
        rep = heads // keys.shape[0]
        end = int(positions.max()) + 1
        k = keys[:, :end].repeat_interleave(rep, 0)
        v = values[:, :end].repeat_interleave(rep, 0)
        mask = torch.arange(end)[None, :] <= positions[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            queries.transpose(0, 1), k, v, attn_mask=mask)
        return out.transpose(0, 1)


def test_the_probe_reports_an_attention_that_depends_on_the_chunking(tiny) -> None:
    result = probe_invariance(BatchedForward(tiny.model, _ChunkDependentAttention(), ROWWISE),
                              tiny.layout, VOCAB)
    assert not result.is_invariant
    assert result.failure is not None and "differ" in result.failure

