"""Steps from static buffers (CUDA graphs on a GPU) compute the eager forward's bits
(gateway.engine.forward.captured_steps, docs/gpu.md "Captured steps").

Two copies of the same sequences take the same steps (decode rows, questions, chunks), one
through the eager ``BatchedForward``, the other through ``CapturedSteps``; logits and K/V must
be equal bit for bit (``torch.equal``). On the CPU the Triton kernel runs in its interpreter
(a child process: tests/gateway/engine/triton_interpreter.py) and the buckets run from their
buffers without a graph; the CUDA case (marked ``gpu``) captures and replays real graphs. The
products are ``rowwise`` under a padding of 4 (invariant on any machine, and a step of 3 or 5
rows is padded as on a GPU), so the buckets here are 4, 8, 12 and 20 rows.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from gateway.core.canonical import PromptInput
from gateway.engine.attention.tiled import TiledAttention
from gateway.engine.attention.triton_paged import TritonPagedAttention
from gateway.engine.engine import Engine
from gateway.engine.forward.batched import BatchedForward, SequenceRows
from gateway.engine.forward.captured_steps import (
    CHECKED_STEPS,
    CapturedSteps,
    StepBucket,
    captured_steps_problem,
)
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.linear.row_padding import RowPadding
from gateway.engine.linear.row_products import RowProducts
from gateway.engine.models.loading import LoadedModel, load_model
from tests.gateway.engine.kernels import rowwise
from tests.gateway.engine.parity import PROMPT_BY_ID, make_engine, run
from tests.gateway.engine.triton_interpreter import interpreted
from tests.tiny_llama import VOCAB, save_tiny_llama
from tiers.page_pool import PagePool

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (`make venv` installs it on Linux)",
                allow_module_level=True)

PRODUCTS = RowProducts(kernel="onednn", padding=RowPadding(minimum=4, multiple=4),
                       shares_decode_rows=True, product_override=rowwise)
PAGE = 16
MAX_POSITIONS = 256
PROMPTS = [21, 40, 7, 33, 16]
"""Prompt lengths: pages part filled and exactly filled, so decoding crosses page ends."""

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")))


def _forward(tiny: LoadedModel, device: str) -> BatchedForward:
    return BatchedForward(tiny.model.to(device), TritonPagedAttention(), PRODUCTS)


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _prefilled(forward: BatchedForward, tiny: LoadedModel, device: str
               ) -> tuple[PagePool, list[KVSequence]]:
    pool = PagePool(tiny.layout, page_tokens=PAGE, num_pages=96, device=device)
    sequences = []
    for i, n in enumerate(PROMPTS):
        seq = KVSequence(pool, n + 24)
        forward.forward([SequenceRows(sequence=seq, tokens=_tokens(n, i), wants_logits=False)])
        sequences.append(seq)
    return pool, sequences


def _decode_step(sequences: list[KVSequence], which: list[int], step: int
                 ) -> list[SequenceRows]:
    return [SequenceRows(sequence=sequences[i], tokens=_tokens(1, 100 * step + i),
                         wants_logits=True, is_decode=True) for i in which]


Entry = tuple[int, int, bool]
"""(sequence, tokens, wants logits) of a step: one token wanting logits is a decode row."""

STEPS: list[list[Entry]] = [
    [(0, 1, True), (1, 1, True), (2, 1, True)],
    [(0, 1, True), (1, 1, True), (2, 1, True), (3, 1, True), (4, 1, True)],
    [(1, 1, True), (3, 7, True), (4, 1, True)],
    [(2, 5, False)],
    [(0, 1, True), (1, 1, True), (2, 1, True), (3, 1, True), (4, 1, True)],
    [(2, 1, True), (0, 1, True), (3, 1, True)],
    [(4, 17, True), (0, 1, True)],
]
"""Steps of decode rows (buckets of 4 and 8 rows), a warm question's prefill beside decode
rows (9 rows: 12), a chunk that wants no logits, rows that were real in a bucket's last step
padding in its next, an order that is not the sequences', a chunk crossing tiles and pages."""


def _step(sequences: list[KVSequence], entries: list[Entry], step: int) -> list[SequenceRows]:
    return [SequenceRows(sequence=sequences[i], tokens=_tokens(n, 100 * step + i),
                         wants_logits=wants, is_decode=n == 1 and wants)
            for i, n, wants in entries]


@pytest.mark.parametrize("checked_steps", [0, CHECKED_STEPS], ids=["unchecked", "checked"])
@pytest.mark.parametrize("device", DEVICES)
@interpreted
def test_a_captured_step_gives_the_eager_forwards_logits_and_kv(tiny, device,
                                                                 checked_steps) -> None:
    forward = _forward(tiny, device)
    _, eager_sequences = _prefilled(forward, tiny, device)
    pool, captured_sequences = _prefilled(forward, tiny, device)
    captured = CapturedSteps(forward, pool, max_rows=20, max_positions=MAX_POSITIONS,
                             capture=device == "cuda", checked_steps=checked_steps)
    for step, entries in enumerate(STEPS):
        expected = forward.forward(_step(eager_sequences, entries, step))
        got = captured.forward(_step(captured_sequences, entries, step))
        assert [logits is None for logits in got] == [not wants for _, _, wants in entries]
        for want, have in zip(expected, got, strict=True):
            assert (want is None) == (have is None)
            assert want is None or have is None or torch.equal(want, have)
    for a, b in zip(eager_sequences, captured_sequences, strict=True):
        assert a.length == b.length
        for layer in range(tiny.layout.num_layers):
            assert torch.equal(a.keys(layer), b.keys(layer))
            assert torch.equal(a.values(layer), b.values(layer))
    counters = captured.counters
    assert counters.disabled_because is None
    # Five buckets: (4, 4) and (8, 8) take two steps each, (12, 4), (8, 0) and (20, 4) one.
    if checked_steps:  # every step checked inside, the two buckets of two steps verified
        assert (counters.verified, counters.eager, counters.replayed) == (2, 7, 0)
    else:  # every step served by its bucket (and compared above)
        assert (counters.verified, counters.eager, counters.replayed) == (5, 0, 7)
    if device == "cuda":
        assert counters.captured == 5
        assert counters.capture_failures == 0


def _off_by_one_ulp(step: Callable[[StepBucket], torch.Tensor | None]
                    ) -> Callable[[StepBucket], torch.Tensor | None]:
    """A bucket's step whose logits are one ulp off."""
    def run(bucket: StepBucket) -> torch.Tensor | None:
        logits = step(bucket)
        return None if logits is None else torch.nextafter(logits, logits + 1)
    return run


def _kv_one_ulp_off(step: Callable[[StepBucket], torch.Tensor | None]
                    ) -> Callable[[StepBucket], torch.Tensor | None]:
    """A bucket's step that leaves the K/V it wrote one ulp off (its logits right)."""
    def run(bucket: StepBucket) -> torch.Tensor | None:
        logits = step(bucket)
        keys = bucket._pool.storage[0, 0].flatten(1, 2)  # layer 0's K, [kv_heads, slots, d]
        rows = bucket._slots
        keys[:, rows] = torch.nextafter(keys[:, rows], keys[:, rows] + 1)
        return logits
    return run


@pytest.mark.parametrize(("fault", "entries"), [
    (_off_by_one_ulp, [(0, 1, True), (1, 1, True), (2, 1, True)]),
    (_kv_one_ulp_off, [(2, 5, False)]),
], ids=["logits", "kv-of-a-chunk-wanting-no-logits"])
@interpreted
def test_a_bucket_whose_first_step_differs_turns_captured_steps_off(tiny, monkeypatch, caplog,
                                                                     fault, entries) -> None:
    forward = _forward(tiny, "cpu")
    _, eager_sequences = _prefilled(forward, tiny, "cpu")
    pool, captured_sequences = _prefilled(forward, tiny, "cpu")
    captured = CapturedSteps(forward, pool, max_rows=8, max_positions=MAX_POSITIONS,
                             capture=False)
    monkeypatch.setattr(StepBucket, "_step", fault(StepBucket._step))
    for step in range(2):
        expected = forward.forward(_step(eager_sequences, entries, step))
        got = captured.forward(_step(captured_sequences, entries, step))
        assert all((a is None) == (b is None) and (a is None or b is None or torch.equal(a, b))
                   for a, b in zip(expected, got, strict=True))
    for a, b in zip(eager_sequences, captured_sequences, strict=True):
        assert torch.equal(a.keys(0), b.keys(0))  # the eager forward's K/V in the end
    assert captured.counters.disabled_because is not None
    assert (captured.counters.eager, captured.counters.replayed) == (2, 0)
    assert "captured steps turned off" in caplog.text


@interpreted
def test_a_captured_step_writes_only_its_rows_slots_and_the_scratch_pages(tiny) -> None:
    forward = _forward(tiny, "cpu")
    pool, sequences = _prefilled(forward, tiny, "cpu")
    captured = CapturedSteps(forward, pool, max_rows=8, max_positions=MAX_POSITIONS,
                             capture=False)
    scratch = set(captured.scratch_page_ids)
    assert scratch.isdisjoint(page for seq in sequences for page in seq.page_ids)
    before = pool.storage.clone()
    captured.forward(_decode_step(sequences, [0, 2], 0))  # two rows padded to four
    # Bits, not values: pages never written hold whatever the allocator left, NaN included.
    moved = pool.storage.view(torch.int32) != before.view(torch.int32)
    changed = moved.flatten(0, 2).any(dim=3).any(dim=0)  # [pages, tokens]
    written = {(page, token) for page, token in changed.nonzero().tolist()}
    rows = {(seq.page_ids[(seq.length - 1) // PAGE], (seq.length - 1) % PAGE)
            for seq in (sequences[0], sequences[2])}
    assert {(page, token) for page, token in written if page not in scratch} == rows
    assert any(page in scratch for page, _ in written)  # the padding rows went there


@interpreted
def test_steps_it_does_not_cover_run_on_the_eager_forward(tiny) -> None:
    forward = _forward(tiny, "cpu")
    pool, sequences = _prefilled(forward, tiny, "cpu")
    captured = CapturedSteps(forward, pool, max_rows=4, max_positions=PROMPTS[1] + 1,
                             capture=False)
    other_pool_seq = KVSequence.alone(tiny.layout, 8, page_tokens=PAGE)
    another_pool = [SequenceRows(sequence=other_pool_seq, tokens=_tokens(1, 8),
                                 wants_logits=True, is_decode=True)]
    too_many_rows = _step(sequences, [(0, 5, True)], 1)
    captured.forward(another_pool)
    captured.forward(too_many_rows)
    captured.forward(_decode_step(sequences, [1], 2))  # position 40: the last in reach
    captured.forward(_decode_step(sequences, [1], 3))  # position 41: past it
    captured.forward(_decode_step(sequences, [0], 4))  # the bucket's second step, checked
    captured.forward(_decode_step(sequences, [0], 5))  # served by the bucket
    assert captured.counters.verified == 1
    assert captured.counters.eager == 5  # three out of reach, the bucket's two checked
    assert captured.counters.replayed == 1


def test_only_the_triton_attention_with_shared_decode_rows_on_cuda_is_captured(tiny) -> None:
    cuda = torch.device("cuda")
    triton_forward = BatchedForward(tiny.model, TritonPagedAttention(), PRODUCTS)
    assert captured_steps_problem(triton_forward, cuda) is None
    assert "CUDA graphs" in str(captured_steps_problem(triton_forward, torch.device("cpu")))
    tiled = BatchedForward(tiny.model, TiledAttention(), PRODUCTS)
    assert "TiledAttention" in str(captured_steps_problem(tiled, cuda))
    alone = RowProducts(kernel="blas", padding=RowPadding(minimum=4, multiple=4),
                        shares_decode_rows=False, product_override=rowwise)
    blas = BatchedForward(tiny.model, TritonPagedAttention(), alone)
    assert "each decode row alone" in str(captured_steps_problem(blas, cuda))
    assert "serial" in str(captured_steps_problem(object(), cuda))


def _answers(engine: Engine, prompts: list[PromptInput]) -> list[list[int]]:
    """The greedy token ids of ``prompts``, generated side by side (decode steps of several
    rows)."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return [ids for ids, _, _ in pool.map(lambda prompt: run(engine, prompt), prompts)]


PROMPTS_BY_USER = [PROMPT_BY_ID[name] for name in ("over-4-blocks", "shorter-than-a-block-text",
                                                   "repeated-sentence")]


def test_an_engine_asked_to_capture_steps_on_the_cpu_says_why_and_runs_them_eagerly(
        tiny, caplog) -> None:
    caplog.set_level(logging.INFO, logger="gateway.engine.engine")
    engine = make_engine(tiny, None, captured_steps=True)
    try:
        assert engine.captured_steps is None
        said = [r for r in caplog.records if "steps run uncaptured here" in r.getMessage()]
        assert [r.levelno for r in said] == [logging.INFO]  # on by default: no warning on a CPU
        assert _answers(engine, PROMPTS_BY_USER)[0]
    finally:
        engine.stop(grace_s=5)


@pytest.mark.gpu
def test_on_cuda_an_engine_with_captured_steps_answers_as_one_without(tmp_path) -> None:
    on_gpu = load_model(str(save_tiny_llama(tmp_path / "model")), device="cuda")
    answers = []
    for captured in (False, True):
        engine = make_engine(on_gpu, None, captured_steps=captured)
        try:
            answers.append(_answers(engine, PROMPTS_BY_USER))
            if captured:
                counters = engine.captured_steps
                assert counters is not None and counters.replayed > 0
                assert counters.disabled_because is None
                assert counters.capture_failures == 0
        finally:
            engine.stop(grace_s=5)
    assert answers[0] == answers[1]
