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
from gateway.engine.forward.kept_states import StateHome, cache_layout, state_homes
from gateway.engine.forward.recurrent.chunked_scan import ScanStream
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


@settings(max_examples=80, deadline=None)
@given(kernel=st.integers(2, 5), channels=st.integers(1, 70), kv_heads=st.integers(1, 4),
       head_dim=st.integers(1, 24), block=st.integers(1, 8), scan=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**16))
def test_a_state_laid_into_a_blocks_layers_reads_back_with_its_bits(
        kernel: int, channels: int, kv_heads: int, head_dim: int, block: int, scan: bool,
        dtype: torch.dtype, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    window = torch.randn(kernel - 1, channels, generator=generator).to(dtype)
    matrix = torch.randn(2, 3, 5, generator=generator) if scan else None
    layout = KVLayout(num_layers=1, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    numbers = window.numel() + (0 if matrix is None else
                                matrix.numel() * (1 if dtype == torch.float32 else 4))
    slots = -(-numbers // (block * 2 * kv_heads * head_dim))
    home = StateHome((kernel - 1, channels), None if matrix is None else (2, 3, 5),
                     tuple(range(slots)), layout, block)
    state = RecurrentState(ConvWindow(window),
                           None if matrix is None else ScanStream.at(matrix, 0))
    pieces = home.pieces(state)
    assert [piece.layer for piece in pieces] == list(range(slots))
    assert all(piece.keys.shape == (kv_heads, piece.rows, head_dim) for piece in pieces)
    assert all(piece.rows <= block for piece in pieces)
    laid = {piece.layer: piece for piece in pieces}
    back = home.state(lambda layer, rows: (laid[layer].keys[:, :rows],
                                           laid[layer].values[:, :rows]), block)
    assert torch.equal(back.conv.inputs, window)
    if matrix is not None:
        assert back.scan is not None and back.scan.position == block
        assert torch.equal(back.scan.state, matrix)
        # bytes laid as numbers: never a NaN, so a block with a state compares as equal
        assert all(not piece.keys.isnan().any() for piece in pieces)


def test_a_state_larger_than_its_layers_slots_takes_extra_layers_after_the_models(
        lfm2: LoadedModel) -> None:
    config, mixers = lfm2.model.config, {index: "lfm2_conv" for index in CONV_LAYERS}
    homes = state_homes(config, mixers, lfm2.layout, block_tokens=1)
    numbers = homes[0].numbers
    per_layer = 2 * lfm2.layout.kv_heads * lfm2.layout.head_dim
    extra = -(-numbers // per_layer) - 1
    assert extra > 0
    layers = lfm2.layout.num_layers
    assert homes[0].layers == (0, *range(layers, layers + extra))
    assert homes[2].layers == (2, *range(layers + extra, layers + 2 * extra))
    assert cache_layout(config, mixers, lfm2.layout, 1).num_layers == layers + 2 * extra
    assert cache_layout(config, mixers, lfm2.layout, BLOCK) == lfm2.layout  # fits its own


def test_a_blocks_conv_layer_holds_the_window_at_its_end_and_zeros_elsewhere(
        lfm2: LoadedModel, forward: BatchedForward) -> None:
    whole = _sequence(lfm2)
    _run(forward, whole, _tokens(2 * BLOCK + 5))
    first = _sequence(lfm2)
    _run(forward, first, _tokens(BLOCK))  # one block: its slot holds the window at its end
    block = whole.block(0, BLOCK)
    homes = state_homes(lfm2.model.config, {i: "lfm2_conv" for i in CONV_LAYERS}, lfm2.layout,
                        BLOCK)
    for layer in CONV_LAYERS:
        home = homes[layer]
        assert home.layers == (layer,)
        kept = home.state(lambda at, rows: (block.keys[at][:, :rows], block.values[at][:, :rows]),
                          BLOCK).conv.inputs
        held = first.states[layer]
        assert isinstance(held, RecurrentState)
        assert torch.equal(kept, held.conv.inputs)
        assert not block.keys[layer][:, home.rows:].any()
        assert not block.values[layer][:, home.rows:].any()


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


def test_a_model_loaded_for_other_blocks_is_refused_naming_the_setting(
        lfm2: LoadedModel) -> None:
    with pytest.raises(UnservableModel, match=r"the model was loaded for blocks of another size "
                                              r"\(cache.block_tokens\)"):
        refuse_unkept_states(lfm2, block_tokens=1)
    refuse_unkept_states(lfm2, block_tokens=BLOCK)  # its states fit its own layers: no error


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


def test_a_kind_computed_one_sequence_at_a_time_is_not_batched(
        lfm2: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from gateway.engine.forward.recurrent import mixers
    from gateway.engine.forward.recurrent_step import RecurrentLayers

    assert all(kind.mix is not None for kind in mixers.RECURRENT_MIXERS.values())
    alone = dataclasses.replace(mixers.RECURRENT_MIXERS["mamba2"], name="alone", mix=None)
    monkeypatch.setitem(mixers.RECURRENT_MIXERS, "alone", alone)
    with pytest.raises(ValueError, match=r"computed one sequence at a time only: \['alone'\]"):
        RecurrentLayers.of(lfm2.model.config, {0: "alone"}, lfm2.layout)


def test_a_sequence_built_from_blocks_and_a_stateful_tail_goes_on_with_the_cold_bits(
        lfm2: LoadedModel, forward: BatchedForward) -> None:
    """A tail ends inside a block, where no block keeps a state: its states travel with it."""
    from gateway.engine.forward.kept_states import state_bytes
    from gateway.engine.kv.stateful_tail import StatefulTail

    tokens = _tokens(2 * BLOCK + 11, seed=5)
    cold = _sequence(lfm2)
    cold_logits = _run(forward, cold, tokens)
    source = _sequence(lfm2)
    _run(forward, source, tokens[:BLOCK + 6])
    tail = StatefulTail.of(source.span(BLOCK, BLOCK + 6), source.states,
                           state_bytes(source.states))
    assert tail.nbytes == source.span(BLOCK, BLOCK + 6).nbytes + 2 * 2 * 64 * 4  # 2 windows
    warm = KVSequence.from_blocks(source.pool, [source.block(0, BLOCK), tail], 128)
    assert set(warm.states) == set(CONV_LAYERS)
    assert torch.equal(_run(forward, warm, tokens[BLOCK + 6:]), cold_logits)
    for layer in range(lfm2.layout.num_layers):
        assert torch.equal(warm.keys(layer), cold.keys(layer))


def test_extra_layers_no_state_uses_at_a_pools_block_size_hold_zeros(tmp_path: Path) -> None:
    """A model loaded for 16-token blocks has extra layers for its scans' states; in a pool of
    64-token pages (the start-up probe's) its states fit their own layers, and the extra ones
    hold zeros, never what a page held before."""
    from tests.gateway.engine.families.checkpoints import save_qwen3_5

    qwen = load_model(str(save_qwen3_5(tmp_path / "model")), block_tokens=BLOCK)
    model_layers = int(qwen.model.config.num_hidden_layers)
    assert qwen.layout.num_layers > model_layers
    sequence = KVSequence.alone(qwen.layout, 128, page_tokens=64)
    sequence.pool.storage.fill_(float("nan"))
    forward = BatchedForward(qwen.model, TiledAttention(), ROWWISE, qwen.features)
    _run(forward, sequence, _tokens(70, seed=6))
    for layer in range(model_layers, qwen.layout.num_layers):
        assert not sequence.keys(layer).isnan().any() and not sequence.keys(layer).any()
        assert not sequence.values(layer).isnan().any() and not sequence.values(layer).any()
