"""The Triton paged attention: close to exact attention, and a row's bits its own whatever is
launched beside it, however its prompt is chunked and wherever its pages lie
(gateway.engine.attention.triton_paged, docs/gpu.md "The Triton paged attention").

On the CPU the kernel runs in Triton's interpreter (numpy), in a child process where this one
compiles (tests/gateway/engine/triton_interpreter.py); so that it takes seconds, most tests use
``SMALL`` shapes (splits of 32 keys, tiles of 16 keys and 8 query positions) over a few dozen
keys, which cross several splits and tiles. Each kernel test has a CUDA case (marked ``gpu``)
that runs the compiled kernel; ``test_on_cuda_real_head_shapes_keep_every_check`` adds the
default shapes there.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Sequence

import pytest
import torch

from gateway.engine.attention.choice import attention_for
from gateway.engine.attention.tiled import AttentionItem
from gateway.engine.attention.triton_paged import (
    NUMERICS,
    KernelShape,
    TilePlan,
    TritonPagedAttention,
    block_table,
    splits_apart,
    triton_attention_problem,
)
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.parity.route_search import ATTENTIONS, attention_problem
from tests.gateway.engine.triton_interpreter import interpreted, interprets_here
from tiers.page_pool import PagePool
from tiers.payload import KVLayout

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (`make venv` installs it on Linux)",
                allow_module_level=True)

SMALL = TritonPagedAttention(split_keys=32, tile_keys=16, tile_positions=8)
SMALL_SPLITS_APART = TritonPagedAttention(split_keys=32, tile_keys=16, tile_positions=8,
                                          split_parallel=True)
SMALL_SPLITS_TOGETHER = TritonPagedAttention(split_keys=32, tile_keys=16, tile_positions=8,
                                             split_parallel=False)
DEFAULT = TritonPagedAttention()
HEADS, KV_HEADS, DIM = 4, 2, 16  # GQA: two query heads per KV head
PAGE = 8  # a tile of SMALL spans two pages

GPU = pytest.mark.gpu
CASES = [pytest.param("cpu", torch.float32, id="cpu-float32"),
         pytest.param("cuda", torch.float32, marks=GPU, id="cuda-float32"),
         pytest.param("cuda", torch.bfloat16, marks=GPU, id="cuda-bfloat16")]
"""Where a kernel test runs: float32 on the CPU (the interpreter computes bfloat16 products in
float32 anyway), both dtypes compiled on CUDA."""

EVERY_DTYPE = [*CASES, pytest.param("cpu", torch.bfloat16, id="cpu-bfloat16")]

TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 3e-2}
"""Largest difference from float64 attention, for outputs of magnitude up to ~2: float32's
rounding; bfloat16 rounds the output (up to 8e-3 here) and the weights before the value
product."""


def make_sequence(n: int, *, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                  dim: int = DIM) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries ``[n, HEADS, dim]`` and keys, values ``[KV_HEADS, n, dim]`` of one sequence."""
    generator = torch.Generator().manual_seed(seed)
    queries = torch.randn(n, HEADS, dim, generator=generator)
    keys = torch.randn(KV_HEADS, n, dim, generator=generator)
    values = torch.randn(KV_HEADS, n, dim, generator=generator)
    return (queries.to(device, dtype), keys.to(device, dtype), values.to(device, dtype))


def paged(sequences: Sequence[tuple[torch.Tensor, torch.Tensor]],
          page_ids: Sequence[Sequence[int]], *, num_pages: int, page_tokens: int = PAGE,
          junk: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer of a pool holding each sequence's K/V (``[kv_heads, n, head_dim]``) in its
    pages, in order: K and V pages ``[kv_heads, num_pages + 1, page_tokens, head_dim]`` and the
    block table. Page 0 is zero; every other position holds zero, or with ``junk`` large
    finite garbage."""
    keys, _ = sequences[0]
    shape = (keys.shape[0], num_pages + 1, page_tokens, keys.shape[2])
    pools = []
    for kind in range(2):
        pool = keys.new_zeros(shape)
        if junk:
            generator = torch.Generator().manual_seed(99 + kind)
            pool.copy_(torch.randn(shape, generator=generator) * 1000)
            pool[:, 0] = 0
        for sequence, ids in zip(sequences, page_ids, strict=True):
            data = sequence[kind]
            for index, page in enumerate(ids):
                chunk = data[:, index * page_tokens:(index + 1) * page_tokens]
                pool[:, page, :chunk.shape[1]] = chunk
        pools.append(pool)
    return pools[0], pools[1], block_table(page_ids, keys.device)


def attend(attention: TritonPagedAttention, pages: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
           rows: Sequence[tuple[int, torch.Tensor, Sequence[int]]]) -> list[torch.Tensor]:
    """One launch over ``rows``: (sequence index, its queries, their positions) each; the
    attended rows of each, in order."""
    key_pages, value_pages, table = pages
    device = key_pages.device
    queries = torch.cat([q for _, q, _ in rows])
    positions = torch.tensor([p for _, _, ps in rows for p in ps], device=device)
    items = torch.tensor([i for i, q, _ in rows for _ in range(q.shape[0])], dtype=torch.int32,
                         device=device)
    out = attention.attend_paged(queries, key_pages, value_pages, table, positions, items)
    return list(torch.split(out, [q.shape[0] for _, q, _ in rows]))


def reference(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              positions: Sequence[int]) -> torch.Tensor:
    """Attention in float64: each row over the keys up to its position."""
    rep = queries.shape[1] // keys.shape[0]
    out = []
    for row, position in zip(queries.double(), positions, strict=True):
        k = keys[:, :position + 1].double().repeat_interleave(rep, 0)
        v = values[:, :position + 1].double().repeat_interleave(rep, 0)
        weights = torch.softmax(torch.einsum("hd,hkd->hk", row, k) / math.sqrt(row.shape[-1]), -1)
        out.append(torch.einsum("hk,hkd->hd", weights, v))
    return torch.stack(out)


def consecutive(num_tokens: int, first: int = 1, page_tokens: int = PAGE) -> list[int]:
    return list(range(first, first + -(-num_tokens // page_tokens)))


@pytest.mark.parametrize(("device", "dtype"), EVERY_DTYPE)
@pytest.mark.parametrize(("attention", "length", "positions"), [
    (DEFAULT, 600, [0, 63, 64, 511, 512, 599]),
    (SMALL, 120, [0, 15, 16, 31, 32, 77, 119]),
], ids=["default", "small"])
@interpreted
def test_rows_match_float64_attention_within_tolerance(device, dtype, attention, length,
                                                      positions) -> None:
    queries, keys, values = make_sequence(length, seed=1, dtype=dtype, device=device)
    pages = paged([(keys, values)], [consecutive(length)], num_pages=length // PAGE + 1)
    [out] = attend(attention, pages, [(0, queries[positions], positions)])
    expected = reference(queries[positions], keys, values, positions).to(out.device)
    error = float((out.double() - expected).abs().max())
    assert error <= TOLERANCE[dtype]


@pytest.mark.parametrize(("device", "dtype"), CASES)
@interpreted
def test_a_head_dim_that_is_not_a_power_of_two_is_padded_not_cut(device, dtype) -> None:
    positions = [0, 20, 39]
    queries, keys, values = make_sequence(40, seed=9, dtype=dtype, device=device, dim=24)
    pages = paged([(keys, values)], [consecutive(40)], num_pages=5)
    [out] = attend(SMALL, pages, [(0, queries[positions], positions)])
    expected = reference(queries[positions], keys, values, positions).to(out.device)
    assert out.shape == expected.shape
    assert float((out.double() - expected).abs().max()) <= TOLERANCE[dtype]


@pytest.mark.parametrize(("device", "dtype"), CASES)
@interpreted
def test_a_row_alone_equals_it_beside_other_sequences(device, dtype) -> None:
    a, b, c = (make_sequence(n, seed=n, dtype=dtype, device=device) for n in (40, 70, 25))
    pages = paged([(a[1], a[2]), (b[1], b[2]), (c[1], c[2])],
                  [[2, 5, 8, 11, 14], [1, 4, 7, 10, 13, 16, 18, 19, 20], [3, 6, 9, 12]],
                  num_pages=20)
    chunk = (0, a[0][28:40], range(28, 40))
    [alone] = attend(SMALL, pages, [chunk])
    others = [(1, b[0][60:70], range(60, 70)), (2, c[0][24:25], [24])]
    assert torch.equal(attend(SMALL, pages, [*others, chunk])[2], alone)
    assert torch.equal(attend(SMALL, pages, [others[1], chunk, others[0]])[1], alone)


@pytest.mark.parametrize(("device", "dtype"), EVERY_DTYPE)
@interpreted
def test_a_prompt_one_shot_equals_it_in_odd_chunks_and_token_by_token(device, dtype) -> None:
    n = 40
    queries, keys, values = make_sequence(n, seed=2, dtype=dtype, device=device)
    pages = paged([(keys, values)], [consecutive(n)], num_pages=8)
    [one_shot] = attend(SMALL, pages, [(0, queries, range(n))])
    chunks, at = [], 0
    for size in (7, 1, 13, 2, 17):
        chunks += attend(SMALL, pages, [(0, queries[at:at + size], range(at, at + size))])
        at += size
    tokens = [attend(SMALL, pages, [(0, queries[i:i + 1], [i])])[0] for i in range(n)]
    assert torch.equal(torch.cat(chunks), one_shot)
    assert torch.equal(torch.cat(tokens), one_shot)


@pytest.mark.parametrize(("device", "dtype"), CASES)
@interpreted
def test_rows_either_side_of_a_split_boundary_keep_their_bits(device, dtype) -> None:
    n = 100  # splits of 32 keys: boundaries at 32, 64 and 96
    queries, keys, values = make_sequence(n, seed=3, dtype=dtype, device=device)
    pages = paged([(keys, values)], [consecutive(n)], num_pages=13)
    around = [31, 32, 63, 64, 95, 96]
    [together] = attend(SMALL, pages, [(0, queries[around], around)])
    chunks = [attend(SMALL, pages, [(0, queries[s:e], range(s, e))])[0]
              for s, e in ((29, 35), (62, 66), (90, 100))]
    straddling = torch.cat([chunks[0][2:4], chunks[1][1:3], chunks[2][5:7]])
    alone = torch.cat([attend(SMALL, pages, [(0, queries[p:p + 1], [p])])[0] for p in around])
    assert torch.equal(straddling, together)
    assert torch.equal(alone, together)


@pytest.mark.parametrize(("device", "dtype"), CASES)
@interpreted
def test_splits_attended_in_programs_of_their_own_give_the_bits_of_one_program(device,
                                                                              dtype) -> None:
    a, b = (make_sequence(n, seed=n, dtype=dtype, device=device) for n in (100, 45))
    pages = paged([(a[1], a[2]), (b[1], b[2])], [consecutive(100), consecutive(45, first=14)],
                  num_pages=20)
    rows = [(0, a[0][90:100], range(90, 100)), (1, b[0][44:45], [44]), (0, a[0][3:4], [3])]
    apart = attend(SMALL_SPLITS_APART, pages, rows)
    together = attend(SMALL_SPLITS_TOGETHER, pages, rows)
    for split_apart, split_together in zip(apart, together, strict=True):
        assert torch.equal(split_apart, split_together)


@pytest.mark.parametrize(("device", "dtype"), CASES)
@interpreted
def test_scrambled_pages_give_the_bits_of_consecutive_pages(device, dtype) -> None:
    n = 40
    queries, keys, values = make_sequence(n, seed=4, dtype=dtype, device=device)
    rows = [(0, queries[30:], range(30, n))]
    in_order = attend(SMALL, paged([(keys, values)], [[1, 2, 3, 4, 5]], num_pages=16), rows)
    scrambled = attend(SMALL, paged([(keys, values)], [[9, 3, 14, 1, 6]], num_pages=16), rows)
    assert torch.equal(scrambled[0], in_order[0])


@pytest.mark.parametrize(("device", "dtype"), CASES)
@interpreted
def test_the_page_size_does_not_change_a_rows_bits(device, dtype) -> None:
    n = 40
    queries, keys, values = make_sequence(n, seed=5, dtype=dtype, device=device)
    rows = [(0, queries[30:], range(30, n))]
    outs = [attend(SMALL, paged([(keys, values)], [consecutive(n, page_tokens=size)],
                                num_pages=n // size + 1, page_tokens=size), rows)[0]
            for size in (4, 16, 32)]  # smaller than a tile, a tile, larger
    assert torch.equal(outs[1], outs[0])
    assert torch.equal(outs[2], outs[0])


@pytest.mark.parametrize(("device", "dtype"), CASES)
@interpreted
def test_junk_after_a_rows_position_does_not_change_it(device, dtype) -> None:
    n = 40
    queries, keys, values = make_sequence(n, seed=6, dtype=dtype, device=device)
    rows = [(0, queries[20:30], range(20, 30))]
    held = attend(SMALL, paged([(keys, values)], [consecutive(n)], num_pages=8), rows)
    # Only positions up to 29 are written; every later slot of its pages, and every other
    # page, holds large garbage.
    cut = (keys[:, :30], values[:, :30])
    junk = attend(SMALL, paged([cut], [consecutive(n)], num_pages=8, junk=True), rows)
    assert torch.equal(junk[0], held[0])


@pytest.mark.parametrize(("device", "dtype"), CASES)
@interpreted
def test_attend_reads_a_pools_pages_in_place_with_the_bits_of_gathered_buffers(device,
                                                                                dtype) -> None:
    layout = KVLayout(num_layers=1, kv_heads=KV_HEADS, head_dim=DIM, dtype=dtype)
    pool = PagePool(layout, page_tokens=PAGE, num_pages=12, device=device)
    items, gathered, held = [], [], []  # held: a sequence's pages are free once it is gone
    for n, seed in ((20, 7), (35, 8)):
        queries, keys, values = make_sequence(n, seed=seed, dtype=dtype, device=device)
        seq = KVSequence(pool, n)
        held.append(seq)
        seq.write(0, keys, values)
        seq.advance(n)
        positions = torch.arange(n - 4, n, device=device)
        items.append(AttentionItem(queries[n - 4:], seq.layer(0), positions))
        gathered.append(AttentionItem.of(queries[n - 4:], seq.keys(0), seq.values(0),
                                         positions))
    for in_place, copied in zip(SMALL.attend(items), SMALL.attend(gathered), strict=True):
        assert torch.equal(in_place, copied)


def test_numerics_names_the_split_size_and_tile_shape() -> None:
    assert DEFAULT.numerics == NUMERICS == "tri2-s512n64q16+d128n128q32w8"
    assert SMALL.numerics == "tri2-s32n16q8"
    assert SMALL_SPLITS_APART.numerics == SMALL.numerics  # same bits, other launches
    assert CUDA_KERNELS["w8"].numerics == "tri2-s512n64q16w8"


def test_the_default_takes_its_shape_from_the_head_size() -> None:
    assert DEFAULT.shape_for(64) == DEFAULT.shape_for(80) == KernelShape()
    assert DEFAULT.shape_for(128) == KernelShape(tile_positions=32, tile_keys=128, num_warps=8)
    assert SMALL.shape_for(128) == SMALL.shape_for(64)  # a shape given is kept for every size


def test_splits_run_apart_only_for_small_launches_over_several_splits() -> None:
    mib = 1 << 20
    assert splits_apart(num_programs=8, splits=17, scratch_bytes=mib)  # one decode row, 8k
    assert not splits_apart(num_programs=8, splits=1, scratch_bytes=mib)  # nothing to split
    assert not splits_apart(num_programs=4096, splits=17, scratch_bytes=mib)  # a full GPU
    # a 200-row chunk over 32k keys would need 213 MiB of partials: kept in one program
    assert not splits_apart(num_programs=104, splits=64, scratch_bytes=213 * mib)


def test_a_plan_for_other_tiles_is_refused() -> None:
    pages = torch.zeros(1, 2, PAGE, 128)
    plan = TilePlan.of(torch.tensor([0]), torch.tensor([0]), 16, torch.device("cpu"))
    with pytest.raises(ValueError, match="tiles of 16 positions, the kernel 32"):
        DEFAULT.attend_planned(torch.zeros(1, 2, 128), pages, pages, block_table([[1]]), plan)


def test_two_rows_of_a_sequence_at_one_position_are_refused() -> None:
    pages = torch.zeros(1, 2, PAGE, DIM)
    with pytest.raises(ValueError, match="two rows of one sequence at one position"):
        DEFAULT.attend_paged(torch.zeros(2, 2, DIM), pages, pages, block_table([[1]]),
                             torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.int32))


def test_the_plan_puts_each_position_in_the_slot_its_position_names() -> None:
    plan = TilePlan.of(torch.tensor([5, 6, 7, 8, 3]), torch.tensor([0, 0, 0, 0, 1]), 4,
                       torch.device("cpu"))
    assert plan.num_tiles == 3 and plan.last_position == 8
    assert plan.tensor.tolist() == [[0, 8, 3, -1, -1, -1],  # later positions first
                                    [0, 4, -1, 0, 1, 2],
                                    [1, 0, -1, -1, -1, 4]]


def test_without_triton_the_problem_says_so(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "gateway.engine.attention.triton_kernel", raising=False)
    problem = triton_attention_problem(torch.device("cuda"))
    assert problem is not None and problem.startswith("triton is not installed")


def test_on_the_cpu_it_runs_exactly_where_triton_interprets() -> None:
    problem = triton_attention_problem(torch.device("cpu"))
    assert (problem is None) == interprets_here(), problem


@interpreted
def test_the_engine_never_takes_it_on_the_cpu_even_where_triton_interprets() -> None:
    cpu = torch.device("cpu")
    assert "triton" in ATTENTIONS
    assert attention_problem("triton", cpu, torch.float32) is not None
    assert not isinstance(attention_for(cpu), TritonPagedAttention)


@pytest.mark.parametrize(("dtype", "capability", "phase", "sinks", "softcap"),
                         [("bf16", 90, 0, False, False), ("bf16", 90, 1, False, False),
                          ("bf16", 90, 2, False, False), ("fp32", 80, 0, False, False),
                          ("bf16", 90, 0, True, False), ("bf16", 90, 2, True, False),
                          ("bf16", 90, 0, False, True), ("bf16", 90, 1, False, True),
                          ("bf16", 90, 2, True, True)])
def test_the_kernel_compiles_for_cuda(dtype, capability, phase, sinks, softcap) -> None:
    """The compiled path, which the interpreter does not check (types, shapes, globals), down
    to a cubin for an H100 (sm_90) and an A100 (sm_80), without a GPU: every phase (splits in
    one program, apart, folded), with attention sinks and without, with and without a logit
    soft-cap, and with both."""
    if interprets_here():
        pytest.skip("Triton interprets kernels in this process")
    from triton import compile as compile_kernel
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gateway.engine.attention.triton_kernel import kernel

    pointers = {name: f"*{dtype}" for name in ("out_ptr", "q_ptr", "k_ptr", "v_ptr")}
    signature = {**pointers, "table_ptr": "*i32", "plan_ptr": "*i32", "part_ptr": "*fp32",
                 **{name: "i32" for name in ("stride_qr", "stride_qh", "stride_or", "stride_oh",
                                             "stride_kvp", "stride_kvt", "stride_table",
                                             "stride_plan", "stride_pr", "stride_ph",
                                             "stride_ps")},
                 "stride_kvh": "i64", "scale": "fp32", "window": "i32", "softcap": "fp32",
                 "sinks_ptr": "*fp32"}
    constants = {"REP": 3, "REP_PAD": 4, "QPOS": 16, "HEAD_DIM": 64, "BLOCK_D": 64,
                 "TILE_KEYS": 64, "SPLIT_KEYS": 512, "PAGE": 16, "PHASE": phase,
                 "DOT_F32": dtype == "fp32", "SOFTCAP": softcap, "HAS_SINKS": sinks}
    compiled = compile_kernel(ASTSource(kernel(), {**signature, **dict.fromkeys(constants,
                                                                                "constexpr")},
                                        constants), target=GPUTarget("cuda", capability, 32),
                              options={"enable_fp_fusion": False})
    assert compiled.asm["cubin"]
    if dtype == "bf16" and phase != 2:  # the products on the tensor cores
        assert "mma.sync" in compiled.asm["ptx"] or "wgmma" in compiled.asm["ptx"]


CUDA_KERNELS = {"default": DEFAULT,  # its shape for 128-wide heads is q32k128w8's
                "q32w8": TritonPagedAttention(tile_positions=32, num_warps=8),
                "k128": TritonPagedAttention(tile_keys=128),
                "q32k128w8": TritonPagedAttention(tile_positions=32, tile_keys=128, num_warps=8),
                "w8": TritonPagedAttention(num_warps=8)}
"""The default and the shapes and launch options it was chosen among
(``python -m gateway.bench.attention_kernels --variant``): each keeps every check on a GPU."""


@GPU
@pytest.mark.parametrize("kernel", CUDA_KERNELS.values(), ids=CUDA_KERNELS.keys())
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (32, 8, 64), (32, 8, 128)],
                         ids=["smollm2", "llama-1b", "llama-8b"])
def test_on_cuda_real_head_shapes_keep_every_check(heads, kv_heads, dim, kernel) -> None:
    """Each kernel compiled, in bfloat16, with three models' head shapes over 1,300 keys
    (three splits): exact to bfloat16's tolerance, and one-shot, odd chunks, token by token
    (its splits in programs of their own), beside another sequence and over scrambled pages
    all bit for bit the same."""
    n, page_tokens = 1300, 16
    generator = torch.Generator().manual_seed(10)
    queries, other_queries = (torch.randn(n, heads, dim, generator=generator)
                              .to("cuda", torch.bfloat16) for _ in range(2))
    keys, values, other_keys, other_values = (torch.randn(kv_heads, n, dim, generator=generator)
                                              .to("cuda", torch.bfloat16) for _ in range(4))
    num = -(-n // page_tokens)
    order = (torch.randperm(2 * num, generator=generator) + 1).tolist()  # scrambled pages
    key_pages, value_pages, table = paged([(keys, values), (other_keys, other_values)],
                                          [order[:num], order[num:]], num_pages=2 * num,
                                          page_tokens=page_tokens)

    def run(rows: Sequence[tuple[int, torch.Tensor, Sequence[int]]]) -> list[torch.Tensor]:
        return attend(kernel, (key_pages, value_pages, table), rows)

    [one_shot] = run([(0, queries, range(n))])
    chunks, at = [], 0
    for size in (300, 1, 211, 37, 512, 239):
        chunks += run([(0, queries[at:at + size], range(at, at + size))])
        at += size
    tokens = torch.cat([run([(0, queries[i:i + 1], [i])])[0] for i in range(n)])
    beside = run([(1, other_queries, range(n)), (0, queries, range(n))])[1]
    checked = [0, 511, 512, 1023, 1024, n - 1]
    expected = reference(queries[checked], keys, values, checked).cuda()
    error = float((one_shot[checked].double() - expected).abs().max())
    assert error <= TOLERANCE[torch.bfloat16]
    assert torch.equal(torch.cat(chunks), one_shot)
    assert torch.equal(tokens, one_shot)
    assert torch.equal(beside, one_shot)
