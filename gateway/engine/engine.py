"""The engine: runs requests on the model, warm-starting each from its cached prefix.

One model instance serves requests one at a time from a bounded queue, on one worker thread
(a 135M model on 2 CPU cores has nothing to gain from batching, and batching prompts of
different shapes would break parity). The gRPC threads only validate, enqueue and stream.

Every prefill, cold or warm, runs in block-aligned chunks (DESIGN.md, "Parity"): block i is one
chunk of its own tokens on top of blocks 0..i-1, and the trailing partial block one more chunk.
A warm request loads its cached blocks -- bit-identical to what a cold run computes -- and then
performs exactly the cold run's operations from its first uncached block on, so greedy outputs
are identical token for token. A request that needs the logits of its last prompt token always
recomputes the block holding it (the cache keeps KV, not logits).

After prefill, every new full block of the prompt is stored; after the response is complete,
the blocks that the generated tokens filled are recomputed block-aligned (their decode-time KV
came from one-token steps, which a cold run would not reproduce bit for bit) and stored too, so
the next turn of a chat hits them.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from gateway.cache.prefix_cache import PrefixCache
from gateway.core.canonical import CanonicalPrompt, PromptInput, canonicalize
from gateway.core.errors import (
    DeadlineExceeded,
    EngineDraining,
    GatewayError,
    InvalidRequest,
    QueueFull,
    RequestCancelled,
)
from gateway.core.fingerprint import Namespace, NamespaceSpec, Scope, derive_namespace
from gateway.core.requests import (
    FinishReason,
    GenerateRequest,
    LookupRequest,
    LookupResult,
    TokenDelta,
    Usage,
    WarmRequest,
    WarmResult,
)
from gateway.core.tokens import TokenIds, as_token_ids
from gateway.engine.detokenizer import Detokenizer
from gateway.engine.kv_sequence import KVSequence
from gateway.engine.model import LoadedModel, forward_logits, make_sequence_cache
from gateway.engine.observer import EngineMetrics
from gateway.engine.sampling import Sampler

logger = logging.getLogger(__name__)

Event = TokenDelta | Usage


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """How the engine runs requests.

    Attributes:
        block_tokens: tokens per block; must equal the cache's.
        max_queue: requests that may wait; more are refused (RESOURCE_EXHAUSTED).
        default_ttl_s: sliding TTL of stored blocks when a request names none.
        max_prompt_tokens: longest prompt accepted (default: the model's context - 1).
        max_deadline_s: the longest any request may run, whatever its own deadline.
        store_generated_blocks: recompute and store the blocks generated tokens fill.
    """

    block_tokens: int = 256
    max_queue: int = 64
    default_ttl_s: float | None = 3600.0
    max_prompt_tokens: int | None = None
    max_deadline_s: float = 600.0
    store_generated_blocks: bool = True


@dataclass(slots=True, kw_only=True)
class _Job:
    kind: Literal["generate", "warm"]
    request: GenerateRequest | WarmRequest
    tokens: TokenIds
    submitted: float
    deadline: float
    events: queue.SimpleQueue[Event | BaseException | None] = field(
        default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    usage_sent: bool = False
    warm_result: WarmResult | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class RequestHandle:
    """A queued or running generation: iterate it for deltas, then one ``Usage``."""

    def __init__(self, job: _Job) -> None:
        self._job = job

    def __iter__(self) -> Iterator[Event]:
        while True:
            item = self._job.events.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, Usage):
                return

    def cancel(self) -> None:
        """Stop the request as soon as the worker next checks (between chunks and tokens)."""
        self._job.cancelled.set()


class Engine:
    """Queue, worker thread, model and prefix cache: the request path below the servicer.

    Args:
        loaded: the model.
        cache: the prefix cache (None: every request runs cold, nothing is stored).
        config: engine settings.
        deployment_secret: keys every block namespace (16..64 bytes).
        clock: monotonic time source (deadlines, TTFT).
        metrics: where each generation is recorded (None: nowhere).
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
    ) -> None:
        if cache is not None and cache.block_tokens != config.block_tokens:
            raise ValueError(
                f"cache blocks of {cache.block_tokens} tokens, engine of {config.block_tokens}")
        self._loaded = loaded
        self._cache = cache
        self._config = config
        self._secret = deployment_secret
        self._clock = clock
        self._metrics = metrics
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=config.max_queue)
        self._thread: threading.Thread | None = None
        self._is_draining = False
        self._current: _Job | None = None
        self._lock = threading.Lock()
        self._namespaces: dict[Scope, Namespace] = {}
        self._prefill_s_per_token: float | None = None
        self._started_at = clock()
        device = next(loaded.model.parameters()).device
        self._device = device
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
        self._thread = threading.Thread(target=self._run, name="kvgate-engine", daemon=True)
        self._thread.start()

    @property
    def is_ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._is_draining

    @property
    def model_name(self) -> str:
        return self._loaded.name

    def stop(self, grace_s: float = 10.0) -> None:
        """Take no new requests; let queued and running ones finish within ``grace_s``, then
        cancel what is left; stop the worker."""
        with self._lock:
            self._is_draining = True
        deadline = self._clock() + grace_s
        while self._clock() < deadline:
            with self._lock:
                idle = self._current is None and self._queue.empty()
            if idle:
                break
            time.sleep(0.02)
        while True:  # whatever is still queued is refused
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._fail(job, EngineDraining("the server is shutting down; retry elsewhere"))
        with self._lock:
            if self._current is not None:
                self._current.cancelled.set()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=max(1.0, grace_s))
            self._thread = None

    # ---- requests ----------------------------------------------------------------------

    def generate(self, request: GenerateRequest) -> RequestHandle:
        """Validate and queue a generation; iterate the handle for its output.

        Raises:
            InvalidRequest: the request can never succeed as sent.
            QueueFull: too many requests are waiting.
            EngineDraining: the engine is shutting down.
        """
        problems = request.sampling.problems()
        if request.cache.ttl_s is not None and not (
            math.isfinite(request.cache.ttl_s) and request.cache.ttl_s > 0
        ):
            problems.append(f"ttl_s must be a positive number of seconds, got "
                            f"{request.cache.ttl_s}")
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
        if request.ttl_s is not None and not (math.isfinite(request.ttl_s) and request.ttl_s > 0):
            raise InvalidRequest(f"ttl_s must be a positive number of seconds, got "
                                 f"{request.ttl_s}")
        if self._cache is None:
            raise InvalidRequest("this server runs without a cache: nothing can be warmed")
        prompt = self._canonical(request.prompt)
        job = self._job("warm", request, prompt.token_ids, None)
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.warm_result is not None
        return job.warm_result

    def lookup(self, request: LookupRequest) -> LookupResult:
        """How much of the prompt is cached in the caller's scope; computes nothing."""
        prompt = self._canonical(request.prompt)
        tokens = prompt.token_ids
        bt = self._config.block_tokens
        if self._cache is None:
            match_tiers: tuple[str, ...] = ()
            diverges: int | None = 0 if len(tokens) >= bt else None
            num_blocks = len(tokens) // bt
        else:
            match = self._cache.lookup(self._namespace(request.scope), tokens)
            if request.scope.kind == "tenant":
                shared = self._cache.lookup(self._namespace(Scope.shared()), tokens)
                if shared.num_blocks > match.num_blocks:
                    match = shared
            match_tiers, diverges, num_blocks = (
                match.tiers, match.diverges_at_block, match.num_prompt_blocks)
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
        )

    def _canonical(self, prompt: PromptInput) -> CanonicalPrompt:
        return canonicalize(prompt, self._loaded.tokenizer, max_prompt_tokens=self._max_prompt)

    def _job(self, kind: Literal["generate", "warm"], request: GenerateRequest | WarmRequest,
             tokens: TokenIds, deadline: float | None) -> _Job:
        now = self._clock()
        limit = now + self._config.max_deadline_s
        job = _Job(kind=kind, request=request, tokens=tokens, submitted=now,
                   deadline=limit if deadline is None else min(deadline, limit))
        with self._lock:
            if self._is_draining or self._thread is None:
                raise self._refused(kind, EngineDraining(
                    "the server is shutting down; retry on another replica"))
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                raise self._refused(kind, QueueFull(
                    f"{self._config.max_queue} requests are already waiting; retry shortly"
                )) from None
            self._note_queue_depth()
        return job

    def _refused(self, kind: str, exc: GatewayError) -> GatewayError:
        if self._metrics is not None and kind == "generate":
            self._metrics.record_failure(exc)
        return exc

    def _note_queue_depth(self) -> None:
        if self._metrics is not None:
            self._metrics.set_queue_depth(self._queue.qsize())

    # ---- worker ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._note_queue_depth()
            with self._lock:
                self._current = job
            try:
                if job.kind == "generate":
                    self._run_generate(job)
                else:
                    job.warm_result = self._run_warm(job)
            except GatewayError as exc:
                self._fail(job, exc)
            except Exception as exc:  # a bug: the request fails, the server lives on
                logger.exception("request failed")
                self._fail(job, exc)
            finally:
                with self._lock:
                    self._current = None
                job.done.set()

    def _fail(self, job: _Job, exc: BaseException) -> None:
        if self._metrics is not None and job.kind == "generate" and not job.usage_sent:
            self._metrics.record_failure(exc)
        job.error = exc
        job.events.put(exc)
        job.done.set()

    def _check(self, job: _Job) -> None:
        if job.usage_sent:
            return  # the answer is delivered: storing its blocks is not the client's to stop
        if job.cancelled.is_set():
            raise RequestCancelled("the request was cancelled")
        if self._clock() > job.deadline:
            raise DeadlineExceeded("the request ran past its deadline")

    def _namespace(self, scope: Scope) -> Namespace:
        with self._lock:
            namespace = self._namespaces.get(scope)
            if namespace is None:
                namespace = derive_namespace(
                    NamespaceSpec(
                        deployment_secret=self._secret,
                        model_fingerprint=self._loaded.fingerprint,
                        kv_dtype=str(self._loaded.layout.dtype).removeprefix("torch."),
                        device_kind=self._device_kind,
                        scope=scope,
                    )
                )
                self._namespaces[scope] = namespace
            return namespace

    def _prefill(self, job: _Job, seq: KVSequence, tokens: torch.Tensor, start: int,
                 end: int) -> torch.Tensor | None:
        """Prefill tokens[start:end] in block-aligned chunks; the last position's logits."""
        bt = self._config.block_tokens
        logits = None
        position = start
        while position < end:
            self._check(job)
            chunk_end = min(end, (position // bt + 1) * bt)
            began = time.perf_counter()
            logits = forward_logits(self._loaded, tokens[position:chunk_end],
                                    make_sequence_cache(seq))
            seq.advance(chunk_end - position)
            self._note_prefill_speed(chunk_end - position, time.perf_counter() - began)
            position = chunk_end
        return logits

    def _note_prefill_speed(self, num_tokens: int, seconds: float) -> None:
        sample = seconds / max(1, num_tokens)
        previous = self._prefill_s_per_token
        self._prefill_s_per_token = sample if previous is None else previous + 0.2 * (
            sample - previous)

    def _run_generate(self, job: _Job) -> None:
        request = job.request
        assert isinstance(request, GenerateRequest)
        tokens = job.tokens
        ids = torch.from_numpy(tokens.astype(np.int64))
        bt = self._config.block_tokens
        capacity = len(tokens) + request.sampling.max_tokens
        use_cache = self._cache is not None and not request.cache.no_cache
        if not use_cache:
            seq = KVSequence(self._loaded.layout, capacity, device=self._device)
            logits = self._prefill(job, seq, ids, 0, len(tokens))
            assert logits is not None
            self._decode(job, seq, logits, tokens, cached_by_tier={})
            return
        assert self._cache is not None
        namespace = self._namespace(request.scope)
        ttl = request.cache.ttl_s if request.cache.ttl_s is not None else (
            self._config.default_ttl_s)
        top_tier = self._cache.tier_names[0]
        with ExitStack() as stack:
            lease = stack.enter_context(self._cache.acquire(namespace, tokens))
            source = lease
            if request.scope.kind == "tenant":
                # Prompts an admin published in the shared scope are read by every tenant; what
                # the tenant then stores goes to its own namespace, never to the shared one.
                shared = stack.enter_context(
                    self._cache.acquire(self._namespace(Scope.shared()), tokens))
                if shared.match.num_blocks > lease.match.num_blocks:
                    source = shared
            blocks = self._cache.load(
                source,
                recompute_s_per_token=self._prefill_s_per_token,
                max_blocks=(len(tokens) - 1) // bt,
            )
            seq = KVSequence.from_blocks(self._loaded.layout, blocks, capacity,
                                         device=self._device)
            cached_by_tier: dict[str, int] = {}
            for tier in source.match.tiers:
                cached_by_tier[tier] = cached_by_tier.get(tier, 0) + bt
            logits = self._prefill(job, seq, ids, len(blocks) * bt, len(tokens))
            assert logits is not None
            num_full = len(tokens) // bt
            own = lease.match.num_blocks
            fresh = [blocks[i] if i < len(blocks) else seq.block(i, bt)
                     for i in range(own, num_full)]
            self._cache.insert(lease, tier=top_tier, blocks=fresh, ttl_s=ttl)
            generated = self._decode(job, seq, logits, tokens, cached_by_tier=cached_by_tier)
        if self._config.store_generated_blocks and generated:
            self._store_generated(job, namespace, seq, tokens, generated, ttl)

    def _decode(self, job: _Job, seq: KVSequence, logits: torch.Tensor, tokens: TokenIds,
                *, cached_by_tier: dict[str, int]) -> list[int]:
        request = job.request
        assert isinstance(request, GenerateRequest)
        params = request.sampling
        sampler = Sampler(params, vocab_size=self._loaded.tokenizer.vocab_size)
        detok = Detokenizer(self._loaded.tokenizer, params.stop)
        eos = set(self._loaded.eos_token_ids)
        generated: list[int] = []
        ttft_ms: float | None = None
        finish: FinishReason = "length"
        cache = make_sequence_cache(seq)
        for step in range(params.max_tokens):
            self._check(job)
            token = sampler.pick(logits)
            generated.append(token)
            if ttft_ms is None:
                ttft_ms = (self._clock() - job.submitted) * 1e3
            if token in eos:
                finish = "eos"
                break
            text = detok.add(token)
            job.events.put(TokenDelta(token_ids=(token,), text=text))
            if detok.stopped:
                finish = "stop"
                break
            if step + 1 == params.max_tokens:
                break
            logits = forward_logits(self._loaded, torch.tensor([token]), cache)
            seq.advance(1)
        tail = detok.finish()
        if tail:
            job.events.put(TokenDelta(token_ids=(), text=tail))
        usage = Usage(
            prompt_tokens=len(tokens),
            cached_tokens=sum(cached_by_tier.values()),
            cached_tokens_by_tier=cached_by_tier,
            completion_tokens=len(generated),
            ttft_ms=ttft_ms if ttft_ms is not None else 0.0,
            total_ms=(self._clock() - job.submitted) * 1e3,
            finish_reason=finish,
        )
        job.events.put(usage)
        job.usage_sent = True
        if self._metrics is not None:
            self._metrics.record_generation(
                tenant=request.scope.owner, prompt_tokens=usage.prompt_tokens,
                cached_tokens_by_tier=usage.cached_tokens_by_tier,
                finish_reason=usage.finish_reason, ttft_s=usage.ttft_ms / 1e3,
                total_s=usage.total_ms / 1e3)
        return generated

    def _store_generated(self, job: _Job, namespace: Namespace, seq: KVSequence,
                         prompt: TokenIds, generated: list[int], ttl_s: float | None) -> None:
        """Recompute, block-aligned, the full blocks the answer filled, and store them."""
        assert self._cache is not None
        bt = self._config.block_tokens
        everything = as_token_ids(np.concatenate([prompt, np.asarray(generated, np.uint32)]))
        first = len(prompt) // bt
        num_full = min(len(everything), seq.length) // bt
        if num_full <= first:
            return
        ids = torch.from_numpy(everything.astype(np.int64))
        try:
            with self._cache.acquire(namespace, everything) as lease:
                if lease.match.num_blocks != first:
                    return  # the prompt's blocks are not all stored: nothing to continue
                seq.truncate(first * bt)
                self._prefill(job, seq, ids, first * bt, num_full * bt)
                fresh = [seq.block(i, bt) for i in range(first, num_full)]
                self._cache.insert(lease, tier=self._cache.tier_names[0], blocks=fresh,
                                   ttl_s=ttl_s)
        except (RequestCancelled, DeadlineExceeded):
            return  # the answer was already delivered; storing it is only an optimisation

    def _run_warm(self, job: _Job) -> WarmResult:
        request = job.request
        assert isinstance(request, WarmRequest) and self._cache is not None
        tokens = job.tokens
        ids = torch.from_numpy(tokens.astype(np.int64))
        bt = self._config.block_tokens
        num_full = len(tokens) // bt
        namespace = self._namespace(request.scope)
        ttl = request.ttl_s if request.ttl_s is not None else self._config.default_ttl_s
        with self._cache.acquire(namespace, tokens) as lease:
            blocks = self._cache.load(lease, recompute_s_per_token=self._prefill_s_per_token)
            num_cached = len(blocks)
            seq = KVSequence.from_blocks(self._loaded.layout, blocks, max(1, num_full * bt),
                                         device=self._device)
            self._prefill(job, seq, ids, num_cached * bt, num_full * bt)
            fresh = [seq.block(i, bt) for i in range(num_cached, num_full)]
            result = self._cache.insert(lease, tier=self._cache.tier_names[0], blocks=fresh,
                                        ttl_s=ttl)
        if request.pin:
            self._cache.set_pinned(namespace, tokens, True)
        return WarmResult(
            prompt_tokens=len(tokens),
            num_blocks=num_full,
            num_new_blocks=result.num_new_blocks,
            num_cached_blocks=num_cached,
            stored_bytes=sum(b.nbytes for b in fresh[: result.num_new_blocks]),
            elapsed_ms=(self._clock() - job.submitted) * 1e3,
        )

    # ---- keys, for the cache's admin (gateway.cache.admin.PromptKeys) -----------------

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
