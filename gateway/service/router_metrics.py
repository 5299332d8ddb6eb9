"""The series inference routers read, under vLLM's names, beside kvgate's own (issue 27).

Routers and autoscalers written for vLLM -- the Gateway API Inference Extension's endpoint
picker (llm-d's EPP polls every 50 ms), KEDA/HPA rules, dashboards -- read a few gauges and
counters by their ``vllm:`` names. ``VllmCollector`` renders them at scrape time from what
kvgate already counts, with vLLM's meanings and labels (``model_name``: the first served model
name; ``engine``: ``"0"``, kvgate runs one engine per process):

* ``vllm:num_requests_waiting``: requests queued in the engine's scheduler, not yet admitted
  (the engine reports it through ``EngineMetrics.set_queue_depth``);
* ``vllm:num_requests_running``: requests the scheduler has admitted and not finished;
* ``vllm:kv_cache_usage_perc``: the fraction (0..1) of the device's KV page pool that running
  requests hold (``Engine.kv_usage``: their block tables' pages, a shared prefix once);
* ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``: prompt tokens of
  answered generations, and of those the tokens served from a cache tier (any tier: the
  ``cached_tokens`` of the response's usage), in tokens as vLLM counts;
* ``vllm:cache_config_info``: a gauge fixed at 1 whose labels describe the cache, as vLLM's
  ``CacheConfig`` does (``block_size``, ``num_gpu_blocks``, ``num_cpu_blocks``,
  ``cache_dtype``, ``enable_prefix_caching``, ``engine``).

They carry no tenant label, so they are served on the API port's unauthenticated ``/metrics``
as well as on the operators' port.

NOTE: vLLM counts a block that holds cached KV but serves no running request as *free* (it can
be evicted for one), so its ``kv_cache_usage_perc`` rises with load, not with cache warmth;
kvgate counts the same way: the device tier's pages that no running request lists are left out,
so a warm, idle replica reads 0 and a router's saturation threshold on it (EPP's default 0.8)
means what it means for vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.core.admin_reports import StatsReport
from tiers.kinds.host import HOST as HOST_TIER

DEVICE_TIER = "device"
ENGINE_INDEX = "0"
"""vLLM's ``engine`` label: the data-parallel rank of the engine; kvgate has one engine."""
LABELS = ("model_name", "engine")


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheConfigInfo:
    """The labels of ``vllm:cache_config_info``, in vLLM's names (values as strings there).

    Attributes:
        block_size: tokens per block (``[cache] block_tokens``).
        num_gpu_blocks: blocks the device tier holds when full.
        num_cpu_blocks: blocks the host tier holds when full (0: no host tier).
        cache_dtype: what the K/V are stored in (``bfloat16``, ``float32``).
    """

    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    cache_dtype: str

    @classmethod
    def of(cls, stats: StatsReport, *, block_tokens: int, block_nbytes: int,
           dtype: str) -> CacheConfigInfo:
        """The cache's configuration from its tiers' budgets and the size of one block."""
        budgets = {tier.name: tier.budget_bytes for tier in stats.tiers}
        per_block = max(1, block_nbytes)
        return cls(block_size=block_tokens,
                   num_gpu_blocks=budgets.get(DEVICE_TIER, 0) // per_block,
                   num_cpu_blocks=budgets.get(HOST_TIER, 0) // per_block,
                   cache_dtype=dtype)

    def labels(self) -> dict[str, str]:
        return {"block_size": str(self.block_size), "cache_dtype": self.cache_dtype,
                "enable_prefix_caching": "True", "engine": ENGINE_INDEX,
                "num_cpu_blocks": str(self.num_cpu_blocks),
                "num_gpu_blocks": str(self.num_gpu_blocks)}


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterCounts:
    """What ``VllmCollector`` renders at one scrape (``GatewayMetrics`` gathers it).

    Attributes:
        num_waiting: requests queued in the scheduler.
        num_running: requests it has admitted and not finished.
        num_prompt_tokens: prompt tokens of answered generations since start.
        num_cached_tokens: of those, the tokens served from a cache tier.
        kv_usage: the fraction of the KV page pool running requests hold now.
    """

    num_waiting: int
    num_running: int
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_usage: float


class VllmCollector(Collector):
    """vLLM's series of one engine, read at scrape time.

    Args:
        model_name: the ``model_name`` label (the first served model name).
        counts: the figures of this scrape.
        info: the cache's configuration.
    """

    def __init__(self, *, model_name: str, counts: Callable[[], RouterCounts],
                 info: CacheConfigInfo) -> None:
        self._labels = (model_name, ENGINE_INDEX)
        self._counts = counts
        self._info = info

    def describe(self) -> list[Any]:
        return []  # NOTE: read at scrape time only; nothing to read at registration

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        counts = self._counts()
        labels = self._labels
        for name, documentation, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches "
             "(admitted by kvgate's scheduler, not finished).", counts.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed "
             "(queued in kvgate's scheduler).", counts.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage (kvgate: "
             "pages of the device's pool that running requests hold).", counts.kv_usage),
        ):
            gauge = GaugeMetricFamily(name, documentation, labels=LABELS)
            gauge.add_metric(labels, value)
            yield gauge
        for name, documentation, value in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
             "queried tokens (prompt tokens of answered generations).",
             counts.num_prompt_tokens),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
             "tokens (from any kvgate tier).", counts.num_cached_tokens),
        ):
            counter = CounterMetricFamily(name, documentation, labels=LABELS)
            counter.add_metric(labels, value)
            yield counter
        info_labels = self._info.labels()
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine "
                                 "CacheConfig (kvgate's cache, in vLLM's names).",
                                 labels=tuple(info_labels))
        info.add_metric(tuple(info_labels.values()), 1.0)
        yield info
