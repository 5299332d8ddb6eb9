"""What the scheduler side tells the worker side each step, and what the worker tells back.

Why plain records of their own: vLLM's scheduler and its model runner are separate processes on
its CPU build, and a connector's two halves speak only through the picklable metadata vLLM
carries between them each step (docs/vllm-worker.md, "How it works"). The
scheduler decides everything that needs the request -- its scope, which blocks to load, when
its prompt's blocks are whole -- and the worker only moves bytes; these records are the whole
conversation, testable (and pickled in tests) without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.base import BlockKey


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadOrder:
    """Fill vLLM's blocks ``block_ids`` with the cached blocks of ``tokens`` under ``scope``.

    Attributes:
        request_id: vLLM's request id (the worker's report names it).
        scope: the scope's text (``scope_tag.scope_text``).
        tokens: the prefix whose blocks are loaded, from the prompt's first token: whole
            blocks, ``first_block + len(block_ids)`` of them.
        first_block: the blocks before it are vLLM's own hit: matched, not copied.
        block_ids: vLLM's block for each block from ``first_block`` on, in order.
    """

    request_id: str
    scope: str
    tokens: tuple[int, ...]
    first_block: int = 0
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveOrder:
    """Store the request's whole blocks computed so far, from vLLM's ``block_ids``.

    Attributes:
        request_id: vLLM's request id.
        scope: the scope's text.
        tokens: the request's whole blocks, prompt then answer (from its first token).
        block_ids: vLLM's block of each of them, in order.
    """

    request_id: str
    scope: str
    tokens: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StepOrders:
    """One step's loads (run before the forward) and saves (after it)."""

    loads: tuple[LoadOrder, ...] = ()
    saves: tuple[SaveOrder, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """How one load order went: blocks filled, and vLLM's blocks left to recompute."""

    num_loaded: int
    failed_block_ids: tuple[int, ...]


@dataclass(slots=True)
class WorkerReport:
    """What the worker's cache learnt in a step, for the scheduler's view of the keys.

    Attributes:
        stored: keys the worker's cache holds after saving (new or already there).
        lost: keys a load expected and did not find or could not verify.
        loads: each load order's outcome, by request id.
    """

    stored: set[BlockKey] = field(default_factory=set)
    lost: set[BlockKey] = field(default_factory=set)
    loads: dict[str, LoadOutcome] = field(default_factory=dict)

    def merge(self, other: WorkerReport) -> WorkerReport:
        """Both reports as one (vLLM aggregates its workers' reports; one worker here)."""
        return WorkerReport(stored=self.stored | other.stored, lost=self.lost | other.lost,
                            loads={**self.loads, **other.loads})

    def is_empty(self) -> bool:
        return not (self.stored or self.lost or self.loads)
