"""The scheduler side's decisions: how much of a prompt to load, and which blocks to save when.

vLLM's scheduler asks, once a request is about to be scheduled, how many tokens past its own
prefix hit the connector can load (``match``), tells it which blocks it allocated
(``allocated``), and each step asks for the metadata its workers get (``step``). This module
answers from plain values -- the request's token ids, its scope, the step's block ids -- so the
rules are tested without vLLM; ``connector`` only converts vLLM's objects into them.

The rules:

- **Never the whole prompt.** vLLM computes at least the prompt's last token (it needs its
  logits), so a hit is capped at the whole blocks before it: ``(len(prompt) - 1) // block``.
- **Loads are whole blocks** of the prompt in the request's scope's namespace, as far as the
  worker's cache is believed to hold them (``known_keys``), past vLLM's own hit.
- **A block is saved once, by the step that computes it**: a prompt's whole blocks as its
  prefill (or each chunk of it) runs, then each block the answer fills, so a conversation's
  next turn finds the previous answer too. Only blocks whose every token id the scheduler
  knows (``tokens_of``) are named; the worker skips those the cache holds already (the loaded
  ones among them).
- A request whose scope is None (the default scope ``none``, no valid tag) is neither loaded
  nor saved.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.core.fingerprint import BlockFingerprinter, Namespace, Scope
from gateway.core.tokens import as_token_ids
from gateway.vllm_connector.known_keys import KnownKeys
from gateway.vllm_connector.orders import LoadOrder, SaveOrder, StepOrders, WorkerReport
from gateway.vllm_connector.scope_tag import scope_text
from policies.base import BlockKey


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledNew:
    """A request scheduled for the first time in a step (or again, after a preemption).

    Attributes:
        request_id: vLLM's id.
        block_ids: every vLLM block the request holds.
        num_computed_tokens: tokens already in its blocks before the step (vLLM's own hit and
            the connector's load).
        num_scheduled_tokens: tokens the step computes.
    """

    request_id: str
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledRunning:
    """A request that ran before, scheduled again.

    Attributes:
        request_id: vLLM's id.
        new_block_ids: blocks added this step; after a preemption, every block it holds.
        resumed: it was preempted and resumes.
        num_computed_tokens: tokens in its blocks before the step.
        num_scheduled_tokens: tokens the step computes.
    """

    request_id: str
    new_block_ids: tuple[int, ...]
    resumed: bool
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass(slots=True)
class _Request:
    scope: Scope
    tokens: tuple[int, ...]
    keys: list[BlockKey]
    block_ids: list[int] = field(default_factory=list)
    num_hit_blocks: int = 0
    """Blocks promised to vLLM by the last ``match`` (past vLLM's own hit)."""
    num_own_blocks: int = 0
    """Blocks vLLM's own prefix cache had (``num_computed_tokens`` at ``match``)."""
    is_load_pending: bool = False
    num_saved_blocks: int = 0
    """Blocks already ordered saved (from the first)."""
    num_ordered_blocks: int = 0
    """Blocks the worker was told to load (the worker's report on them can come after the
    request finished: vLLM reads a step's connector output after it frees the finished)."""
    num_failed_blocks: int = 0


class LoadPlanner:
    """The scheduler side's book of requests and the worker's keys.

    Args:
        block_tokens: vLLM's block size (kvgate's block).
        namespace_of: a scope's namespace.
        known: the worker's keys, as far as the scheduler can tell.
    """

    def __init__(self, *, block_tokens: int, namespace_of: Callable[[Scope], Namespace],
                 known: KnownKeys) -> None:
        self._block_tokens = block_tokens
        self._namespace_of = namespace_of
        self._fingerprinters: dict[Scope, BlockFingerprinter] = {}
        self._known = known
        self._requests: dict[str, _Request] = {}

    def match(self, request_id: str, prompt: Sequence[int], scope: Scope | None, *,
              num_computed_tokens: int) -> int:
        """Tokens past ``num_computed_tokens`` (vLLM's own hit, whole blocks) that the worker
        will load for the request: 0 for a scope of None, a miss, or nothing past vLLM's hit."""
        if scope is None:
            self._requests.pop(request_id, None)
            return 0
        request = self._requests.get(request_id)
        if request is None or request.scope != scope:
            tokens = tuple(prompt)
            request = _Request(scope=scope, tokens=tokens,
                               keys=self._fingerprinter(scope).block_keys(as_token_ids(tokens)))
            self._requests[request_id] = request
        cap = max(0, (len(request.tokens) - 1) // self._block_tokens)
        own = num_computed_tokens // self._block_tokens
        held = self._known.count_leading(
            request.keys[:cap], namespace_digest=self._fingerprinter(scope).namespace.digest)
        request.num_own_blocks = own
        request.num_hit_blocks = max(0, held - own)
        request.is_load_pending = False
        return request.num_hit_blocks * self._block_tokens

    def allocated(self, request_id: str, num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks and will take ``num_external_tokens`` from the
        connector (the step names the blocks)."""
        request = self._requests.get(request_id)
        if request is None:
            return
        if num_external_tokens <= 0:
            request.num_hit_blocks = 0
            return
        request.num_hit_blocks = min(request.num_hit_blocks,
                                     num_external_tokens // self._block_tokens)
        request.is_load_pending = request.num_hit_blocks > 0

    def step(self, new: Sequence[ScheduledNew], running: Sequence[ScheduledRunning], *,
             tokens_of: Callable[[str], Sequence[int]] | None = None) -> StepOrders:
        """The worker's orders for one step; ``tokens_of`` gives a request's token ids so far
        (prompt and answer: vLLM's ``Request.all_token_ids``; None: the prompt's alone)."""
        loads: list[LoadOrder] = []
        saves: list[SaveOrder] = []
        for item in new:
            request = self._requests.get(item.request_id)
            if request is None:
                continue
            request.block_ids = list(item.block_ids)
            self._order(item.request_id, request, item.num_computed_tokens,
                        item.num_scheduled_tokens, loads, saves, tokens_of)
        for running_item in running:
            request = self._requests.get(running_item.request_id)
            if request is None:
                continue
            if running_item.resumed:
                request.block_ids = list(running_item.new_block_ids)
            else:
                request.block_ids.extend(running_item.new_block_ids)
            self._order(running_item.request_id, request, running_item.num_computed_tokens,
                        running_item.num_scheduled_tokens, loads, saves, tokens_of)
        return StepOrders(loads=tuple(loads), saves=tuple(saves))

    def absorb(self, report: WorkerReport) -> None:
        """What the worker's cache learnt: its keys, and how each load went."""
        self._known.forget(report.lost)
        self._known.remember(report.stored)
        for request_id, outcome in report.loads.items():
            request = self._requests.get(request_id)
            if request is not None:
                request.num_failed_blocks += len(outcome.failed_block_ids)

    def finished(self, request_id: str) -> dict[str, int] | None:
        """Forget the request; what the connector did for it (tokens loaded, blocks that
        failed to load and were recomputed), for its output's ``kv_transfer_params``."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        # A load that fails makes vLLM recompute, so a finished request has had every report
        # of a failed load; the loads of its last step are the ones that succeeded.
        num_loaded = max(0, request.num_ordered_blocks - request.num_failed_blocks)
        return {"kvgate.loaded_tokens": num_loaded * self._block_tokens,
                "kvgate.failed_blocks": request.num_failed_blocks}

    def _order(self, request_id: str, request: _Request, num_computed: int,
               num_scheduled: int, loads: list[LoadOrder], saves: list[SaveOrder],
               tokens_of: Callable[[str], Sequence[int]] | None) -> None:
        bt = self._block_tokens
        scope = scope_text(request.scope)
        if request.is_load_pending:
            request.is_load_pending = False
            first, end = request.num_own_blocks, request.num_own_blocks + request.num_hit_blocks
            if end <= len(request.block_ids):
                request.num_ordered_blocks += end - first
                loads.append(LoadOrder(request_id=request_id, scope=scope,
                                       tokens=request.tokens[:end * bt], first_block=first,
                                       block_ids=tuple(request.block_ids[first:end])))
        # Blocks whose every token's K/V exists once this step has run.
        num_whole = min((num_computed + num_scheduled) // bt, len(request.block_ids))
        if num_whole <= request.num_saved_blocks:
            return
        tokens = request.tokens if tokens_of is None else tokens_of(request_id)
        num_whole = min(num_whole, len(tokens) // bt)
        if num_whole <= request.num_saved_blocks:
            return
        request.num_saved_blocks = num_whole
        saves.append(SaveOrder(request_id=request_id, scope=scope,
                               tokens=tuple(tokens[:num_whole * bt]),
                               block_ids=tuple(request.block_ids[:num_whole])))

    def _fingerprinter(self, scope: Scope) -> BlockFingerprinter:
        fingerprinter = self._fingerprinters.get(scope)
        if fingerprinter is None:
            fingerprinter = BlockFingerprinter(self._namespace_of(scope), self._block_tokens)
            self._fingerprinters[scope] = fingerprinter
        return fingerprinter
