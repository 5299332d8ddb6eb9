"""The recurrent rules' chunked scan (``gateway.engine.forward.recurrent.chunked_scan``): the
same bits however a sequence's tokens arrive -- one prompt, steps of any size, one token at a
time, or resumed from the state kept at a chunk's end -- for the gated delta rule and the
decayed linear rule, and the numbers of the rule computed a token at a time (transformers' for
the delta rule, a plain loop for the linear one)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from gateway.engine.forward.recurrent.chunked_scan import (
    ScanInputs,
    ScanStream,
    scan_rows,
    scan_step,
    stacking_is_exact,
)

HEADS, KEY_DIM, VALUE_DIM = 2, 8, 6


def inputs(num_tokens: int, seed: int) -> ScanInputs:
    g = torch.Generator().manual_seed(seed)

    def unit(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=g)
        return x / x.norm(dim=-1, keepdim=True)

    return ScanInputs(
        queries=unit(num_tokens, HEADS, KEY_DIM) * KEY_DIM ** -0.5,
        keys=unit(num_tokens, HEADS, KEY_DIM),
        values=torch.randn(num_tokens, HEADS, VALUE_DIM, generator=g),
        decays=torch.nn.functional.logsigmoid(torch.randn(num_tokens, HEADS, generator=g) + 2),
        betas=torch.sigmoid(torch.randn(num_tokens, HEADS, generator=g)))


def in_steps(stream: ScanStream, tokens: ScanInputs, sizes: list[int], chunk: int,
             delta: bool) -> tuple[torch.Tensor, ScanStream, dict[int, torch.Tensor]]:
    outputs: list[torch.Tensor] = []
    states: dict[int, torch.Tensor] = {}
    at = 0
    for size in sizes:
        step = scan_step(stream, tokens.rows(at, at + size), chunk, delta=delta)
        outputs.append(step.outputs)
        states.update(step.states)
        stream, at = step.stream, at + size
    return torch.cat(outputs), stream, states


def splits(total: int) -> st.SearchStrategy[list[int]]:
    """Step sizes that add up to ``total`` (each at least one token)."""
    return st.lists(st.integers(1, total), min_size=1, max_size=total).map(
        lambda cuts: _sizes(total, cuts))


def _sizes(total: int, cuts: list[int]) -> list[int]:
    points = sorted({0, total, *(c % total for c in cuts)})
    return [b - a for a, b in zip(points, points[1:], strict=False)]


def start() -> ScanStream:
    return ScanStream.start(HEADS, KEY_DIM, VALUE_DIM)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40).flatmap(lambda n: st.tuples(st.just(n), splits(n))),
       st.sampled_from([1, 2, 4, 8]), st.integers(0, 2**16), st.booleans())
def test_steps_of_any_size_give_the_bits_of_one_prompt(
        case: tuple[int, list[int]], chunk: int, seed: int, delta: bool) -> None:
    n, sizes = case
    tokens = inputs(n, seed)
    whole = scan_step(start(), tokens, chunk, delta=delta)
    outputs, stream, states = in_steps(start(), tokens, sizes, chunk, delta)
    assert torch.equal(outputs, whole.outputs)
    assert torch.equal(stream.state, whole.stream.state)
    assert stream.position == whole.stream.position == n - n % chunk
    assert states.keys() == dict(whole.states).keys()
    assert all(torch.equal(states[p], s) for p, s in whole.states)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(1, 5), st.integers(0, 2**16), st.booleans())
def test_one_token_at_a_time_gives_the_bits_of_one_prompt(n: int, chunk_log: int,
                                                          seed: int, delta: bool) -> None:
    chunk = 2 ** (chunk_log - 1)
    tokens = inputs(n, seed)
    outputs, stream, _ = in_steps(start(), tokens, [1] * n, chunk, delta)
    whole = scan_step(start(), tokens, chunk, delta=delta)
    assert torch.equal(outputs, whole.outputs)
    assert torch.equal(stream.state, whole.stream.state)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 40), st.sampled_from([1, 2, 4, 8]), st.integers(0, 2**16),
       st.booleans(), st.data())
def test_a_stream_resumed_from_a_kept_state_continues_with_the_same_bits(
        n: int, chunk: int, seed: int, delta: bool, data: st.DataObject) -> None:
    tokens = inputs(n, seed)
    whole = scan_step(start(), tokens, chunk, delta=delta)
    kept = [(p, s) for p, s in whole.states if p < n]
    if not kept:
        return
    position, state = data.draw(st.sampled_from(kept))
    resumed = scan_step(ScanStream.at(state.clone(), position),
                         tokens.rows(position, n), chunk, delta=delta)
    assert torch.equal(resumed.outputs, whole.outputs[position:])
    assert torch.equal(resumed.stream.state, whole.stream.state)


def test_the_delta_rule_is_the_one_transformers_computes_token_by_token_and_in_chunks() -> None:
    tokens = inputs(37, seed=7)
    ours = scan_step(start(), tokens, chunk=8, delta=True)
    batched = [x.unsqueeze(0) for x in (tokens.queries, tokens.keys, tokens.values,
                                        tokens.decays, tokens.betas)]
    # transformers scales the queries itself: hand it the unscaled ones
    batched[0] = batched[0] * KEY_DIM ** 0.5
    reference, final = torch_recurrent_gated_delta_rule(*batched, output_final_state=True)
    chunked, _ = torch_chunk_gated_delta_rule(*batched, chunk_size=8, output_final_state=True)
    whole_state = scan_step(start(), tokens.rows(0, 32), chunk=8, delta=True).stream.state
    assert torch.allclose(ours.outputs, reference[0], atol=1e-5, rtol=1e-4)
    assert torch.allclose(ours.outputs, chunked[0], atol=1e-5, rtol=1e-4)
    _, at_32 = torch_recurrent_gated_delta_rule(*(x[:, :32] for x in batched),
                                                output_final_state=True)
    assert at_32 is not None and final is not None
    assert torch.allclose(whole_state, at_32[0], atol=1e-5, rtol=1e-4)


def test_a_stream_that_does_not_start_a_chunk_is_refused() -> None:
    stream = ScanStream.at(torch.zeros(HEADS, KEY_DIM, VALUE_DIM), position=3)
    try:
        scan_step(stream, inputs(1, 0), chunk=4, delta=True)
    except ValueError as exc:
        assert str(exc) == "a stream at 3 does not start a chunk of 4"
    else:
        raise AssertionError("a misaligned stream was advanced")


def test_the_decayed_linear_rule_is_a_decay_then_a_write_then_a_read_per_token() -> None:
    tokens = inputs(29, seed=11)
    ours = scan_step(start(), tokens, chunk=4, delta=False)
    state = torch.zeros(HEADS, KEY_DIM, VALUE_DIM, dtype=torch.float64)
    expected = []
    for t in range(29):
        q, k, v = (x[t].double() for x in (tokens.queries, tokens.keys, tokens.values))
        state = (state * tokens.decays[t].double().exp()[:, None, None]
                 + k.unsqueeze(-1) * v.unsqueeze(-2))
        expected.append((q.unsqueeze(-2) @ state).squeeze(-2))
    assert torch.allclose(ours.outputs.double(), torch.stack(expected), atol=1e-5, rtol=1e-4)
    at_28 = scan_step(start(), tokens.rows(0, 28), chunk=4, delta=False).stream.state
    state_28 = torch.zeros_like(state)
    for t in range(28):
        k, v = tokens.keys[t].double(), tokens.values[t].double()
        state_28 = (state_28 * tokens.decays[t].double().exp()[:, None, None]
                    + k.unsqueeze(-1) * v.unsqueeze(-2))
    assert torch.allclose(at_28.double(), state_28, atol=1e-5, rtol=1e-4)


def streams_of(waiting: list[int], chunk: int, seed: int, delta: bool) -> list[ScanStream]:
    """Streams that have seen ``waiting[i]`` tokens each (from a made-up earlier state)."""
    made = []
    for i, count in enumerate(waiting):
        g = torch.Generator().manual_seed(seed + i)
        stream = ScanStream.at(torch.randn(HEADS, KEY_DIM, VALUE_DIM, generator=g) / 4, 0)
        if count:
            stream = scan_step(stream, inputs(count, seed + 100 + i), chunk, delta=delta).stream
        made.append(stream)
    return made


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.lists(st.integers(0, 20), min_size=1, max_size=6),
       st.integers(0, 2**16), st.booleans())
def test_a_token_for_each_of_several_streams_at_once_gives_each_the_bits_of_its_own_step(
        chunk: int, waiting: list[int], seed: int, delta: bool) -> None:
    if not stacking_is_exact(HEADS, KEY_DIM, VALUE_DIM, chunk, delta=delta):
        pytest.skip("stacked scans do not keep their bits on this machine (so none stacks)")
    streams = streams_of(waiting, chunk, seed, delta)
    new = inputs(len(streams), seed + 1)
    outputs, after = scan_rows(streams, new, chunk, delta=delta)
    for i, stream in enumerate(streams):
        alone = scan_step(stream, new.rows(i, i + 1), chunk, delta=delta)
        assert torch.equal(outputs[i], alone.outputs[0])
        assert torch.equal(after[i].state, alone.stream.state)
        assert after[i].position == alone.stream.position
        assert torch.equal(after[i].waiting.values, alone.stream.waiting.values)


def test_rows_for_as_many_streams_as_given_only() -> None:
    with pytest.raises(ValueError, match="3 rows for 2 streams: one each"):
        scan_rows([start(), start()], inputs(3, 0), 4, delta=True)


def test_a_scan_flushes_subnormal_numbers_to_zero_on_its_thread_only() -> None:
    """Values below float32's normal range (as a chunk's strong decays make them) are read as
    zero in the scan, so no product or state holds one (an x86 core takes a slow assist for
    each); the arithmetic after the scan keeps them as they are."""
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU has no flush-to-zero mode (the scan computes subnormals as they are)")
    tokens = inputs(8, seed=5)
    tiny = torch.finfo(torch.float32).tiny
    faint = ScanInputs(tokens.queries, tokens.keys, tokens.values * tiny / 4, tokens.decays,
                       tokens.betas)
    step = scan_step(start(), faint, chunk=8, delta=False)
    assert torch.equal(step.outputs, torch.zeros_like(step.outputs))
    assert torch.equal(step.stream.state, torch.zeros_like(step.stream.state))
    assert (faint.values[0] * 0.5).abs().max() > 0  # outside the scan: as they are
