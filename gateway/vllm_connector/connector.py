"""``KvgateConnector``: kvgate's tiers as vLLM's KV store, through vLLM's v1 KV-connector
interface. The only module of kvgate that imports vLLM.

Started by vLLM itself::

    --kv-transfer-config '{"kv_connector": "KvgateConnector",
        "kv_connector_module_path": "gateway.vllm_connector.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvgate_config": "/etc/kvgate/vllm-worker.toml"}}'
    --no-enable-prefix-caching --block-size 64

vLLM makes one instance in its scheduler process and one in each worker process; this class
only translates vLLM's objects into the plain records of ``planning`` (the scheduler's
decisions), ``orders`` (what crosses between the processes) and ``worker_cache`` (the bytes),
and back (docs/vllm-worker.md).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from gateway.cache.operations.invalidation import EvictionFeed
from gateway.vllm_connector.deployment import (
    ConnectorDeployment,
    ConnectorRefused,
    ConnectorSettings,
)
from gateway.vllm_connector.key_changes import KeyChanges
from gateway.vllm_connector.known_keys import KnownKeys
from gateway.vllm_connector.orders import StepOrders, WorkerReport
from gateway.vllm_connector.page_layout import VllmPageLayout
from gateway.vllm_connector.pages import layer_problems
from gateway.vllm_connector.planning import LoadPlanner, ScheduledNew, ScheduledRunning
from gateway.vllm_connector.remote_keys import RedisKeyProbe
from gateway.vllm_connector.scope_tag import verify
from gateway.vllm_connector.worker_admin import follow_evictions
from gateway.vllm_connector.worker_cache import WorkerCache

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

REFUSALS_LOGGED_EVERY = 1000
"""A refused scope tag is logged the first time for its reason, then every this many."""


class KvgateStepMetadata(KVConnectorMetadata):
    """One step's orders, from the scheduler half to the worker half."""

    def __init__(self, orders: StepOrders) -> None:
        self.orders = orders


class KvgateWorkerMetadata(KVConnectorWorkerMetadata):
    """One step's report, from the worker half back to the scheduler half."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KvgateWorkerMetadata):
            return self
        return KvgateWorkerMetadata(self.report.merge(other.report))


class KvgateConnector(KVConnectorBase_V1):
    """kvgate's verified, tenant-scoped cache tiers behind vLLM's paged KV."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = ConnectorSettings.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config or {})
        self._deployment = ConnectorDeployment.open(
            settings, page_layout_of(vllm_config), model=str(vllm_config.model_config.model))
        self._block_tokens = vllm_config.cache_config.block_size
        self._max_model_len = vllm_config.model_config.max_model_len
        self._planner: LoadPlanner | None = None
        self._worker: WorkerCache | None = None
        self._feed: EvictionFeed | None = None
        self._report = WorkerReport()
        self._load_errors: set[int] = set()
        self._refusals: dict[str, int] = {}
        """Scope tags refused, by reason (``scope_tag.ScopeCheck.refusal``)."""
        self._live: dict[str, Any] = {}
        """vLLM's request objects of the requests the connector caches, until they finish."""
        self._refused: dict[str, str] = {}
        """The refusal of each unfinished request whose tag was refused."""
        if role == KVConnectorRole.SCHEDULER:
            redis = self._deployment.redis_tier()
            self._known = KnownKeys(disk_roots=self._deployment.disk_roots(),
                                    remote=RedisKeyProbe(redis) if redis is not None else None)
            self._planner = LoadPlanner(
                block_tokens=self._block_tokens, namespace_of=self._deployment.namespace_of,
                known=self._known)

    # ---- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = list(kv_caches.values())
        problems = layer_problems(layers, self._deployment.layout)
        if problems:
            raise ConnectorRefused("kvgate cannot hold this vLLM's KV tensors: "
                                   + "; ".join(problems))
        running_pages = 2 * (self._max_model_len // self._block_tokens + 1)
        changes = KeyChanges()
        opened = self._deployment.open_cache(running_pages=running_pages, tier_events=changes)
        self._worker = WorkerCache(opened, layers=layers,
                                   namespace_of=self._deployment.namespace_of, changes=changes)
        model_dir = Path(str(self._vllm_config.model_config.model))
        self._feed = follow_evictions(opened, self._deployment,
                                      model_dir if model_dir.is_dir() else None)
        logger.info("kvgate: the worker's cache is open (tiers %s, %d blocks recovered)",
                    list(opened.cache.tier_names), opened.num_recovered_blocks)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is None:
            return
        for order in self._orders().loads:
            outcome = self._worker.load(order, self._report)
            self._load_errors.update(outcome.failed_block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # whole pages are saved after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        if self._worker is None:
            return
        for order in self._orders().saves:
            self._worker.save(order, self._report)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is not None:
            self._worker.report_changes(self._report)
        if self._report.is_empty():
            return None
        report, self._report = self._report, WorkerReport()
        return KvgateWorkerMetadata(report)

    def shutdown(self) -> None:
        if self._feed is not None:
            self._feed.stop()
            self._feed = None
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._planner is not None:
            self._known.close()

    def _orders(self) -> StepOrders:
        if not self.has_connector_metadata():
            return StepOrders()
        metadata = self._get_connector_metadata()
        return metadata.orders if isinstance(metadata, KvgateStepMetadata) else StepOrders()

    # ---- scheduler side ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        planner = self._scheduler()
        check = verify(request.kv_transfer_params, self._deployment.scope_key,
                       now_ms=int(time.time() * 1000))
        scope = check.scope
        if scope is None:
            scope = self._deployment.default_scope
            refusal = check.refusal
            if refusal not in (None, "missing") and request.request_id not in self._refused:
                self._refused[request.request_id] = refusal
                count = self._refusals[refusal] = self._refusals.get(refusal, 0) + 1
                if count == 1 or count % REFUSALS_LOGGED_EVERY == 0:
                    logger.warning("kvgate: %d request(s) so far had their scope tag refused "
                                   "(%s) and got the default scope; the latest: %s", count,
                                   refusal, request.request_id)
        num_tokens = planner.match(request.request_id, request.prompt_token_ids or [], scope,
                                   num_computed_tokens=num_computed_tokens)
        if scope is not None:
            self._live[request.request_id] = request  # its answer's tokens, as they come
        return num_tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        self._scheduler().allocated(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        scheduled = scheduler_output.num_scheduled_tokens
        new = [ScheduledNew(request_id=item.req_id, block_ids=tuple(item.block_ids[0]),
                            num_computed_tokens=item.num_computed_tokens,
                            num_scheduled_tokens=scheduled.get(item.req_id, 0))
               for item in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        running = []
        for index, request_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[index]
            running.append(ScheduledRunning(
                request_id=request_id,
                new_block_ids=tuple(new_blocks[0]) if new_blocks is not None else (),
                resumed=request_id in cached.resumed_req_ids,
                num_computed_tokens=cached.num_computed_tokens[index],
                num_scheduled_tokens=scheduled.get(request_id, 0)))
        return KvgateStepMetadata(self._scheduler().step(new, running,
                                                         tokens_of=self._tokens_of))

    def _tokens_of(self, request_id: str) -> list[int]:
        request = self._live.get(request_id)
        return [] if request is None else list(request.all_token_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KvgateWorkerMetadata):
            self._scheduler().absorb(meta.report)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        # What the connector did for the request -- never the request's own parameters, whose
        # scope tag must not travel back to the client.
        done = self._scheduler().finished(request.request_id)
        self._live.pop(request.request_id, None)
        refusal = self._refused.pop(request.request_id, None)
        if refusal is None:
            return False, done
        return False, {**(done or {}), "kvgate.scope_refused": refusal}

    def _scheduler(self) -> LoadPlanner:
        if self._planner is None:
            raise RuntimeError("a scheduler-side call reached kvgate's worker-side connector")
        return self._planner


def page_layout_of(vllm_config: VllmConfig) -> VllmPageLayout:
    """vLLM's page layout of this deployment, as far as kvgate can hold it.

    Raises:
        ConnectorRefused: what kvgate cannot hold (MLA, hybrid models, tensor parallelism,
            quantized KV, vLLM's own prefix cache left on), in one sentence.
    """
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    problems = []
    if not current_platform.is_cpu():
        problems.append("only vLLM's CPU build is supported yet (its page layout is known)")
    if getattr(model, "use_mla", False):
        problems.append("the model uses MLA (one latent per token, not K and V)")
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        problems.append("tensor and pipeline parallelism are not supported yet: run one worker")
    if cache.cache_dtype != "auto":
        problems.append(f"the KV cache dtype {cache.cache_dtype!r} is quantized: use 'auto'")
    if cache.enable_prefix_caching:
        problems.append("vLLM's own prefix cache is on, and it is shared by every tenant: start "
                        "vLLM with --no-enable-prefix-caching (kvgate's cache replaces it)")
    if problems:
        raise ConnectorRefused("kvgate cannot hold this vLLM's KV: " + "; ".join(problems))
    dtype = model.dtype
    head_size = model.get_head_size()
    isa = _get_attn_isa(dtype, cache.block_size, head_size, cache.cache_dtype)
    if isa in ("vec", "vec16") and torch.cpu._is_avx512_supported():
        isa += "-avx512"  # the vector width the kernels pack for
    return VllmPageLayout(
        vllm_version=vllm.__version__, backend="CPU_ATTN", isa=isa, dtype=dtype,
        block_size=cache.block_size, num_layers=model.get_num_layers(parallel),
        kv_heads=model.get_num_kv_heads(parallel), head_size=head_size)
