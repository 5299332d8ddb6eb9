"""The gated delta rule's chunked scan (``gateway.engine.forward.recurrent.gated_delta``): the
same bits however a sequence's tokens arrive -- one prompt, steps of any size, one token at a
time, or resumed from the state kept at a chunk's end -- and the rule transformers computes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from gateway.engine.forward.recurrent.gated_delta import DeltaInputs, DeltaStream, delta_step

HEADS, KEY_DIM, VALUE_DIM = 2, 8, 6


def inputs(num_tokens: int, seed: int) -> DeltaInputs:
    g = torch.Generator().manual_seed(seed)

    def unit(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=g)
        return x / x.norm(dim=-1, keepdim=True)

    return DeltaInputs(
        queries=unit(num_tokens, HEADS, KEY_DIM) * KEY_DIM ** -0.5,
        keys=unit(num_tokens, HEADS, KEY_DIM),
        values=torch.randn(num_tokens, HEADS, VALUE_DIM, generator=g),
        decays=torch.nn.functional.logsigmoid(torch.randn(num_tokens, HEADS, generator=g) + 2),
        betas=torch.sigmoid(torch.randn(num_tokens, HEADS, generator=g)))


def in_steps(stream: DeltaStream, tokens: DeltaInputs, sizes: list[int],
             chunk: int) -> tuple[torch.Tensor, DeltaStream, dict[int, torch.Tensor]]:
    outputs: list[torch.Tensor] = []
    states: dict[int, torch.Tensor] = {}
    at = 0
    for size in sizes:
        step = delta_step(stream, tokens.rows(at, at + size), chunk)
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


def start() -> DeltaStream:
    return DeltaStream.start(HEADS, KEY_DIM, VALUE_DIM)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40).flatmap(lambda n: st.tuples(st.just(n), splits(n))),
       st.sampled_from([1, 2, 4, 8]), st.integers(0, 2**16))
def test_steps_of_any_size_give_the_bits_of_one_prompt(
        case: tuple[int, list[int]], chunk: int, seed: int) -> None:
    n, sizes = case
    tokens = inputs(n, seed)
    whole = delta_step(start(), tokens, chunk)
    outputs, stream, states = in_steps(start(), tokens, sizes, chunk)
    assert torch.equal(outputs, whole.outputs)
    assert torch.equal(stream.state, whole.stream.state)
    assert stream.position == whole.stream.position == n - n % chunk
    assert states.keys() == dict(whole.states).keys()
    assert all(torch.equal(states[p], s) for p, s in whole.states)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(1, 5), st.integers(0, 2**16))
def test_one_token_at_a_time_gives_the_bits_of_one_prompt(n: int, chunk_log: int,
                                                          seed: int) -> None:
    chunk = 2 ** (chunk_log - 1)
    tokens = inputs(n, seed)
    outputs, stream, _ = in_steps(start(), tokens, [1] * n, chunk)
    whole = delta_step(start(), tokens, chunk)
    assert torch.equal(outputs, whole.outputs)
    assert torch.equal(stream.state, whole.stream.state)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 40), st.sampled_from([1, 2, 4, 8]), st.integers(0, 2**16),
       st.data())
def test_a_stream_resumed_from_a_kept_state_continues_with_the_same_bits(
        n: int, chunk: int, seed: int, data: st.DataObject) -> None:
    tokens = inputs(n, seed)
    whole = delta_step(start(), tokens, chunk)
    kept = [(p, s) for p, s in whole.states if p < n]
    if not kept:
        return
    position, state = data.draw(st.sampled_from(kept))
    resumed = delta_step(DeltaStream.at(state.clone(), position),
                         tokens.rows(position, n), chunk)
    assert torch.equal(resumed.outputs, whole.outputs[position:])
    assert torch.equal(resumed.stream.state, whole.stream.state)


def test_it_is_the_rule_transformers_computes_token_by_token_and_in_chunks() -> None:
    tokens = inputs(37, seed=7)
    ours = delta_step(start(), tokens, chunk=8)
    batched = [x.unsqueeze(0) for x in (tokens.queries, tokens.keys, tokens.values,
                                        tokens.decays, tokens.betas)]
    # transformers scales the queries itself: hand it the unscaled ones
    batched[0] = batched[0] * KEY_DIM ** 0.5
    reference, final = torch_recurrent_gated_delta_rule(*batched, output_final_state=True)
    chunked, _ = torch_chunk_gated_delta_rule(*batched, chunk_size=8, output_final_state=True)
    whole_state = delta_step(start(), tokens.rows(0, 32), chunk=8).stream.state
    assert torch.allclose(ours.outputs, reference[0], atol=1e-5, rtol=1e-4)
    assert torch.allclose(ours.outputs, chunked[0], atol=1e-5, rtol=1e-4)
    _, at_32 = torch_recurrent_gated_delta_rule(*(x[:, :32] for x in batched),
                                                output_final_state=True)
    assert at_32 is not None and final is not None
    assert torch.allclose(whole_state, at_32[0], atol=1e-5, rtol=1e-4)


def test_a_stream_that_does_not_start_a_chunk_is_refused() -> None:
    stream = DeltaStream.at(torch.zeros(HEADS, KEY_DIM, VALUE_DIM), position=3)
    try:
        delta_step(stream, inputs(1, 0), chunk=4)
    except ValueError as exc:
        assert str(exc) == "a stream at 3 does not start a chunk of 4"
    else:
        raise AssertionError("a misaligned stream was advanced")
