"""Who runs in the next step, and how many tokens each computes: fair across tenants, bounded.

The scheduler is pure bookkeeping: it sees request ids, tenants and how many prompt tokens each
still has to prefill, never tensors or the model. Each ``plan`` returns a ``StepPlan`` (a record,
docs/design.md "The engine"): one decode row for every running request that is decoding, then
prefill chunks from the step's remaining token budget, shared across tenants by deficit — the
tenant that received the fewest tokens so far goes first — so one tenant's long prompts cannot
starve another's. Admission is bounded per tenant (running and queued) and in total, and by the
KV memory the running requests need.

Fair shares of what is scarce (issue 22): the KV budget and the running slots.

- **A hard share per tenant.** One tenant's running requests reserve at most
  ``max_kv_share_per_tenant`` of ``kv_budget_bytes`` and run at most ``max_running_per_tenant``
  at once; a request beyond its tenant's share queues behind that tenant's own. A tenant with
  nothing running may always start one request, however large (up to the whole budget), so a
  request larger than a share is served, alone if need be, and never deadlocks.
  NOTE: a tenant alone does not borrow the rest. A running request is preempted only for a
  better-priority request of its own tenant (below), never for another tenant's, so bytes lent to
  a lone tenant would come back only when its requests end — minutes, for long generations — and
  a tenant arriving meanwhile would wait that long (what the review saw: one tenant's six long
  completions held the whole budget, another's small chat waited past 90 s). The share left free
  is what lets a newcomer start at once. A single-tenant deployment sets the share to 1.0, as it
  raises ``max_running_per_tenant`` to ``max_running``.
- **Who goes next: the tenant holding least** (dominant resource fairness, Ghodsi et al. 2011):
  among tenants whose head request is within their share, the one whose larger fraction —
  of the KV budget or of the running slots — is smallest, ties to the one served least
  recently. If that
  request does not fit what is free now, admission stops: the next bytes freed are its, and no
  other tenant's queued request overtakes it. So a tenant that waits is admitted as soon as
  enough running requests end, before a flooding tenant's queued ones, and a large request is
  not starved by a stream of small ones; the cost is that nothing slips past it meanwhile.
- **Prefill steps while others wait.** ``prefill_step_tokens`` (large steps while nothing
  decodes, cut to what takes ``max_lone_step_s`` at the measured prefill speed, so that a tenant
  arriving during one waits at most that long) applies only while one tenant alone has
  requests in the engine; with two or more,
  steps keep to ``step_tokens``, so a newcomer's first chunk waits at most one step of the
  flood's, and the deficit order gives it the next step. That step grows to hold the whole of
  the neediest request's prompt when it fits ``prefill_step_tokens``: a newcomer's short chat
  is prefilled in one step instead of several shared with the flood (kvgate bench fairness,
  this 2-core machine: the quiet tenant's TTFT p50 flooded / alone went from 1.72-2.04x to
  1.12-1.18x).
- **A prompt ends in a step of its own.** Once a step holds a prompt's last tokens and
  ``prompt_ends_alone_from`` prompt tokens in all, it takes no other prompt's tokens: four chat
  turns arriving together get their first tokens after one, two, three and four steps of one
  turn each, instead of all four after one step four turns long (on a CPU a step of a turn's
  tens of tokens is compute-bound, so the steps apart cost about what the one step did).

Priority lanes (issue 28; docs/design.md, "Priority lanes"): a request's ``priority`` (vLLM's
meaning, lower first) orders it among its own tenant's requests only — which of them is admitted
next, which prefills first, and, when its tenant's next request in line does not fit (a slot, the
tenant's share or the KV budget), which of the tenant's running requests with a worse priority
are preempted to make room: the worst first, the latest among equals (``preemptions``). Which
tenant goes next is decided exactly as without priorities, so no priority, however low, moves one
tenant ahead of another or takes anything another tenant holds. A preempted request queues again
at its place (its priority, its first arrival); the step loop keeps its K/V in the cache and
resumes it as a hit on its own tokens. While a tenant alone runs requests of more than one
priority, steps keep to ``step_tokens``: a better-priority request then waits for its first token.
So they do while it runs only background work (a priority above the default 0): its foreground
requests may arrive at any moment, and a step in flight cannot be interrupted, so the step's
length is what such a request waits before its own prompt is prefilled.

In serial mode (``ScheduleLimits.is_serial``: the start-up probe found the batched forward not
invariant) one request runs at a time and its prefill chunks end at block boundaries, which
keeps warm equal to cold on the transformers route (docs/design.md, "Parity": today's route).
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterable
from dataclasses import dataclass, field

from gateway.core.errors import QueueFull


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleLimits:
    """The bounds of the step loop.

    Attributes:
        step_tokens: tokens computed per step at most (decode rows and prefill chunks).
        prefill_step_tokens: tokens computed per step at most while no request is decoding
            and one tenant alone has requests in the engine: then no one waits for a next
            token, and a larger chunk prefills faster (measured: 2,048 tokens in chunks of
            1,024 took 1.05x transformers' one shot, in chunks of 256 1.22x). Never less than
            ``step_tokens``.
        max_lone_step_s: how long such a large step may take at the engine's measured prefill
            speed (``plan``'s ``s_per_token``): a tenant arriving during it waits for it to end
            before its own prompt is prefilled (issue 44: another tenant's first token waited
            4.2-4.6 s behind a flood's 1,024-token steps on 2 cores). None: no bound.
        max_running: requests running at once, all tenants together.
        max_running_per_tenant: requests one tenant runs at once.
        max_queued_per_tenant: requests one tenant may have waiting; more are refused.
        max_queued: requests waiting, all tenants together; more are refused.
        kv_budget_bytes: KV bytes the running requests' own pages may hold together (pages
            they share with the cache are the cache's).
        max_kv_share_per_tenant: the fraction of ``kv_budget_bytes`` one tenant's running
            requests may hold, in (0, 1]; a tenant with nothing running may still start one
            request of any size.
        is_serial: one request at a time, prefill chunks ending at ``block_tokens`` boundaries.
        block_tokens: the cache block size (the chunk boundary in serial mode).
        can_preempt: running requests may be preempted for a better-priority request of their
            tenant (only where a preempted request resumes to the same answer: decoding writes
            the K/V a prefill writes, ``gateway.engine.scheduling.loop``).
        prompt_ends_alone_from: a step in which a request's prompt ends, holding this many
            prompt tokens or more, takes no other request's prompt tokens: prompts that arrive
            together get their first tokens one step after another instead of all after one
            long step (a step of that many rows is already compute-bound on a CPU, so little
            is lost by taking them apart). 0: prompts share steps up to the budget.
    """

    step_tokens: int = 256
    prefill_step_tokens: int = 1024
    max_running: int = 16
    max_running_per_tenant: int = 8
    max_queued_per_tenant: int = 32
    max_queued: int = 64
    kv_budget_bytes: int = 2 << 30
    max_kv_share_per_tenant: float = 0.5
    is_serial: bool = False
    block_tokens: int = 64
    can_preempt: bool = True
    max_lone_step_s: float | None = 1.0
    prompt_ends_alone_from: int = 32

    def __post_init__(self) -> None:
        for name in ("step_tokens", "prefill_step_tokens", "max_running",
                     "max_running_per_tenant",
                     "max_queued_per_tenant", "max_queued", "kv_budget_bytes", "block_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.max_kv_share_per_tenant <= 1:
            raise ValueError("max_kv_share_per_tenant must be in (0, 1], got "
                             f"{self.max_kv_share_per_tenant}")
        if self.prompt_ends_alone_from < 0:
            raise ValueError("prompt_ends_alone_from must be >= 0, got "
                             f"{self.prompt_ends_alone_from}")
        if self.max_lone_step_s is not None and not self.max_lone_step_s > 0:
            raise ValueError(f"max_lone_step_s must be > 0, got {self.max_lone_step_s}")

    def lone_step_tokens(self, s_per_token: float | None) -> int:
        """A lone tenant's prefill step: ``prefill_step_tokens``, cut to what takes
        ``max_lone_step_s`` at ``s_per_token`` (never below ``step_tokens``)."""
        if self.max_lone_step_s is None or not s_per_token or s_per_token <= 0:
            return max(self.step_tokens, self.prefill_step_tokens)
        timed = int(self.max_lone_step_s / s_per_token)
        return max(self.step_tokens, min(self.prefill_step_tokens, timed))

    @property
    def kv_bytes_per_tenant(self) -> int:
        """KV bytes one tenant's running requests may hold (beyond its first request)."""
        return int(self.kv_budget_bytes * self.max_kv_share_per_tenant)


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledChunk:
    """Tokens one request computes in a step.

    Attributes:
        request_id: the request.
        num_tokens: how many of its next tokens (1 for a decode row).
        is_decode: a decode row (its token was sampled in the previous step).
    """

    request_id: int
    num_tokens: int
    is_decode: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPlan:
    """What one forward computes: decode rows first, then prefill chunks."""

    chunks: tuple[ScheduledChunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)


@dataclass(slots=True, kw_only=True)
class _Entry:
    request_id: int
    tenant: str
    kv_bytes: int
    prefill_left: int
    priority: int = 0
    arrival: int = 0
    reserved_bytes: int = 0  # what it reserves when admitted (``kv_bytes`` shrinks after)
    is_preemptible: bool = True
    is_decoding: bool = False
    prefilled: int = 0
    is_held: bool = False

    @property
    def rank(self) -> tuple[int, int]:
        """Its place among its tenant's requests: better priority first, then earlier arrival."""
        return self.priority, self.arrival


@dataclass(slots=True)
class _TenantQueue:
    waiting: list[_Entry] = field(default_factory=list)  # in ``rank`` order
    num_running: int = 0
    kv_bytes: int = 0
    tokens_given: int = 0
    last_admitted: int = -1


class Scheduler:
    """Queues per tenant, the running set, and the plan of each step.

    Args:
        limits: the bounds.
    """

    def __init__(self, limits: ScheduleLimits) -> None:
        self._limits = limits
        self._tenants: dict[str, _TenantQueue] = {}
        self._running: dict[int, _Entry] = {}
        self._num_waiting = 0
        self._kv_bytes = 0
        self._num_admitted = 0
        self._num_submitted = 0

    @property
    def limits(self) -> ScheduleLimits:
        return self._limits

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def kv_bytes_in_use(self) -> int:
        """KV buffer bytes the running requests reserve (at most ``kv_budget_bytes``)."""
        return self._kv_bytes

    @property
    def running_ids(self) -> list[int]:
        return list(self._running)

    def submit(self, request_id: int, *, tenant: str, prompt_tokens: int, kv_bytes: int,
               priority: int = 0, is_preemptible: bool = True) -> None:
        """Queue a request that must prefill ``prompt_tokens`` tokens, behind its tenant's
        requests of a better or equal ``priority`` (lower is better).

        Raises:
            QueueFull: the tenant's or the server's queue limit is reached (the message names it).
            ValueError: the request alone needs more KV than the whole budget.
        """
        limits = self._limits
        if kv_bytes > limits.kv_budget_bytes:
            raise ValueError(f"the request needs {kv_bytes} bytes of KV buffers, more than the "
                             f"engine's whole KV budget of {limits.kv_budget_bytes} bytes")
        known = self._tenants.get(tenant)
        if known is not None and len(known.waiting) >= limits.max_queued_per_tenant:
            raise QueueFull(f"this tenant already has {limits.max_queued_per_tenant} requests "
                            "waiting (max_queued_per_tenant); retry when some have finished")
        if self._num_waiting >= limits.max_queued:
            raise QueueFull(f"{limits.max_queued} requests are already waiting (max_queued); "
                            "retry shortly")
        # NOTE: a tenant is known only once a request of its is queued: a refused newcomer left
        # behind would count as a second tenant in the engine (``plan``'s step size) forever.
        state = self._tenants.setdefault(tenant, _TenantQueue())
        insort(state.waiting, _Entry(
            request_id=request_id, tenant=tenant, kv_bytes=kv_bytes, reserved_bytes=kv_bytes,
            prefill_left=prompt_tokens, priority=priority, arrival=self._num_submitted,
            is_preemptible=is_preemptible), key=_rank)
        self._num_submitted += 1
        self._num_waiting += 1

    def admit(self) -> list[int]:
        """Move waiting requests to running, the tenant holding least first, within every bound.

        Returns:
            The ids admitted, in order.
        """
        limits = self._limits
        admitted: list[int] = []
        max_running = 1 if limits.is_serial else limits.max_running
        while len(self._running) < max_running:
            tenant = self._next_tenant(max_running)
            if tenant is None:
                break
            state = self._tenants[tenant]
            entry = state.waiting[0]
            if self._kv_bytes + entry.kv_bytes > limits.kv_budget_bytes:
                break  # the bytes freed next are this tenant's: no one overtakes it
            state.waiting.pop(0)
            self._num_waiting -= 1
            state.num_running += 1
            state.kv_bytes += entry.kv_bytes
            self._kv_bytes += entry.kv_bytes
            self._running[entry.request_id] = entry
            admitted.append(entry.request_id)
            state.last_admitted = self._num_admitted
            self._num_admitted += 1
        return admitted

    def _next_tenant(self, max_running: int, *, preempting: bool = False) -> str | None:
        """The tenant whose head request goes next: within its own share, holding least.

        Ties go to the tenant served least recently (one never served first, in arrival order):
        round-robin among equals, and a tenant that waited through another's admission is not
        passed over again when both hold nothing. With ``preempting``, a tenant beyond its own
        share counts as within it when preempting its own worse-priority requests makes room
        for its head (``_victims``); how much it holds is what it holds now either way.
        """
        limits = self._limits
        chosen: str | None = None
        least = (0.0, 0)
        for tenant, state in self._tenants.items():
            if not state.waiting:
                continue
            head = state.waiting[0]
            if state.num_running >= limits.max_running_per_tenant or (
                    state.num_running
                    and state.kv_bytes + head.kv_bytes > limits.kv_bytes_per_tenant):
                # Beyond its share: it queues behind its own running requests, unless it may
                # preempt some of them.
                if not preempting or not self._victims(state, head, max_running):
                    continue
            held = max(state.kv_bytes / limits.kv_budget_bytes, state.num_running / max_running)
            if chosen is None or (held, state.last_admitted) < least:
                chosen, least = tenant, (held, state.last_admitted)
        return chosen

    def preemptions(self) -> list[int]:
        """The running requests to preempt now so that the next request in line fits.

        The next in line is the head of the tenant ``admit`` would serve next (holding least),
        counting a tenant beyond its share whose head outranks some of its own running
        requests. Only that tenant's requests of a worse priority than its head are listed, the
        worst first and the latest among equals, as few as make the head fit every bound (its
        tenant's slots and share, the running slots and the KV budget); none when it fits
        already or when preempting all of them would not make it fit. The caller preempts each
        (``preempt``) before the next ``admit``.
        """
        if not self._limits.can_preempt:
            return []
        max_running = 1 if self._limits.is_serial else self._limits.max_running
        tenant = self._next_tenant(max_running, preempting=True)
        if tenant is None:
            return []
        state = self._tenants[tenant]
        return [entry.request_id for entry in self._victims(state, state.waiting[0],
                                                            max_running) or ()]

    def _victims(self, state: _TenantQueue, head: _Entry, max_running: int) -> list[_Entry] | None:
        """What ``preemptions`` lists for ``head`` of ``state``: [] if it fits as things are,
        None if it would not fit even with every request it outranks preempted."""
        limits = self._limits
        outranked = sorted((e for e in self._running.values()
                            if e.tenant == head.tenant and e.is_preemptible and not e.is_held
                            and e.priority > head.priority),
                           key=_rank, reverse=True) if limits.can_preempt else []
        victims: list[_Entry] = []
        freed = 0
        for victim in (None, *outranked):
            if victim is not None:
                victims.append(victim)
                freed += victim.kv_bytes
            mine = state.num_running - len(victims)
            if (len(self._running) - len(victims) < max_running
                    and mine < limits.max_running_per_tenant
                    and (mine == 0
                         or state.kv_bytes - freed + head.kv_bytes <= limits.kv_bytes_per_tenant)
                    and self._kv_bytes - freed + head.kv_bytes <= limits.kv_budget_bytes):
                return victims
        return None

    def preempt(self, request_id: int, *, prompt_tokens: int) -> None:
        """Move a running request back to its tenant's queue, at its place (its priority, its
        first arrival), reserving in full again; resumed, it prefills ``prompt_tokens`` (its
        prompt and what it has generated: the step loop skips what the cache kept of them)."""
        entry = self._running.pop(request_id)
        state = self._tenants[entry.tenant]
        state.num_running -= 1
        state.kv_bytes -= entry.kv_bytes
        self._kv_bytes -= entry.kv_bytes
        entry.kv_bytes = entry.reserved_bytes
        entry.prefill_left, entry.prefilled = prompt_tokens, 0
        entry.is_decoding = entry.is_held = False
        insort(state.waiting, entry, key=_rank)
        self._num_waiting += 1

    def cancel_waiting(self, request_id: int) -> bool:
        """Drop a request that has not started; whether it was waiting."""
        for state in self._tenants.values():
            for entry in state.waiting:
                if entry.request_id == request_id:
                    state.waiting.remove(entry)
                    self._num_waiting -= 1
                    self._forget_if_idle(entry.tenant, state)
                    return True
        return False

    def waiting_ids(self) -> list[int]:
        return [e.request_id for s in self._tenants.values() for e in s.waiting]

    def skip_prefill(self, request_id: int, num_tokens: int) -> None:
        """Count ``num_tokens`` of a running request's prompt as done (loaded from the cache)."""
        entry = self._running[request_id]
        entry.prefill_left = max(0, entry.prefill_left - num_tokens)
        entry.prefilled += num_tokens

    def plan(self, s_per_token: float | None = None) -> StepPlan:
        """The next step: every decoding request's row, then prefill chunks by deficit;
        ``s_per_token``: the engine's prefill speed so far (None before its first figure), which
        bounds a lone tenant's large steps in time (``ScheduleLimits.max_lone_step_s``)."""
        limits = self._limits
        chunks: list[ScheduledChunk] = []
        for entry in self._running.values():
            if entry.is_decoding:
                chunks.append(ScheduledChunk(request_id=entry.request_id, num_tokens=1,
                                             is_decode=True))
        # One tenant alone, in one lane that is not background work: no one waits for a step.
        lanes = {e.priority for e in self._running.values()}
        is_alone = len(self._tenants) <= 1 and len(lanes) <= 1 and max(lanes, default=0) <= 0
        prefilling = [e for e in self._running.values()
                      if not e.is_decoding and not e.is_held and e.prefill_left]
        by_need = sorted(prefilling, key=lambda e: (self._tenants[e.tenant].tokens_given,
                                                    *e.rank))
        step = limits.step_tokens
        if is_alone and not chunks:
            step = limits.lone_step_tokens(s_per_token)
        elif (by_need and not limits.is_serial
              and len(chunks) + by_need[0].prefill_left <= limits.prefill_step_tokens):
            # The neediest request (fewest tokens given to its tenant: a newcomer beside a
            # flood) finishes its prompt in this step when the whole of it fits a large step:
            # its first token then waits for one step, not several shared with the flood.
            step = max(step, len(chunks) + by_need[0].prefill_left)
        budget = step - len(chunks)
        prompt_tokens = 0
        for entry in by_need:
            if budget <= 0:
                break
            size = min(entry.prefill_left, budget)
            if limits.is_serial:
                boundary = (entry.prefilled // limits.block_tokens + 1) * limits.block_tokens
                size = min(size, boundary - entry.prefilled) if not chunks else 0
            if size <= 0:
                continue
            chunks.append(ScheduledChunk(request_id=entry.request_id, num_tokens=size,
                                         is_decode=False))
            budget -= size
            prompt_tokens += size
            if (size == entry.prefill_left and limits.prompt_ends_alone_from
                    and prompt_tokens >= limits.prompt_ends_alone_from):
                break  # its first token comes after this step: the next prompt's own step
        if limits.is_serial and len({c.request_id for c in chunks}) > 1:
            chunks = chunks[:1]
        for chunk in chunks:
            entry = self._running[chunk.request_id]
            self._tenants[entry.tenant].tokens_given += chunk.num_tokens
            if not chunk.is_decode:
                entry.prefill_left -= chunk.num_tokens
                entry.prefilled += chunk.num_tokens
        return StepPlan(chunks=tuple(chunks))

    def shrink_kv(self, request_id: int, kv_bytes: int) -> None:
        """A running request needs only ``kv_bytes`` of its reservation (admitted on a hit, it
        shares the cached prefix's pages instead of writing them): the rest is free again."""
        entry = self._running[request_id]
        freed = entry.kv_bytes - max(0, kv_bytes)
        if freed <= 0:
            return
        entry.kv_bytes -= freed
        self._tenants[entry.tenant].kv_bytes -= freed
        self._kv_bytes -= freed

    def hold(self, request_id: int) -> None:
        """Plan nothing for a running request until ``unhold`` (it waits for others' blocks)."""
        self._running[request_id].is_held = True

    def unhold(self, request_id: int) -> None:
        self._running[request_id].is_held = False

    def start_decoding(self, request_id: int) -> None:
        """The request's prompt is done and its first token sampled: one row per step from now."""
        self._running[request_id].is_decoding = True

    def finish(self, request_id: int) -> None:
        """The request left (done, failed or cancelled): free its slot and KV budget."""
        entry = self._running.pop(request_id, None)
        if entry is None:
            self.cancel_waiting(request_id)
            return
        state = self._tenants[entry.tenant]
        state.num_running -= 1
        state.kv_bytes -= entry.kv_bytes
        self._kv_bytes -= entry.kv_bytes
        self._forget_if_idle(entry.tenant, state)

    def _forget_if_idle(self, tenant: str, state: _TenantQueue) -> None:
        """Forget a tenant with nothing running or waiting: its prefill deficit starts afresh
        when it comes back, and it is first among equals at its next admission."""
        if not state.waiting and state.num_running == 0:
            del self._tenants[tenant]

    def tenants_running(self) -> Iterable[str]:
        return {e.tenant for e in self._running.values()}


def _rank(entry: _Entry) -> tuple[int, int]:
    return entry.rank
