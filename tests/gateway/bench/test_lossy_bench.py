"""``kvgate bench lossy`` end to end on the tiny Llama: every row is there, each warm request
was served by the tier its row names (the bench checks every usage and fails otherwise), the
bytes are the formula's, agreement and perplexities are in range. Speed is never asserted.

Redis rows run where redis-server is installed (``tests.redis_harness``); without it they are
skipped with a printed reason, which is checked instead.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest

from gateway.bench.lossy import COLD, DEVICE, LossyOptions, check_served, run_lossy_benchmark
from gateway.bench.lossy_quality import AGREEMENT_TOKENS, agreement
from gateway.bench.numerics import resolve_numerics
from gateway.bench.rows import BenchError
from gateway.cli.common import EXIT_USAGE
from gateway.cli.main import main
from gateway.core.requests import Usage
from tests.redis_harness import REDIS_SERVER, redis_server_missing
from tests.tiny_llama import save_tiny_llama
from tiers.kv_quant import quantized_bytes_per_token

BLOCK = 16
TOKENS = 4 * BLOCK


def usage(by_tier: dict[str, int], *, lossy: bool = False) -> Usage:
    return Usage(prompt_tokens=TOKENS + 8, cached_tokens=sum(by_tier.values()),
                 cached_tokens_by_tier=by_tier, completion_tokens=1, ttft_ms=1.0,
                 total_ms=1.0, finish_reason="length", lossy=lossy)


def test_the_bench_measures_bytes_ttft_and_quality_from_the_tiers_it_names(
        tmp_path: Path) -> None:
    with_redis = redis_server_missing() is None
    model = save_tiny_llama(tmp_path / "model")
    out = io.StringIO()
    result = run_lossy_benchmark(LossyOptions(
        model=str(model), data_dir=tmp_path / "data", tokens=TOKENS, block_tokens=BLOCK,
        repeats=1, prompts=2, redis_binary=REDIS_SERVER if with_redis else None,
        numerics=resolve_numerics("cpu", "float32")), out=out)
    text = out.getvalue()

    # Bytes: the payloads are the layouts' (2 layers, 2 KV heads, head_dim 16, float32).
    row = result.bytes
    assert row.exact_payload == BLOCK * 2 * 2 * 2 * 16 * 4
    assert row.lossy_payload == BLOCK * quantized_bytes_per_token(2, 2, 16)
    assert row.payload_ratio == pytest.approx(row.formula_ratio) == pytest.approx(20 / 64)
    assert row.exact_blob > row.exact_payload and row.lossy_blob > row.lossy_payload
    assert "payload 0.3125x (formula 0.3125x)" in text

    # TTFT: every row measured once, each request served from its row's tier (checked by the
    # bench on every usage: a request served from elsewhere fails the run).
    expected = [COLD, DEVICE, "disk", "disk:int8"] + (["redis", "redis:int8"] if with_redis else [])
    assert list(result.ttft) == expected
    assert all(r.tier == name and len(r.samples_ms) == 1 and r.samples_ms[0] > 0
               for name, r in result.ttft.items())
    assert result.ttft_ratio("disk") > 0 and isinstance(result.load_ratio("disk"), float)
    assert "disk:int8 / disk p50:" in text
    if with_redis:
        assert result.redis_skipped is None and result.ttft_ratio("redis") > 0
    else:
        assert "redis: skipped (no redis-server" in text

    # Quality: agreement in range, first-step logits and perplexities finite.
    assert [q.prompt for q in result.quality] == [1, 2]
    for q in result.quality:
        assert 0 <= q.agreed <= q.matched <= AGREEMENT_TOKENS
        assert 0 <= min(q.cold_tokens, q.lossy_tokens) <= max(q.cold_tokens,
                                                               q.lossy_tokens) <= AGREEMENT_TOKENS
        assert math.isfinite(q.max_logit_diff) and q.max_logit_diff >= 0
        assert all(math.isfinite(p) and p > 0 for p in (q.ppl_exact, q.ppl_lossy))
    assert text.count("\noverall ") == 1


def test_a_request_served_from_another_tier_than_its_row_fails_the_run() -> None:
    check_served(usage({"disk:int8": TOKENS}, lossy=True), "disk:int8", TOKENS)
    check_served(usage({}), COLD, TOKENS)
    check_served(usage({"device": TOKENS}), DEVICE, TOKENS)
    for served, tier in (
        (usage({"disk": TOKENS}), "redis"),
        (usage({"disk": TOKENS - BLOCK}), "disk"),
        (usage({"device": BLOCK, "disk": TOKENS - BLOCK}), "disk"),
        (usage({"disk:int8": TOKENS}, lossy=False), "disk:int8"),
        (usage({"redis": TOKENS}), COLD),
        (usage({"disk": TOKENS}), DEVICE),
    ):
        with pytest.raises(BenchError, match="meant to serve"):
            check_served(served, tier, TOKENS)


def test_agreement_counts_the_leading_run_and_the_matching_positions() -> None:
    assert agreement([1, 2, 3, 4], [1, 2, 3, 4], 4) == (4, 4)
    assert agreement([1, 2, 3, 4], [1, 9, 3, 4], 4) == (1, 3)
    assert agreement([1, 2], [1, 2], 4) == (4, 4)  # both ended after 2 tokens
    assert agreement([1, 2], [1, 2, 3], 4) == (2, 3)
    assert agreement([], [5], 4) == (0, 3)


def test_a_redis_server_that_is_not_executable_is_a_usage_error(tmp_path: Path) -> None:
    assert main(["bench", "lossy", "--device", "cpu", "--data-dir", str(tmp_path),
                 "--redis-server", str(tmp_path / "no-such-redis-server")]) == EXIT_USAGE
    assert not (tmp_path / "models").exists()  # nothing was loaded
