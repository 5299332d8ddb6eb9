"""The recompute speed measured before serving (``gateway.engine.parity.recompute_speed``): the
cache's first hit on a disk or Redis tier is judged against it."""

from __future__ import annotations

import logging

import pytest

from gateway.cache.operations.factory import OpenedCache
from gateway.engine.attention.tiled import TiledAttention
from gateway.engine.forward.batched import BatchedForward
from gateway.engine.models.loading import LoadedModel
from gateway.engine.parity.prefill_speed import PrefillSpeed
from gateway.engine.parity.recompute_speed import measure_recompute_speed
from tests.gateway.engine.kernels import ROWWISE
from tests.gateway.engine.parity import BLOCK, make_engine
from tests.tiny_llama import VOCAB
from tiers.page_pool import PagePool


def forward_of(tiny: LoadedModel) -> BatchedForward:
    return BatchedForward(tiny.model, TiledAttention(), ROWWISE)


def pool_of(tiny: LoadedModel, num_pages: int) -> PagePool:
    return PagePool(tiny.layout, page_tokens=BLOCK, num_pages=num_pages, device="cpu")


def test_a_block_and_a_full_step_give_a_figure_and_keep_no_page(tiny: LoadedModel) -> None:
    pool = pool_of(tiny, 64)
    speed = PrefillSpeed(step_tokens=16 * BLOCK)
    samples = measure_recompute_speed(forward_of(tiny), pool, VOCAB, block_tokens=BLOCK,
                                      step_tokens=16 * BLOCK, speed=speed, max_step_s=3600.0)
    assert [n for n, _ in samples] == [BLOCK, 16 * BLOCK]
    assert speed.num_samples == 2 and speed.s_per_token is not None
    assert pool.num_in_use == 0


def test_where_a_full_step_would_take_too_long_two_blocks_are_timed(tiny: LoadedModel) -> None:
    speed = PrefillSpeed(step_tokens=16 * BLOCK)
    samples = measure_recompute_speed(forward_of(tiny), pool_of(tiny, 64), VOCAB,
                                      block_tokens=BLOCK, step_tokens=16 * BLOCK, speed=speed,
                                      max_step_s=0.0)
    assert [n for n, _ in samples] == [BLOCK, 2 * BLOCK]


def test_a_pool_without_room_for_the_step_leaves_the_figure_to_the_first_requests(
        tiny: LoadedModel) -> None:
    speed = PrefillSpeed()
    # The full step whatever this machine's speed (two pages hold two blocks, not sixteen):
    # with the default bound a slow or loaded machine times two blocks, which fit.
    samples = measure_recompute_speed(forward_of(tiny), pool_of(tiny, 2), VOCAB,
                                      block_tokens=BLOCK, step_tokens=16 * BLOCK, speed=speed,
                                      max_step_s=3600.0)
    assert samples == [] and speed.s_per_token is None


def test_an_engine_asked_to_measures_before_it_serves(
        tiny: LoadedModel, opened: OpenedCache, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.engine.engine")
    engine = make_engine(tiny, opened, measure_recompute_at_start=True)
    try:
        assert "recompute speed before serving: 16 tokens in" in caplog.text
    finally:
        engine.stop(grace_s=5)


def test_an_engine_built_in_code_measures_nothing_it_was_not_asked_to(
        tiny: LoadedModel, opened: OpenedCache, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.engine.engine")
    engine = make_engine(tiny, opened)
    try:
        assert "recompute speed" not in caplog.text
    finally:
        engine.stop(grace_s=5)


def test_the_serial_route_is_measured_the_same_way(
        tiny: LoadedModel, opened: OpenedCache, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.engine.engine")
    engine = make_engine(tiny, opened, route="serial", measure_recompute_at_start=True)
    try:
        assert "recompute speed before serving: 16 tokens in" in caplog.text
    finally:
        engine.stop(grace_s=5)
