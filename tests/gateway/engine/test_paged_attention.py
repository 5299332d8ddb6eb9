"""The paged attention: K/V read in place through block tables, each row's bits its own.

Compares bit for bit (``torch.equal``) wherever the promise is sameness (batch, chunking, page
order, decode vs prefill, the machine's vector units), and against a float64 reference within a
stated tolerance for accuracy.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.engine.attention.choice import attention_for
from gateway.engine.attention.paged import PagedAttention, PagedKernel, paged_kernel_problem
from gateway.engine.attention.tiled import AttentionItem
from gateway.engine.forward.batched import BatchedForward
from gateway.engine.kv.sequence import LayerPages
from gateway.engine.models.loading import LoadedModel, load_model
from gateway.engine.native.build import NativeBuildError
from gateway.engine.parity.probe import probe_invariance
from tests.gateway.engine.kernels import ROWWISE
from tests.tiny_llama import VOCAB, save_tiny_llama

KV_HEADS, REP, DIM, PAGE = 2, 3, 32, 16
HEADS = KV_HEADS * REP
NUM_PAGES = 64
TOLERANCE = 2e-6
"""Largest absolute error against float64 for unit-normal inputs (each weight is within ~2 ulp
of exp, the sums are float32 sums over at most a few hundred terms)."""


@pytest.fixture(scope="module", autouse=True)
def _kernel_builds() -> None:
    problem = paged_kernel_problem(torch.device("cpu"), torch.float32)
    if problem is not None:
        pytest.skip(f"the paged kernel cannot be built here: {problem}")


@pytest.fixture(scope="module")
def pool() -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's K and V pages ``[kv_heads, pages, page_tokens, head_dim]``, random."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(KV_HEADS, NUM_PAGES, PAGE, DIM, generator=generator)
    values = torch.randn(KV_HEADS, NUM_PAGES, PAGE, DIM, generator=generator)
    return keys, values


def _item(pool: tuple[torch.Tensor, torch.Tensor], table: list[int] | torch.Tensor,
          queries: torch.Tensor, start: int, *, is_decode: bool = False,
          says_first: bool = False) -> AttentionItem:
    """An item over ``table``'s pages; ``says_first``: with its first position said on the
    host, as the forward makes it."""
    keys, values = pool
    n = int(queries.shape[0])
    return AttentionItem(queries, LayerPages(keys, values, torch.as_tensor(table)),
                         torch.arange(start, start + n), is_decode,
                         first_position=start if says_first else None)


def _queries(n: int, seed: int, dim: int = DIM) -> torch.Tensor:
    return torch.randn(n, HEADS, dim, generator=torch.Generator().manual_seed(seed))


def _reference(pool: tuple[torch.Tensor, torch.Tensor], table: list[int],
               queries: torch.Tensor, start: int) -> torch.Tensor:
    """Softmax attention in float64 over the table's pages gathered, causal by position."""
    keys, values = pool
    dim = keys.shape[-1]
    k = keys[:, table].reshape(KV_HEADS, -1, dim).double().repeat_interleave(REP, 0)
    v = values[:, table].reshape(KV_HEADS, -1, dim).double().repeat_interleave(REP, 0)
    n = int(queries.shape[0])
    positions = torch.arange(start, start + n)
    scores = torch.einsum("nhd,hkd->hnk", queries.double(), k) / dim ** 0.5
    hidden = torch.arange(k.shape[1])[None, None, :] > positions[None, :, None]
    weights = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return torch.einsum("hnk,hkd->nhd", weights, v)


def _table(seed: int, pages: int) -> list[int]:
    return random.Random(seed).sample(range(1, NUM_PAGES), pages)


def test_a_row_is_within_the_stated_tolerance_of_float64_attention(pool) -> None:
    table = _table(1, 12)
    queries = _queries(12 * PAGE, 1)
    out = PagedAttention().attend([_item(pool, table, queries, 0)])[0]
    assert (out.double() - _reference(pool, table, queries, 0)).abs().max() < TOLERANCE


def test_a_row_keeps_its_bits_beside_other_sequences_of_other_lengths(pool) -> None:
    mine = _table(2, 9)
    queries = _queries(3, 2)
    alone = PagedAttention().attend([_item(pool, mine, queries, 130)])[0]
    others = [_item(pool, _table(10 + i, 1 + 3 * i), _queries(1 + 5 * i, 10 + i), i)
              for i in range(4)]
    together = PagedAttention().attend([others[0], others[1], _item(pool, mine, queries, 130),
                                        *others[2:]])
    assert torch.equal(together[2], alone)


@given(num_others=st.integers(min_value=0, max_value=11),
       shared_pages=st.integers(min_value=0, max_value=8))
@settings(max_examples=25, deadline=None)
def test_decode_rows_sharing_pages_keep_each_rows_bits(pool, num_others: int,
                                                        shared_pages: int) -> None:
    """Decode rows of many sequences are attended together, their tables walked page by page
    in lockstep so that a page they share (a system prompt) is read once for all: each row's
    bits are still the ones it has alone, whatever its neighbours, shared pages or not."""
    prefix = _table(40, 8)[:shared_pages]
    tails = [_table(50 + i, 2) for i in range(num_others + 1)]
    tables = [prefix + [page for page in tail if page not in prefix] for tail in tails]
    items = [_item(pool, table, _queries(1, 60 + i), len(table) * PAGE - 1 - i % PAGE,
                   is_decode=True) for i, table in enumerate(tables)]
    together = PagedAttention().attend(items)
    for item, attended in zip(items, together, strict=True):
        assert torch.equal(attended, PagedAttention().attend([item])[0])


@given(cuts=st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=12))
@settings(max_examples=25, deadline=None)
def test_a_prompt_attended_in_any_chunks_equals_it_attended_one_shot(pool, cuts) -> None:
    table = _table(3, 10)
    total = 10 * PAGE - 5
    queries = _queries(total, 3)
    one_shot = PagedAttention().attend([_item(pool, table, queries, 0)])[0]
    at, parts = 0, []
    for size in [*cuts, total]:
        end = min(total, at + size)
        parts.append(PagedAttention().attend([_item(pool, table, queries[at:end], at)])[0])
        at = end
        if at == total:
            break
    assert torch.equal(torch.cat(parts), one_shot)


def test_a_decode_row_has_the_numbers_of_the_same_row_in_a_prefill(pool) -> None:
    table = _table(4, 6)
    queries = _queries(80, 4)
    prefill = PagedAttention().attend([_item(pool, table, queries, 0)])[0]
    decode = PagedAttention().attend([_item(pool, table, queries[79:], 79, is_decode=True)])[0]
    assert torch.equal(decode[0], prefill[79])


def test_where_the_pages_lie_in_the_pool_changes_nothing(pool) -> None:
    keys, values = pool
    table = _table(5, 8)
    queries = _queries(8 * PAGE, 5)
    scattered = PagedAttention().attend([_item(pool, table, queries, 0)])[0]
    consecutive = (keys[:, table].contiguous(), values[:, table].contiguous())
    in_order = PagedAttention().attend([_item(consecutive, list(range(8)), queries, 0)])[0]
    assert torch.equal(in_order, scattered)


def test_contiguous_kv_is_read_as_the_same_numbers_as_its_pages(pool) -> None:
    keys, values = pool
    table = _table(6, 5)
    queries = _queries(5 * PAGE, 6)
    paged = PagedAttention().attend([_item(pool, table, queries, 0)])[0]
    flat = AttentionItem.of(queries, keys[:, table].reshape(KV_HEADS, -1, DIM),
                            values[:, table].reshape(KV_HEADS, -1, DIM),
                            torch.arange(5 * PAGE))
    assert torch.equal(PagedAttention().attend([flat])[0], paged)


def test_positions_after_a_row_are_never_read(pool) -> None:
    keys, values = pool
    table = _table(7, 4)
    queries = _queries(2 * PAGE + 3, 7)
    clean = PagedAttention().attend([_item(pool, table, queries, 0)])[0]
    dirty_keys, dirty_values = keys.clone(), values.clone()
    last = table[2]
    dirty_keys[:, last, 3:] = float("nan")
    dirty_values[:, last, 3:] = float("inf")
    for page in table[3:]:
        dirty_keys[:, page] = float("nan")
    dirty = PagedAttention().attend([_item((dirty_keys, dirty_values), table, queries, 0)])[0]
    assert torch.equal(dirty, clean)


def test_a_position_past_the_table_is_refused(pool) -> None:
    with pytest.raises(ValueError, match="past the K/V"):
        PagedAttention().attend([_item(pool, [1, 2], _queries(1, 8), 2 * PAGE)])


def test_the_portable_build_computes_the_vectorised_builds_bits(pool) -> None:
    """The numbers do not depend on the machine's vector units: a build without AVX2/FMA flags
    (what a CPU without them runs) gives the same bits as this machine's build."""
    try:
        portable = PagedKernel.load(portable=True)
    except NativeBuildError as exc:
        pytest.skip(str(exc))
    items = [_item(pool, _table(20 + i, 3 + 2 * i), _queries(9 + 7 * i, 20 + i), 5 * i)
             for i in range(3)]
    vectorised = PagedAttention().attend(items)
    for expected, got in zip(vectorised, PagedAttention(portable).attend(items), strict=True):
        assert torch.equal(got, expected)


def test_a_step_made_once_for_its_layers_is_made_again_for_a_new_table(pool) -> None:
    attention = PagedAttention()
    queries = _queries(5, 40)
    first, second = torch.tensor(_table(41, 4)), torch.tensor(_table(42, 4))
    attention.attend([_item(pool, first, queries, 50, says_first=True)])
    again = attention.attend([_item(pool, second, queries, 50, says_first=True)])[0]
    fresh = PagedAttention().attend([_item(pool, second, queries, 50, says_first=True)])[0]
    assert torch.equal(again, fresh)


def test_a_table_too_short_for_the_same_spans_is_still_refused(pool) -> None:
    attention = PagedAttention()
    queries = _queries(5, 43)
    attention.attend([_item(pool, _table(44, 4), queries, 50, says_first=True)])
    with pytest.raises(ValueError, match="past the K/V"):
        attention.attend([_item(pool, _table(45, 3), queries, 50, says_first=True)])


MODEL_HEAD_DIMS = (64, 128)
"""Head sizes the kernel compiles as constants (SmolLM2 and Llama-3.2-1B; Llama-3.1-8B): a path
of its own, held to the same promises as the generic one."""


@pytest.fixture(scope="module", params=MODEL_HEAD_DIMS, ids=lambda d: f"head_dim={d}")
def model_pool(request: pytest.FixtureRequest) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's K and V in 64-token pages of a model's head size, random."""
    generator = torch.Generator().manual_seed(request.param)
    shape = (KV_HEADS, 24, 64, request.param)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def test_a_model_head_size_is_within_the_stated_tolerance_of_float64(model_pool) -> None:
    dim = model_pool[0].shape[-1]
    table = [3, 17, 9, 21, 1]
    queries = _queries(70, 30, dim)
    out = PagedAttention().attend([_item(model_pool, table, queries, 250)])[0]
    assert (out.double() - _reference(model_pool, table, queries, 250)).abs().max() < TOLERANCE


def test_a_model_head_size_keeps_a_rows_bits_across_chunks_and_decode(model_pool) -> None:
    dim = model_pool[0].shape[-1]
    table = [5, 2, 23, 11, 7]
    queries = _queries(300, 31, dim)
    one_shot = PagedAttention().attend([_item(model_pool, table, queries, 0)])[0]
    chunked = torch.cat([PagedAttention().attend([_item(model_pool, table, queries[a:b], a)])[0]
                         for a, b in ((0, 7), (7, 130), (130, 299))])
    decode = PagedAttention().attend([_item(model_pool, table, queries[299:], 299,
                                            is_decode=True)])[0]
    assert torch.equal(torch.cat([chunked, decode]), one_shot)


def test_a_model_head_size_has_the_same_bits_from_the_portable_build(model_pool) -> None:
    try:
        portable = PagedKernel.load(portable=True)
    except NativeBuildError as exc:
        pytest.skip(str(exc))
    dim = model_pool[0].shape[-1]
    items = [_item(model_pool, [4, 8, 15, 16][:1 + i], _queries(3 + 40 * i, 32 + i, dim), 20 * i)
             for i in range(4)]
    for expected, got in zip(PagedAttention().attend(items),
                             PagedAttention(portable).attend(items), strict=True):
        assert torch.equal(got, expected)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")))


def test_the_probe_finds_the_forward_invariant_and_decoding_writing_the_prefills_kv(
        tiny) -> None:
    result = probe_invariance(BatchedForward(tiny.model, PagedAttention(), ROWWISE),
                              tiny.layout, VOCAB)
    assert result.is_invariant, result.failure
    assert result.decode_kv_is_prefill_kv


def test_the_cpu_gets_the_paged_attention_in_float32() -> None:
    assert isinstance(attention_for(torch.device("cpu")), PagedAttention)


@pytest.fixture(scope="module")
def other_builds() -> dict[str, PagedKernel]:
    """The kernel built without this CPU's AVX-512 paths and without any vector flags (what a
    CPU without AVX-512, or without AVX2, runs): the same source, other instructions."""
    try:
        return {"AVX2": PagedKernel.load(wide_vectors=False),
                "portable": PagedKernel.load(portable=True)}
    except NativeBuildError as exc:
        pytest.skip(str(exc))


@settings(max_examples=40, deadline=None)
@given(kv_heads=st.integers(1, 3), rep=st.integers(1, 6),
       head_dim=st.sampled_from([8, 16, 24, 32, 48, 64, 72, 128]),
       page=st.sampled_from([8, 16, 64]), lengths=st.lists(st.integers(1, 200), min_size=1,
                                                          max_size=5),
       shared_pages=st.integers(0, 3), window=st.sampled_from([0, 5, 40]),
       softcap=st.sampled_from([0.0, 30.0]), with_sinks=st.booleans(),
       seed=st.integers(0, 2**16))
def test_every_build_computes_the_same_bits(other_builds, kv_heads, rep, head_dim, page,
                                            lengths, shared_pages, window, softcap,
                                            with_sinks, seed) -> None:
    """Whatever the CPU's vector units run (sixteen lanes, eight, or none): the same bits, for
    every head size, grouping of heads, window, soft-cap and sink; decode rows of sequences
    that begin with the same pages (read together) among them."""
    generator = torch.Generator().manual_seed(seed)
    tables: list[list[int]] = []
    items: list[int] = []
    positions: list[int] = []
    next_page = shared_pages
    for index, length in enumerate(lengths):
        count = -(-length // page)
        own = list(range(next_page, next_page + max(count - shared_pages, 0)))
        tables.append(list(range(min(shared_pages, count))) + own)
        next_page += len(own)
        decode = index % 2 == 1  # a lone last row, as a decode step's
        rows = range(length - 1, length) if decode else range(max(0, length - 9), length)
        items += [index] * len(rows)
        positions += rows
    shape = (kv_heads, next_page + 1, page, head_dim)
    keys, values = torch.randn(shape, generator=generator), torch.randn(shape,
                                                                        generator=generator)
    table = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int64)
    for i, ids in enumerate(tables):
        table[i, :len(ids)] = torch.tensor(ids)
    queries = torch.randn(len(items), kv_heads * rep, head_dim, generator=generator) * 3
    sinks = torch.randn(kv_heads * rep, generator=generator) if with_sinks else None
    arguments = (keys, values, table, queries, torch.tensor(items), torch.tensor(positions))
    expected = torch.empty_like(queries)
    PagedKernel.load()(*arguments, expected, window, None, softcap or None, sinks)
    for name, kernel in other_builds.items():
        got = torch.empty_like(queries)
        kernel(*arguments, got, window, None, softcap or None, sinks)
        assert torch.equal(got, expected), name
