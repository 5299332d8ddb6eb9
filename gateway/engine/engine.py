"""The engine: the public face of the request path below the servicer.

``Engine`` validates and canonicalises requests, and hands them to one ``StepLoop``
(``gateway.engine.scheduling.loop``) that runs many at once on one model: each step batches the
decode rows of every running request with prefill chunks of the admitted ones (``Scheduler``: fair
across tenants, bounded per tenant). The gRPC threads only validate, submit and stream.

Warm equals cold bit for bit because every forward is invariant (``BatchedForward``: a token's
numbers depend only on its own sequence, docs/design.md "Parity"). It is checked at start-up on the
real weights (``probe_invariance``); where it does not hold, or the architecture is not one the
batched forward walks, the engine runs the serial exact route instead -- one request at a time,
block-aligned chunks through transformers -- and ``route`` says so and why. The route is part of
every block's namespace: blocks of one route are never served to the other. So are the device
kind and the dtype the K/V are computed in (``dtype``: bfloat16 K/V never serve a float32 engine).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import numpy as np
import torch

from gateway.cache.operations.admin import evict_where
from gateway.cache.prefix_cache import PrefixCache
from gateway.core.canonical import CanonicalPrompt, PromptInput, canonicalize
from gateway.core.errors import (
    EngineDraining,
    GatewayError,
    InvalidRequest,
    QueueFull,
)
from gateway.core.fingerprint import Namespace, NamespaceSpec, Scope, derive_namespace
from gateway.core.requests import (
    SHARED_SCOPE_TIER,
    GenerateRequest,
    LookupRequest,
    LookupResult,
    WarmRequest,
    WarmResult,
    priority_problem,
)
from gateway.core.tokens import TokenIds
from gateway.engine.forward.batched import BatchedForward, SequenceRows, StepForward
from gateway.engine.forward.captured_steps import (
    CAPTURED_PREFILL_ROWS,
    CapturedCounters,
    CapturedSteps,
    captured_steps_problem,
)
from gateway.engine.kv.sequence import KVSequence, pool_bytes_for
from gateway.engine.kv.tail_cache import TailCache, TailCounters
from gateway.engine.linear.row_products import KERNELS, Product
from gateway.engine.models.loading import LoadedModel, refuse_unkept_states
from gateway.engine.native.openmp_team import release_this_threads_team
from gateway.engine.output.observer import EngineMetrics
from gateway.engine.parity.recompute_speed import measure_recompute_speed
from gateway.engine.parity.route_search import (
    EngineRoute,
    build_forward,
    features_problem,
    route_of,
    search_route,
    unpack_model,
)
from gateway.engine.parity.shadow import EvictBlocks, ShadowCounters, ShadowVerifier
from gateway.engine.parity.verdicts import NUMERICS_VERSION, VerdictStore, verdict_key
from gateway.engine.scheduling.jobs import Job, RequestHandle, WarmHandle
from gateway.engine.scheduling.loop import StepLoop
from gateway.engine.scheduling.loop_records import LoopCounters, LoopSettings
from gateway.engine.scheduling.scheduler import Scheduler
from gateway.engine.settings import EngineConfig as EngineConfig
from policies.base import BlockKey
from tiers.page_pool import PagePool
from tiers.payload import KVBlock

logger = logging.getLogger(__name__)

class Engine:
    """Queue, worker thread, model and prefix cache: the request path below the servicer.

    Args:
        loaded: the model.
        cache: the prefix cache (None: every request runs cold, nothing is stored).
        config: engine settings.
        deployment_secret: keys every block namespace (16..64 bytes).
        clock: monotonic time source (deadlines, TTFT).
        metrics: where each generation is recorded (None: nowhere).
        verdicts: where the route search's verdicts are remembered (None: search every start).
        kernels: the linear kernels the search tries (a seam for tests).
        cancelled: polled while the route is searched; True ends ``start`` with
            ``SearchCancelled`` (the process is shutting down).
        shadow_evict: evicts blocks a shadow verification found divergent, by key, everywhere
            (the cache admin's eviction: Redis and the other replicas too); None evicts them from
            this replica's tiers only.
        pool: the KV pages requests run in: the device tier's (``OpenedCache.pool``), so that a
            hit shares its pages; None makes one of the engine's own, sized for
            ``kv_budget_bytes`` and the tails.
    """

    def __init__(
        self,
        *,
        loaded: LoadedModel,
        cache: PrefixCache | None,
        config: EngineConfig,
        deployment_secret: bytes,
        clock: Callable[[], float] = time.monotonic,
        metrics: EngineMetrics | None = None,
        verdicts: VerdictStore | None = None,
        kernels: Mapping[str, Product] = KERNELS,
        cancelled: Callable[[], bool] = lambda: False,
        shadow_evict: EvictBlocks | None = None,
        pool: PagePool | None = None,
    ) -> None:
        if cache is not None and cache.block_tokens != config.block_tokens:
            raise ValueError(
                f"cache blocks of {cache.block_tokens} tokens, engine of {config.block_tokens}")
        refuse_unkept_states(loaded, config.block_tokens)
        self._loaded = loaded
        self._cache = cache
        self._config = config
        self._secret = deployment_secret
        self._clock = clock
        self._metrics = metrics
        self._verdicts = verdicts
        self._kernels = kernels
        self._cancelled = cancelled
        self._lock = threading.Lock()
        self._is_draining = False
        self._namespaces: dict[Scope, Namespace] = {}
        self._next_id = 0
        self._loop: StepLoop | None = None
        self._worker: threading.Thread | None = None
        self._route = EngineRoute(name="serial", reason="not started")
        self._tails: TailCache | None = None
        self._shadow_evict = shadow_evict
        self._shadow: ShadowVerifier | None = None
        self._captured: CapturedSteps | None = None
        self._started_at = clock()
        device = loaded.device
        self._device = device
        if pool is None:
            pool = PagePool.for_budget(
                loaded.layout, page_tokens=config.block_tokens, device=device,
                budget_bytes=pool_bytes_for(config.kv_budget_bytes + config.tail_cache_bytes))
        elif pool.page_tokens != config.block_tokens:
            raise ValueError(f"pages of {pool.page_tokens} tokens, engine blocks of "
                             f"{config.block_tokens}")
        self._pool = pool
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            self._device_kind = f"cuda:sm{major}{minor}"
        else:
            self._device_kind = device.type
        self._max_prompt = (
            config.max_prompt_tokens
            if config.max_prompt_tokens is not None
            else loaded.max_context - 1
        )

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Choose the route (probing invariance on the real weights) and start the step loop.

        Both happen on the engine's one worker thread (see ``StepLoop.serve_here``); this waits
        until the route is chosen.

        Raises:
            Exception: whatever choosing the route raised (the probe found no model to run).
        """
        chosen = threading.Event()
        failures: list[BaseException] = []

        def work() -> None:
            try:
                forward, self._route = self._choose_route()
                forward = self._with_captured_steps(forward)
                logger.info("engine route: %s (%s)", self._route.name, self._route.reason)
                if (self._route.decode_kv_is_prefill_kv and self._config.tail_cache_bytes
                        and self._config.store_generated_blocks):
                    self._tails = TailCache(self._config.tail_cache_bytes)
                if self._cache is not None:  # a session's reset or expiry drops its tails
                    self._cache.sessions.attach_tails(self._tails)
                loop = self._build_loop(forward)
                self._loop = loop
                if self._config.measure_recompute_at_start:
                    samples = measure_recompute_speed(
                        forward, self._pool, int(self._loaded.model.config.vocab_size),
                        block_tokens=self._config.block_tokens, speed=loop.prefill_speed,
                        step_tokens=self._config.prefill_tokens)
                    logger.info("recompute speed before serving: %s", ", ".join(
                        f"{n} tokens in {s * 1e3:.1f} ms" for n, s in samples) or "-")
            except BaseException as exc:  # handed to start()'s caller
                failures.append(exc)
                return
            finally:
                chosen.set()
            try:
                loop.serve_here()
            except BaseException:  # a bug ended the worker: nothing will run again
                logger.critical("the engine's worker thread died", exc_info=True)
                loop.fail_outstanding(EngineDraining(
                    "the engine's worker has stopped; this replica is restarting, retry on "
                    "another"))

        self._worker = threading.Thread(target=work, name="kvgate-engine", daemon=True)
        self._worker.start()
        try:
            chosen.wait()
        except BaseException:
            # Interrupted (a signal during start-up): give the worker a moment to see
            # ``cancelled`` and leave its torch op -- a process that exits while another thread
            # is inside one aborts ("terminate called without an active exception"). Once the
            # route is chosen it runs none (its loop waits for work): no need to wait for it to
            # end, which it does only when stopped.
            chosen.wait(timeout=1.0)
            raise
        if failures:
            raise failures[0]
        release_this_threads_team()  # the caller's start-up team would throttle the engine's

    def _with_captured_steps(self, forward: StepForward) -> StepForward:
        """``forward``, its steps of up to ``max_running`` + ``CAPTURED_PREFILL_ROWS`` rows
        replayed from CUDA graphs where ``captured_steps`` asks and the route allows
        (``gateway.engine.forward.captured_steps``)."""
        if not self._config.captured_steps:
            return forward
        problem = captured_steps_problem(forward, self._device)
        if problem is not None:
            # On by default: off CUDA there is nothing to capture, which is no one's mistake.
            log = logger.warning if self._device.type == "cuda" else logger.info
            log("captured_steps = true, but steps run uncaptured here: %s", problem)
            return forward
        assert isinstance(forward, BatchedForward)
        max_rows = self._config.max_running + CAPTURED_PREFILL_ROWS
        logger.info("steps of up to %d rows replayed from CUDA graphs (each bucket captured "
                    "on first use)", max_rows)
        self._captured = CapturedSteps(forward, self._pool, max_rows=max_rows,
                                       max_positions=self._loaded.max_context, capture=True)
        return self._captured

    def _build_loop(self, forward: StepForward) -> StepLoop:
        # Preempted requests resume to the same answer only where decoding writes a prefill's
        # K/V (``gateway.engine.scheduling.preemption``): elsewhere priorities order, never preempt.
        limits = self._config.schedule_limits(
            is_serial=self._route.name == "serial",
            can_preempt=self._route.decode_kv_is_prefill_kv and self._route.name != "serial")
        self._shadow = self._build_shadow(forward)
        return StepLoop(
            loaded=self._loaded, forward=forward, scheduler=Scheduler(limits), cache=self._cache,
            pool=self._pool,
            settings=LoopSettings(
                block_tokens=self._config.block_tokens,
                default_ttl_s=self._config.default_ttl_s,
                store_generated_blocks=self._config.store_generated_blocks,
                decode_kv_is_prefill_kv=self._route.decode_kv_is_prefill_kv,
                recompute_generated_blocks=self._route.name == "serial"),
            namespace_of=self._namespace, clock=self._clock, metrics=self._metrics,
            tails=self._tails, shadow=self._shadow)

    def _build_shadow(self, forward: StepForward) -> ShadowVerifier | None:
        cache, bt = self._cache, self._config.block_tokens
        if cache is None or self._config.shadow_fraction <= 0.0:
            return None
        evict = self._shadow_evict
        if evict is None:
            def evict(keys: Sequence[BlockKey]) -> None:
                for key in keys:
                    evict_where(cache, key=key)
        # The serial route's oracle is block-aligned; the batched forward is chunk-invariant.
        # A step's tokens (not a prefill step's): a request that arrives waits one such chunk.
        chunk = bt if self._route.name == "serial" else max(
            bt, self._config.step_tokens // bt * bt)
        return ShadowVerifier(
            fraction=self._config.shadow_fraction, forward=forward, pool=self._pool,
            block_tokens=bt, chunk_tokens=chunk, evict=evict,
            metrics=self._metrics)

    def _choose_route(self) -> tuple[StepForward, EngineRoute]:
        """The route remembered for this model, machine and settings, else the one the search
        finds (then remembered)."""
        loaded = self._loaded
        settings = self._config.search_settings()
        key = None
        if self._verdicts is not None:
            key = verdict_key(fingerprint=loaded.fingerprint, dtype=loaded.layout.dtype,
                              device=self._device, settings=settings,
                              walk=loaded.batched_walk)
            remembered = self._verdicts.load(key)
            problem = None
            if remembered is not None and remembered.name == "batched":
                problem = features_problem(remembered.attention, self._device,
                                           loaded.layout, loaded.features)
            if remembered is not None and problem is not None:
                logger.warning("the remembered route's %s attention cannot run now (%s): "
                               "searching again", remembered.attention, problem)
                remembered = None
            if remembered is not None:
                logger.info("engine route remembered from an earlier start on this machine "
                            "(%s); delete %s to probe again", remembered.name,
                            self._verdicts.path_for(key))
                return (build_forward(loaded, remembered, self._kernels),
                        route_of(remembered, self._kernels))
        verdict = search_route(loaded, settings, kernels=self._kernels,
                               cancelled=self._cancelled)
        if self._verdicts is not None and key is not None:
            self._verdicts.save(key, verdict)
        return build_forward(loaded, verdict, self._kernels), route_of(verdict, self._kernels)

    @property
    def captured_steps(self) -> CapturedCounters | None:
        """What the captured steps did since start (None: they are off here)."""
        return self._captured.counters if self._captured is not None else None

    @property
    def counters(self) -> LoopCounters:
        """What the step loop has computed since start."""
        return self._loop.counters if self._loop is not None else LoopCounters()

    @property
    def tail_counters(self) -> TailCounters:
        """What the conversation tails spared since start (zeros where none are kept)."""
        return self._tails.counters if self._tails is not None else TailCounters()

    @property
    def shadow_counters(self) -> ShadowCounters:
        """What shadow verification has done since start (zeros where it is off)."""
        return self._shadow.counters if self._shadow is not None else ShadowCounters()

    @property
    def num_running(self) -> int:
        """Requests the scheduler has admitted and not yet finished (vLLM's
        ``num_requests_running``, read by ``/metrics``); 0 before the engine starts."""
        return self._loop.num_running if self._loop is not None else 0

    @property
    def kv_usage(self) -> float:
        """The fraction of the KV page pool the running requests hold (vLLM's
        ``kv_cache_usage_perc``: cached pages no request lists count as free)."""
        if self._loop is None:
            return 0.0
        return self._loop.kv_held()[0] / (self._pool.num_pages * self._pool.page_nbytes)

    @property
    def route(self) -> EngineRoute:
        """The route chosen at start-up, and why."""
        return self._route

    @property
    def dtype(self) -> str:
        """What the model computes and the K/V are kept in, e.g. "bfloat16" (in the namespace)."""
        return str(self._loaded.layout.dtype).removeprefix("torch.")

    @property
    def device(self) -> str:
        """Where the model runs, e.g. "cpu" or "cuda:0"."""
        return str(self._device)

    @property
    def is_ready(self) -> bool:
        return self._loop is not None and self._loop.is_alive and not self._is_draining

    @property
    def is_worker_dead(self) -> bool:
        """Whether the worker thread has ended although nobody stopped the engine (a bug
        escaped the step loop): nothing will ever run again, the process must be restarted."""
        worker = self._worker
        return (worker is not None and not worker.is_alive() and self._loop is not None
                and not self._is_draining)

    @property
    def model_name(self) -> str:
        return self._loaded.name

    def stop(self, grace_s: float = 10.0, *, worker_timeout_s: float = 60.0) -> bool:
        """Take no new requests; let queued and running ones finish within ``grace_s``, then
        cancel what is left; wait for the worker to end.

        Cancelled requests end at their next step, so the worker ends within one step (or one
        tier load); ``worker_timeout_s`` bounds the wait for a worker that is stuck.

        Returns:
            Whether the worker has ended: only then may the stores it writes be closed.
        """
        with self._lock:
            self._is_draining = True
        loop = self._loop
        if loop is None:
            return True
        deadline = self._clock() + grace_s
        while self._clock() < deadline and loop.num_in_flight:
            time.sleep(0.02)
        loop.cancel_all()
        loop.stop(timeout_s=max(1.0, grace_s) + worker_timeout_s)
        worker = self._worker
        stopped = worker is None or worker is threading.current_thread() or not worker.is_alive()
        if stopped:
            self._loop = None
            unpack_model(self._loaded)  # as loaded: another user may multiply plain weights
        return stopped

    # ---- requests ----------------------------------------------------------------------

    def generate(self, request: GenerateRequest) -> RequestHandle:
        """Validate and queue a generation; iterate the handle for its output.

        Raises:
            InvalidRequest: the request can never succeed as sent.
            QueueFull: too many requests are waiting.
            EngineDraining: the engine is shutting down.
        """
        problems = request.sampling.problems()
        if (priority := priority_problem(request.priority)) is not None:
            problems.append(priority)
        problems += request.cache.problems(is_shared=request.scope.kind == "shared")
        if problems:
            raise InvalidRequest("; ".join(problems))
        prompt = self._canonical(request.prompt)
        total = len(prompt.token_ids) + request.sampling.max_tokens
        if total > self._loaded.max_context:
            raise InvalidRequest(
                f"the prompt ({len(prompt.token_ids)} tokens) plus max_tokens "
                f"({request.sampling.max_tokens}) exceeds the model's context of "
                f"{self._loaded.max_context} tokens; shorten the prompt or lower max_tokens"
            )
        job = self._job("generate", request, prompt.token_ids, request.deadline)
        return RequestHandle(job)

    def warm(self, request: WarmRequest) -> WarmResult:
        """Compute and store the full blocks of a prompt (pinned if asked); blocks until done."""
        return self.start_warm(request).result()

    def start_warm(self, request: WarmRequest) -> WarmHandle:
        """Submit a warm through the scheduler, like any request: ``result()`` waits for it.

        Raises:
            InvalidRequest: the request can never succeed as sent.
            QueueFull: too many requests are waiting.
            EngineDraining: the engine is shutting down.
        """
        if problems := request.problems():
            raise InvalidRequest("; ".join(problems))
        if self._cache is None:
            raise InvalidRequest("this server runs without a cache: nothing can be warmed")
        prompt = self._canonical(request.prompt)
        # The loop pins without saving the pin log: this handle's waiting thread saves it.
        return WarmHandle(self._job("warm", request, prompt.token_ids, request.deadline),
                          then=self._cache.keep_pins if request.pin else None)

    def lookup(self, request: LookupRequest) -> LookupResult:
        """How much of the prompt is cached in the caller's scope; computes nothing."""
        prompt = self._canonical(request.prompt)
        tokens = prompt.token_ids
        bt = self._config.block_tokens
        is_lossy = False
        if self._cache is None:
            match_tiers: tuple[str, ...] = ()
            diverges: int | None = 0 if len(tokens) >= bt else None
            num_blocks = len(tokens) // bt
        else:
            own = self._namespace(request.scope)
            match = self._cache.lookup(own, tokens)
            match_tiers = match.tiers
            shared = (self._cache.lookup(self._namespace(Scope.shared()), tokens)
                      if request.scope.kind == "tenant" else None)
            lossy = self._cache.lossy_namespace(own) if request.allow_lossy else None
            if shared is not None and shared.num_blocks > match.num_blocks:
                # Which tier holds a shared block tells of other tenants: not said.
                match, match_tiers = shared, (SHARED_SCOPE_TIER,) * shared.num_blocks
            elif lossy is not None:  # its own prefix, continued as RequestBlocks would
                further = self._cache.lookup(lossy, tokens)
                if further.num_blocks > match.num_blocks:
                    match_tiers = (*match_tiers, *(f"{tier}:{lossy.quantization}" for tier
                                                   in further.tiers[match.num_blocks:]))
                    match = further
                    is_lossy = True
            diverges, num_blocks = match.diverges_at_block, match.num_prompt_blocks
        by_tier: dict[str, int] = {}
        for tier in match_tiers:
            by_tier[tier] = by_tier.get(tier, 0) + bt
        around = ""
        at_token = None
        if diverges is not None:
            at_token = diverges * bt
            window = [int(t) for t in tokens[max(0, at_token - 8) : at_token + 8]]
            around = self._loaded.tokenizer.decode(window)
        return LookupResult(
            prompt_tokens=len(tokens),
            cached_tokens=len(match_tiers) * bt,
            cached_tokens_by_tier=by_tier,
            num_prompt_blocks=num_blocks,
            diverges_at_block=diverges,
            diverges_at_token=at_token,
            text_around_divergence=around,
            lossy=is_lossy,
        )

    def cold_blocks(self, tokens: TokenIds) -> list[KVBlock]:
        """K/V of every full block of ``tokens`` computed cold, with no cache: the oracle.

        One prefill of the whole prompt on the batched route, block-aligned chunks on the
        serial route; a cached block must equal this bit for bit (docs/design.md, "Parity").
        """
        if self._loop is None:
            raise EngineDraining("the engine is not running")
        bt = self._config.block_tokens
        num_full = len(tokens) // bt
        seq = KVSequence(self._pool, max(1, num_full * bt))
        ids = torch.from_numpy(tokens.astype(np.int64))
        forward = self._loop.forward
        chunk = num_full * bt if self._route.name == "batched" else bt
        for start in range(0, num_full * bt, chunk):
            forward.forward([SequenceRows(sequence=seq, tokens=ids[start:start + chunk],
                                          wants_logits=False)])
        return [seq.block(i, bt) for i in range(num_full)]

    def _canonical(self, prompt: PromptInput) -> CanonicalPrompt:
        return canonicalize(prompt, self._loaded.tokenizer, max_prompt_tokens=self._max_prompt)

    def _job(self, kind: Literal["generate", "warm"], request: GenerateRequest | WarmRequest,
             tokens: TokenIds, deadline: float | None) -> Job:
        now = self._clock()
        limit = now + self._config.max_deadline_s
        with self._lock:
            self._next_id += 1
            job = Job(id=self._next_id, kind=kind, request=request, tokens=tokens,
                      submitted=now, deadline=limit if deadline is None else min(deadline, limit))
            loop = self._loop
            if self._is_draining or loop is None:
                raise self._refused(kind, EngineDraining(
                    "the server is shutting down; retry on another replica"))
        if self.is_worker_dead:
            raise self._refused(kind, EngineDraining(
                "the engine's worker has stopped; this replica is restarting, retry on another"))
        if isinstance(request, GenerateRequest):
            to_compute = len(tokens)
            capacity = len(tokens) + request.sampling.max_tokens
        else:  # a warm computes the prompt's full blocks only
            to_compute = capacity = len(tokens) // self._config.block_tokens * (
                self._config.block_tokens)
        kv_bytes = KVSequence.nbytes_for(self._pool.layout, capacity,
                                         page_tokens=self._pool.page_tokens)
        try:
            loop.submit(job, prompt_tokens=to_compute, kv_bytes=kv_bytes)
        except QueueFull as exc:
            raise self._refused(kind, exc) from None
        except ValueError as exc:
            raise self._refused(kind, InvalidRequest(str(exc))) from None
        return job

    def _refused(self, kind: str, exc: GatewayError) -> GatewayError:
        if self._metrics is not None and kind == "generate":
            self._metrics.record_failure(exc)
        return exc

    def _namespace(self, scope: Scope) -> Namespace:
        with self._lock:
            namespace = self._namespaces.get(scope)
            if namespace is None:
                namespace = derive_namespace(
                    NamespaceSpec(
                        deployment_secret=self._secret,
                        model_fingerprint=self._loaded.fingerprint,
                        kv_dtype=self.dtype,
                        # The version: blocks of a build that computed otherwise are others.
                        device_kind=(f"{self._device_kind}/{self._route.numerics}"
                                     f"/n{NUMERICS_VERSION}"),
                        scope=scope,
                    )
                )
                self._namespaces[scope] = namespace
            return namespace

    # ---- keys, for the cache's admin (gateway.cache.operations.admin.PromptKeys) -----------------

    def namespace(self, scope: Scope) -> Namespace:
        """The namespace of ``scope`` for this model, secret and device."""
        return self._namespace(scope)

    def known_namespaces(self) -> list[Namespace]:
        """Every namespace this engine has derived."""
        with self._lock:
            return list(self._namespaces.values())

    def prompt_tokens(self, prompt: PromptInput) -> TokenIds:
        """The canonical tokens of ``prompt``, as a request would see them."""
        return self._canonical(prompt).token_ids

    def preview(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` in this model's tokenizer."""
        return self._loaded.tokenizer.decode(token_ids)
