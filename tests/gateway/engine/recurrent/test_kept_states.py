"""Recurrent layers' states kept in their blocks (``gateway.engine.forward.kept_states``) and run in
the batched forward (``gateway.engine.forward.recurrent_step``), on a tiny LFM2: a block holds
its conv layers' windows at its end and nothing else there, a sequence resumes from a block's
kept state with the bits it had, and what cannot be kept is refused in one line."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.engine.attention.tiled import TiledAttention
from gateway.engine.forward.batched import BatchedForward, SequenceRows
from gateway.engine.forward.kept_states import StateRows, state_problem, state_rows
from gateway.engine.forward.recurrent.layer_state import RecurrentState
from gateway.engine.forward.recurrent.short_conv import ConvWindow
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.models.loading import (
    LoadedModel,
    UnservableModel,
    load_model,
    refuse_unkept_states,
)
from tests.gateway.engine.families.checkpoints import save_lfm2
from tests.gateway.engine.kernels import ROWWISE
from tiers.payload import KVLayout

BLOCK = 16
CONV_LAYERS = (0, 2)  # save_lfm2's: conv, attention, conv


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_lfm2(tmp_path_factory.mktemp("lfm2") / "model")))


@pytest.fixture(scope="module")
def forward(lfm2: LoadedModel) -> BatchedForward:
    return BatchedForward(lfm2.model, TiledAttention(), ROWWISE, lfm2.features)


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    rng = random.Random(seed)
    return torch.tensor([rng.randrange(400) for _ in range(n)])


def _sequence(lfm2: LoadedModel, capacity: int = 128) -> KVSequence:
    return KVSequence.alone(lfm2.layout, capacity, page_tokens=BLOCK)


def _run(forward: BatchedForward, sequence: KVSequence, tokens: torch.Tensor) -> torch.Tensor:
    logits = forward.forward([SequenceRows(sequence=sequence, tokens=tokens,
                                           wants_logits=True)])[0]
    assert logits is not None
    return logits


@settings(max_examples=60, deadline=None)
@given(kernel=st.integers(2, 5), channels=st.integers(1, 70), kv_heads=st.integers(1, 4),
       head_dim=st.integers(1, 24), bfloat16=st.booleans(), seed=st.integers(0, 2**16))
def test_a_state_laid_into_a_blocks_positions_reads_back_with_its_bits(
        kernel: int, channels: int, kv_heads: int, head_dim: int, bfloat16: bool,
        seed: int) -> None:
    dtype = torch.bfloat16 if bfloat16 else torch.float32
    layout = KVLayout(num_layers=1, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    rows = StateRows((kernel - 1, channels), layout)
    window = torch.randn(kernel - 1, channels,
                         generator=torch.Generator().manual_seed(seed)).to(dtype)
    keys, values = rows.keys_values(RecurrentState(ConvWindow(window)))
    assert keys.shape == values.shape == (kv_heads, rows.rows, head_dim)
    assert torch.equal(rows.state(keys, values).conv.inputs, window)


def test_a_blocks_conv_layer_holds_the_window_at_its_end_and_zeros_elsewhere(
        lfm2: LoadedModel, forward: BatchedForward) -> None:
    whole = _sequence(lfm2)
    _run(forward, whole, _tokens(2 * BLOCK + 5))
    first = _sequence(lfm2)
    _run(forward, first, _tokens(BLOCK))  # one block: its slot holds the window at its end
    block = whole.block(0, BLOCK)
    for layer in CONV_LAYERS:
        rows = state_rows(lfm2.model.config, "lfm2_conv", lfm2.layout)
        kept = rows.state(block.keys[layer], block.values[layer]).conv.inputs
        held = first.states[layer]
        assert isinstance(held, RecurrentState)
        assert torch.equal(kept, held.conv.inputs)
        assert not block.keys[layer][:, rows.rows:].any()
        assert not block.values[layer][:, rows.rows:].any()


def test_a_sequence_built_from_blocks_goes_on_with_the_cold_bits(
        lfm2: LoadedModel, forward: BatchedForward) -> None:
    tokens = _tokens(3 * BLOCK + 7, seed=1)
    cold = _sequence(lfm2)
    cold_logits = _run(forward, cold, tokens)
    source = _sequence(lfm2)
    _run(forward, source, tokens[:2 * BLOCK])
    blocks = [source.block(i, BLOCK) for i in range(2)]
    warm = KVSequence.from_blocks(source.pool, blocks, 128)
    assert warm.states == {}  # read from the last block
    assert torch.equal(_run(forward, warm, tokens[2 * BLOCK:]), cold_logits)
    for layer in range(lfm2.layout.num_layers):
        assert torch.equal(warm.keys(layer), cold.keys(layer))
        assert torch.equal(warm.values(layer), cold.values(layer))


def test_a_sequence_truncated_to_a_block_end_recomputes_the_same_bits(
        lfm2: LoadedModel, forward: BatchedForward) -> None:
    tokens = _tokens(2 * BLOCK + 9, seed=2)
    sequence = _sequence(lfm2)
    first = _run(forward, sequence, tokens)
    sequence.truncate(BLOCK)
    assert sequence.states == {}
    assert torch.equal(_run(forward, sequence, tokens[BLOCK:]), first)


def test_a_state_neither_held_nor_at_a_block_end_fails_loudly(
        lfm2: LoadedModel, forward: BatchedForward) -> None:
    source = _sequence(lfm2)
    _run(forward, source, _tokens(BLOCK + 4, seed=3))
    partial = KVSequence.from_blocks(source.pool, [source.span(0, BLOCK + 4)], 64)
    with pytest.raises(RuntimeError, match="state at position 20 is neither held nor kept"):
        _run(forward, partial, _tokens(1, seed=4))


def test_a_state_larger_than_a_block_is_refused_naming_the_setting(lfm2: LoadedModel) -> None:
    with pytest.raises(UnservableModel, match=r"needs 2 positions of a block, and blocks hold 1: "
                                              r"raise cache.block_tokens"):
        refuse_unkept_states(lfm2, block_tokens=1)
    refuse_unkept_states(lfm2, block_tokens=BLOCK)  # fits: no error


def test_a_scans_state_is_not_kept_in_pages(lfm2: LoadedModel) -> None:
    problem = state_problem(lfm2.model.config, {1: "gated_deltanet"}, lfm2.layout, BLOCK)
    assert problem is not None and problem.startswith(
        "layer 1: the state of a gated_deltanet layer is not kept in a block's pages")


def test_the_start_up_probe_passes_a_model_with_kept_states(lfm2: LoadedModel,
                                                          forward: BatchedForward) -> None:
    from gateway.engine.parity.probe import probe_invariance

    result = probe_invariance(forward, lfm2.layout, int(lfm2.model.config.vocab_size))
    assert result.is_invariant, result.failure
    assert result.decode_kv_is_prefill_kv


def test_lfm2_is_served_not_refused_at_the_door(tmp_path: Path) -> None:
    from gateway.engine.models.refusals import unservable_reason

    assert unservable_reason(save_lfm2(tmp_path / "model")) is None


def test_the_serial_route_is_refused_for_a_model_with_kept_states(lfm2: LoadedModel) -> None:
    from gateway.engine.parity.route_search import RouteVerdict, build_forward

    with pytest.raises(UnservableModel, match=r"states are kept on the batched route only "
                                              r"\(configured \(route = serial\)\)"):
        build_forward(lfm2, RouteVerdict(name="serial", reason="configured (route = serial)"))


def test_a_kind_computed_one_sequence_at_a_time_is_not_batched(lfm2: LoadedModel) -> None:
    from gateway.engine.forward.recurrent_step import RecurrentLayers

    with pytest.raises(ValueError, match=r"computed one sequence at a time only: "
                                         r"\['gated_deltanet'\]"):
        RecurrentLayers.of(lfm2.model.config, {0: "gated_deltanet"}, lfm2.layout)


def test_a_sequence_built_from_blocks_and_a_stateful_tail_goes_on_with_the_cold_bits(
        lfm2: LoadedModel, forward: BatchedForward) -> None:
    """A tail ends inside a block, where no block keeps a state: its states travel with it."""
    from gateway.engine.forward.kept_states import window_bytes
    from gateway.engine.kv.stateful_tail import StatefulTail

    tokens = _tokens(2 * BLOCK + 11, seed=5)
    cold = _sequence(lfm2)
    cold_logits = _run(forward, cold, tokens)
    source = _sequence(lfm2)
    _run(forward, source, tokens[:BLOCK + 6])
    tail = StatefulTail.of(source.span(BLOCK, BLOCK + 6), source.states,
                           window_bytes(source.states))
    assert tail.nbytes == source.span(BLOCK, BLOCK + 6).nbytes + 2 * 2 * 64 * 4  # 2 windows
    warm = KVSequence.from_blocks(source.pool, [source.block(0, BLOCK), tail], 128)
    assert set(warm.states) == set(CONV_LAYERS)
    assert torch.equal(_run(forward, warm, tokens[BLOCK + 6:]), cold_logits)
    for layer in range(lfm2.layout.num_layers):
        assert torch.equal(warm.keys(layer), cold.keys(layer))
