"""The step loop: one thread, one model, many requests advancing together.

Each turn: take new submissions, fail the cancelled and the late, admit what the scheduler
allows (loading each admitted request's cached prefix), run the scheduler's ``StepPlan`` as one
forward, then sample, stream and finish. A request's blocks are leased from admission until it
ends, so nothing it reads is evicted under it; its prompt blocks are stored in the turn its
prefill completes, just after its first token is sent, and the blocks its answer filled when
it ends.

A generation the scheduler preempts (a better-priority request of its tenant needs its room)
hands its K/V to the cache, waits in the queue again and resumes as a hit on its own tokens, to
the same answer (``gateway.engine.scheduling.preemption``).

A failure of the forward (or of the loop's own bookkeeping) fails every request the step
carried; a failure after it, in turning one request's output into tokens, text and stored
blocks, fails that request alone, and the others go on as if it had never run.

Storing the answer's blocks needs no recomputation when the forward is invariant (decode-time
K/V then equal prefill K/V bit for bit, ``gateway.engine.parity.probe`` checks it); on the serial
route they are recomputed block-aligned as before (docs/design.md, "Parity").
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace

import numpy as np
import torch

from gateway.cache.prefix_cache import PrefixCache
from gateway.core.errors import EngineDraining, GatewayError
from gateway.core.fingerprint import Namespace, Scope
from gateway.core.requests import (
    FinishReason,
    GenerateRequest,
    TokenDelta,
    Usage,
    WarmRequest,
    WarmResult,
)
from gateway.engine.forward.batched import SequenceRows, StepForward
from gateway.engine.kv.sequence import KVSequence, distinct_held
from gateway.engine.kv.tail_cache import TailCache
from gateway.engine.models.loading import LoadedModel
from gateway.engine.output.detokenizer import Detokenizer
from gateway.engine.output.observer import EngineMetrics
from gateway.engine.output.sampling import Sampler
from gateway.engine.parity.prefill_speed import PrefillSpeed, StepTimer
from gateway.engine.parity.shadow import ShadowVerifier
from gateway.engine.scheduling.jobs import Job
from gateway.engine.scheduling.loop_failures import (
    error_after_forward,
    is_out_of_memory,
    out_of_memory,
    release_memory,
    why_stopped,
)
from gateway.engine.scheduling.loop_records import ActiveRequest, LoopCounters, LoopSettings
from gateway.engine.scheduling.preemption import resume_tokens, suspend
from gateway.engine.scheduling.request_blocks import RequestBlocks
from gateway.engine.scheduling.scheduler import Scheduler, StepPlan
from tiers.page_pool import PagePool, PoolExhausted
from tiers.payload import KVBlock

logger = logging.getLogger(__name__)


class StepLoop:
    """Runs admitted requests step by step on one worker thread.

    Args:
        loaded: the model (its tokenizer, layout and EOS ids).
        forward: runs one step's rows (batched and invariant, or the serial route).
        scheduler: admission and step plans.
        cache: the prefix cache (None: nothing is read or stored).
        settings: the loop's settings.
        namespace_of: the namespace of a scope.
        clock: monotonic time (deadlines, TTFT).
        metrics: where generations are recorded.
        tails: where conversation tails are kept (None: none are; only where decoding writes
            the K/V a prefill writes).
        shadow: verifies sampled cache hits cold while the loop is idle (None: none).
        pool: the pages requests' KV lives in (the device tier's, where it has them).
    """

    def __init__(self, *, loaded: LoadedModel, forward: StepForward, scheduler: Scheduler,
                 cache: PrefixCache | None, settings: LoopSettings, pool: PagePool,
                 namespace_of: Callable[[Scope], Namespace],
                 clock: Callable[[], float] = time.monotonic,
                 metrics: EngineMetrics | None = None, tails: TailCache | None = None,
                 shadow: ShadowVerifier | None = None) -> None:
        self._loaded = loaded
        self._forward = forward
        self._pool = pool
        self._scheduler = scheduler
        self._cache = cache
        self._shadow = shadow
        self._blocks = None if cache is None else RequestBlocks(
            cache=cache, forward=forward, settings=settings, namespace_of=namespace_of,
            tails=tails, shadow=shadow)
        self._settings = settings
        self._namespace_of = namespace_of
        self._clock = clock
        self._metrics = metrics
        self._device = loaded.device
        self._inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting: dict[int, Job] = {}
        self._active: dict[int, ActiveRequest] = {}
        self._prefill_timer = StepTimer(self._device, PrefillSpeed(
            step_tokens=scheduler.limits.prefill_step_tokens))
        self._thread: threading.Thread | None = None
        self._is_stopping = False
        self._counters = LoopCounters()
        self._parked: dict[int, list[Job]] = {}  # request id -> jobs waiting for its blocks
        self._preempted: dict[int, ActiveRequest] = {}  # queued again, to resume from
        self._is_dead = False  # the worker died: nothing submitted will ever run

    # ---- called from other threads ------------------------------------------------------

    def start(self) -> None:
        """Serve on a thread of the loop's own."""
        self._thread = threading.Thread(target=self._run, name="kvgate-engine", daemon=True)
        self._thread.start()

    def serve_here(self) -> None:
        """Serve on the calling thread until stopped.

        NOTE: torch runs the forward fastest on the thread that first ran it: after a forward
        on another thread (the start-up probe on the main thread), a step of the tiny test model
        took 6.6 ms instead of 2.2 ms here (two OpenMP teams contending for 2 cores). The engine
        therefore probes and serves on one thread.
        """
        self._thread = threading.current_thread()
        self._run()

    @property
    def counters(self) -> LoopCounters:
        return self._counters

    @property
    def prefill_speed(self) -> PrefillSpeed:
        return self._prefill_timer.speed

    @property
    def forward(self) -> StepForward:
        return self._forward

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            num_parked = sum(len(jobs) for jobs in self._parked.values())
            return len(self._waiting) + len(self._active) + num_parked + self._inbox.qsize()

    def submit(self, job: Job, *, prompt_tokens: int, kv_bytes: int) -> None:
        """Queue ``job`` (the scheduler's limits apply now, so a refusal reaches the caller).

        Raises:
            QueueFull: a queue limit is reached.
        """
        with self._lock:
            if self._is_dead:
                raise EngineDraining("the engine's worker has stopped; retry on another replica")
            request = job.request
            self._scheduler.submit(
                job.id, tenant=job.tenant, prompt_tokens=prompt_tokens, kv_bytes=kv_bytes,
                priority=request.priority if isinstance(request, GenerateRequest) else 0,
                is_preemptible=isinstance(request, GenerateRequest))
            self._waiting[job.id] = job
            self._note_queue_depth()
        self._inbox.put(job)

    def cancel_all(self) -> None:
        with self._lock:
            parked = [job for jobs in self._parked.values() for job in jobs]
            for job in [*self._waiting.values(), *(a.job for a in self._active.values()),
                        *parked]:
                job.cancelled.set()

    def fail_outstanding(self, error: GatewayError) -> None:
        """The worker died: refuse new submissions, and fail every job it will never run (their
        callers would otherwise wait forever)."""
        with self._lock:
            self._is_dead = True
            parked = [job for jobs in self._parked.values() for job in jobs]
            jobs = [*self._waiting.values(), *(a.job for a in self._active.values()), *parked]
            self._waiting.clear()
            self._parked.clear()
        for job in jobs:
            if not job.done.is_set():
                self._fail(job, error)

    def stop(self, timeout_s: float) -> None:
        """Stop the worker once nothing is in flight (``cancel_all`` first to hurry it)."""
        self._is_stopping = True
        self._inbox.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout_s)
            self._thread = None

    # ---- the worker ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                is_idle = not self._active and not self._waiting
            if is_idle and self._is_stopping:
                break
            if is_idle and self._shadow is not None and self._shadow.has_work:
                self._shadow.advance()  # one chunk of idle capacity, then look again
                continue
            if is_idle:
                self._inbox.get()  # sleep until a submission (or stop) arrives
            while True:  # the inbox only wakes the loop: jobs are in _waiting already
                try:
                    self._inbox.get_nowait()
                except queue.Empty:
                    break
            try:
                self._turn()
            except Exception as exc:  # fail what runs, keep serving
                error: BaseException
                if is_out_of_memory(exc):
                    logger.warning("a step of %d requests ran out of memory on %s: they are "
                                   "refused, the engine goes on", len(self._active), self._device)
                    error = out_of_memory(self._device, f"a step of {len(self._active)} requests",
                                          exc)
                else:  # a bug
                    logger.exception("engine step failed")
                    error = RuntimeError("internal error in the engine step")
                for active in list(self._active.values()):
                    self._end(active, error)
                release_memory(self._device)

    def _turn(self) -> None:
        self._expire()
        with self._lock:
            preempted = self._scheduler.preemptions()
        for request_id in preempted:
            self._preempt(self._active[request_id])
        with self._lock:
            admitted = self._scheduler.admit()
            jobs = [self._waiting.pop(i) for i in admitted]
            self._note_queue_depth()
        for job in jobs:
            if self._metrics is not None and job.id not in self._preempted:
                self._metrics.record_queue_wait(self._clock() - job.submitted)
            self._admit(job)
        with self._lock:
            plan = self._scheduler.plan(self._prefill_timer.s_per_token)
        if plan.chunks:
            self._step(plan)

    def _expire(self) -> None:
        now = self._clock()
        with self._lock:
            late = [j for j in self._waiting.values() if j.cancelled.is_set() or now > j.deadline]
            for job in late:
                del self._waiting[job.id]
                self._preempted.pop(job.id, None)
                self._scheduler.finish(job.id)
        for job in late:
            self._fail(job, why_stopped(job))
        for active in list(self._active.values()):
            if not active.job.usage_sent and (active.job.cancelled.is_set()
                                              or now > active.job.deadline):
                self._end(active, why_stopped(active.job))

    def _admit(self, job: Job) -> None:
        """Lease and load the cached prefix, and build the request's KV buffers.

        A request whose prompt shares full blocks that another running request is prefilling
        right now waits for them (parked, computing nothing) and is admitted again once they
        are stored, so concurrent requests for one new prefix compute it once.
        """
        preempted = self._preempted.get(job.id)
        tokens = job.tokens if preempted is None else resume_tokens(preempted)
        computing = None if self._blocks is None else self._blocks.computing_shared_blocks(
            job, tokens, self._active.values())
        if computing is not None:
            with self._lock:
                self._scheduler.hold(job.id)
                self._parked.setdefault(computing, []).append(job)
            self._counters = replace(self._counters,
                                     num_dedup_waits=self._counters.num_dedup_waits + 1)
            return
        self._preempted.pop(job.id, None)
        bt = self._settings.block_tokens
        request = job.request
        stack = ExitStack()
        try:
            if isinstance(request, GenerateRequest):
                capacity = len(job.tokens) + request.sampling.max_tokens
                target = len(tokens)
                max_blocks = (len(tokens) - 1) // bt
                use_cache = self._cache is not None and not request.cache.no_cache
                ttl = request.cache.ttl_s
            else:
                target = len(tokens) // bt * bt
                capacity = max(1, target)
                max_blocks = None
                use_cache = True
                ttl = request.ttl_s
            active = ActiveRequest(
                job=job, seq=KVSequence.unallocated(self._pool), tokens=tokens,
                ids=torch.from_numpy(tokens.astype(np.int64)), target=target, stack=stack,
                ttl_s=ttl if ttl is not None else self._settings.default_ttl_s)
            blocks: list[KVBlock] = []
            tail: list[KVBlock] = []
            if use_cache and self._blocks is not None:
                prefix = self._blocks.lease(job, stack, max_blocks,
                                            self._prefill_timer.s_per_token, tokens)
                active.take_prefix(prefix)
                blocks = prefix.blocks
                tail = self._blocks.find_tail(active, blocks)
            active.seq = KVSequence.from_blocks(self._pool, blocks + tail, capacity)
            active.loaded_blocks = blocks
            if preempted is not None:
                active.carry_on(preempted)
            elif isinstance(request, GenerateRequest):
                active.sampler = Sampler(request.sampling,
                                         vocab_size=self._loaded.tokenizer.vocab_size)
                active.detok = Detokenizer(self._loaded.tokenizer, request.sampling.stop)
        except Exception as exc:
            if is_out_of_memory(exc):
                logger.warning("admitting a request ran out of memory on %s", self._device)
                exc = out_of_memory(self._device, "this request's KV", exc)
                release_memory(self._device)
            elif not isinstance(exc, GatewayError):
                logger.exception("admitting a request failed")
            stack.close()
            with self._lock:
                self._scheduler.finish(job.id)
            self._fail(job, exc)
            return
        self._active[job.id] = active
        seq = active.seq  # it writes its own pages only: the shared ones are the cache's
        with self._lock:
            self._scheduler.skip_prefill(job.id, seq.length)
            self._scheduler.shrink_kv(job.id, self._pool.page_nbytes * (
                seq.pages_for(self._pool, capacity) - seq.num_pages + seq.num_own_pages))
        if active.seq.length >= active.target:
            try:
                self._prompt_done(active, None)
            except Exception as exc:
                self._fail_alone(active, exc)

    def _wake_parked(self, request_id: int) -> None:
        """Admit again the requests that waited for ``request_id``'s prompt blocks."""
        with self._lock:
            parked = self._parked.pop(request_id, [])
        for job in parked:
            with self._lock:
                self._scheduler.unhold(job.id)
            if job.cancelled.is_set() or self._clock() > job.deadline:
                with self._lock:
                    self._scheduler.finish(job.id)
                self._preempted.pop(job.id, None)
                self._fail(job, why_stopped(job))
                continue
            self._admit(job)

    def _preempt(self, active: ActiveRequest) -> None:
        """Queue ``active`` again, its K/V handed to the cache, to resume where it stopped
        (``gateway.engine.scheduling.preemption``); a better-priority request of its tenant takes
        its room."""
        job = active.job
        try:
            suspend(active, self._blocks)
        except Exception as exc:  # storing its blocks failed: it ends, its room is freed
            self._fail_alone(active, exc)
            return
        del self._active[job.id]
        self._preempted[job.id] = active
        with self._lock:
            self._scheduler.preempt(job.id, prompt_tokens=len(resume_tokens(active)))
            self._waiting[job.id] = job
        self._wake_parked(job.id)  # what they waited for is stored, or is theirs to compute
        self._counters = replace(self._counters,
                                 num_preemptions=self._counters.num_preemptions + 1)
        if self._metrics is not None:
            self._metrics.record_preemption()

    def _step(self, plan: StepPlan) -> None:
        batch: list[SequenceRows] = []
        chunks = []
        for chunk in plan.chunks:
            active = self._active[chunk.request_id]
            try:  # its pages for the step, before the shared forward
                active.seq.prepare(chunk.num_tokens)
            except PoolExhausted as exc:
                self._fail_alone(active, exc)
                continue
            chunks.append(chunk)
            if chunk.is_decode:
                assert active.next_token is not None
                tokens = torch.tensor([active.next_token])
                wants = True
            else:
                start = active.seq.length
                tokens = active.ids[start:start + chunk.num_tokens]
                wants = (start + chunk.num_tokens >= active.target
                         and isinstance(active.job.request, GenerateRequest))
            batch.append(SequenceRows(sequence=active.seq, tokens=tokens, wants_logits=wants,
                                      is_decode=chunk.is_decode))
        num_decode = sum(1 for c in plan.chunks if c.is_decode)
        if num_decode:
            outputs = self._forward.forward(batch)
        else:  # a prefill-only step: what the recompute yardstick learns from
            with self._prefill_timer.step(plan.num_tokens):
                outputs = self._forward.forward(batch)
        if self._metrics is not None:
            self._metrics.record_step(num_requests=len(plan.chunks), num_tokens=plan.num_tokens)
        counters = self._counters
        self._counters = replace(
            counters, num_steps=counters.num_steps + 1,
            num_prefill_tokens=counters.num_prefill_tokens + plan.num_tokens - num_decode,
            num_decode_tokens=counters.num_decode_tokens + num_decode,
            max_sequences_in_step=max(counters.max_sequences_in_step, len(plan.chunks)))
        for chunk, logits in zip(chunks, outputs, strict=True):
            active = self._active[chunk.request_id]
            try:
                if chunk.is_decode:
                    assert logits is not None
                    self._next_token(active, logits)
                elif active.seq.length >= active.target:
                    self._prompt_done(active, logits)
            except Exception as exc:  # this request's own fault: the step goes on
                self._fail_alone(active, exc)

    def _prompt_done(self, active: ActiveRequest, logits: torch.Tensor | None) -> None:
        """Store the prompt's new blocks; a warm ends here. A generation's first token goes out
        before (its client does not wait for a long prompt's placement and demotions) and its
        answer ends after (a client holding the final message finds the prompt cached)."""
        job = active.job
        finish: FinishReason | None = None
        if isinstance(job.request, GenerateRequest):
            assert logits is not None, "a generation's last prompt token always wants logits"
            finish = self._sample(active, logits)
        if self._blocks is not None:
            self._blocks.store_prompt_blocks(active)
        self._wake_parked(job.id)
        if isinstance(job.request, WarmRequest):
            self._finish_warm(active)
            return
        with self._lock:
            self._scheduler.start_decoding(job.id)
        if finish is not None:
            self._finish_generate(active, finish)

    def _next_token(self, active: ActiveRequest, logits: torch.Tensor) -> None:
        finish = self._sample(active, logits)
        if finish is not None:
            self._finish_generate(active, finish)

    def _sample(self, active: ActiveRequest, logits: torch.Tensor) -> FinishReason | None:
        """Pick and send the next token; why the answer ends there, or None (it goes on)."""
        job = active.job
        request = job.request
        assert isinstance(request, GenerateRequest)
        assert active.sampler is not None and active.detok is not None
        token = active.sampler.pick(logits)
        active.generated.append(token)
        now = self._clock()
        if active.ttft_ms is None:
            active.ttft_ms = (now - job.submitted) * 1e3
        elif self._metrics is not None and active.last_token_at is not None:
            self._metrics.record_inter_token(now - active.last_token_at)
        active.last_token_at = now
        finish: FinishReason | None = None
        if token in self._loaded.eos_token_ids:
            finish = "eos"
        else:
            text = active.detok.add(token)
            job.events.put(TokenDelta(token_ids=(token,), text=text))
            if active.detok.stopped:
                finish = "stop"
            elif len(active.generated) >= request.sampling.max_tokens:
                finish = "length"
        if finish is None:
            active.next_token = token
        return finish

    def _finish_generate(self, active: ActiveRequest, finish: FinishReason) -> None:
        job = active.job
        request = job.request
        assert isinstance(request, GenerateRequest) and active.detok is not None
        tail = active.detok.finish()
        if tail:
            job.events.put(TokenDelta(token_ids=(), text=tail))
        usage = Usage(
            prompt_tokens=len(job.tokens),
            cached_tokens=sum(active.cached_by_tier.values()),
            cached_tokens_by_tier=dict(active.cached_by_tier),
            completion_tokens=len(active.generated),
            ttft_ms=active.ttft_ms if active.ttft_ms is not None else 0.0,
            total_ms=(self._clock() - job.submitted) * 1e3,
            finish_reason=finish,
            lossy=active.lossy,
            stored_tokens=active.stored_new * self._settings.block_tokens,
        )
        settings = self._settings
        storing = (self._blocks if settings.store_generated_blocks and active.generated
                   else None)
        if storing is not None and settings.decode_kv_is_prefill_kv:
            # Stored as decoded (no compute): before the final message, so that a client holding
            # it finds the answer's blocks.
            storing.store_answer(active)
        job.events.put(usage)
        job.usage_sent = True
        if self._metrics is not None:
            self._metrics.record_generation(
                tenant=request.scope.owner, prompt_tokens=usage.prompt_tokens,
                cached_tokens_by_tier=usage.cached_tokens_by_tier,
                finish_reason=usage.finish_reason, ttft_s=usage.ttft_ms / 1e3,
                total_s=usage.total_ms / 1e3, completion_tokens=usage.completion_tokens,
                lossy=usage.lossy)
        if (storing is not None and not settings.decode_kv_is_prefill_kv
                and settings.recompute_generated_blocks):
            storing.store_answer(active)  # recomputed first: after the answer is out
        self._end(active, None)

    def _finish_warm(self, active: ActiveRequest) -> None:
        job = active.job
        request = job.request
        assert isinstance(request, WarmRequest) and self._cache is not None
        bt = self._settings.block_tokens
        num_full = active.target // bt
        num_cached = len(active.loaded_blocks)
        if request.pin and active.namespace is not None:
            self._cache.set_pinned(active.namespace, job.tokens, True, keep=False)
        fresh_bytes = active.stored_new * self._loaded.layout.block_nbytes(bt)
        job.warm_result = WarmResult(
            prompt_tokens=len(job.tokens), num_blocks=num_full,
            num_new_blocks=active.stored_new, num_cached_blocks=num_cached,
            stored_bytes=fresh_bytes, elapsed_ms=(self._clock() - job.submitted) * 1e3)
        self._end(active, None)

    def _end(self, active: ActiveRequest, error: BaseException | None) -> None:
        self._active.pop(active.job.id, None)
        self._wake_parked(active.job.id)
        active.seq.release()  # its buffers go now, whatever still holds the request
        try:
            active.stack.close()
        finally:
            with self._lock:
                self._scheduler.finish(active.job.id)
                self._note_queue_depth()
            if error is not None:
                self._fail(active.job, error)
            else:
                active.job.done.set()

    def _fail_alone(self, active: ActiveRequest, exc: Exception) -> None:
        """End ``active`` alone with ``exc``, raised after the forward (``error_after_forward``);
        one ended already (its own end raised) has its outcome: it is only released again."""
        job = active.job
        error = error_after_forward(exc, self._device, job.id)
        self._end(active, None if job.done.is_set() else error)

    def _fail(self, job: Job, exc: BaseException) -> None:
        if self._metrics is not None and job.kind == "generate" and not job.usage_sent:
            self._metrics.record_failure(exc)
        job.error = exc
        job.events.put(exc)
        job.done.set()

    def _note_queue_depth(self) -> None:  # and the KV bytes the running requests hold
        if self._metrics is not None:
            self._metrics.set_queue_depth(self._scheduler.num_waiting)
            num_bytes, num_tokens = self.kv_held()
            self._metrics.set_kv_in_use(num_bytes, num_tokens=num_tokens)

    @property
    def num_running(self) -> int:
        """Requests the scheduler has admitted and not finished (a len(): any thread)."""
        return self._scheduler.num_running

    def kv_held(self) -> tuple[int, int]:
        """The bytes of the pages the running requests' tables list, and the tokens in them,
        a page shared by several (a cached prefix) counted once (``distinct_held``)."""
        num_pages, num_tokens = distinct_held(
            [(active.seq.page_ids, active.seq.length) for active in list(self._active.values())],
            self._pool.page_tokens)
        return num_pages * self._pool.page_nbytes, num_tokens
