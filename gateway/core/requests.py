"""The records that cross the engine's boundary: what a request asks, what comes back.

The gRPC servicer translates protobuf messages into these (validating at the edge) and the
engine's results back; nothing below the servicer sees protobuf, and nothing above the engine
sees tensors or the index.

Errors the engine raises for a request (see ``gateway.core.errors``)::

    InvalidRequest           INVALID_ARGUMENT: the request can never succeed as sent
    QueueFull                RESOURCE_EXHAUSTED: too many requests waiting; retry later
    RequestCancelled         CANCELLED: the client went away
    DeadlineExceeded         DEADLINE_EXCEEDED: the request's deadline passed
    EngineDraining           UNAVAILABLE: shutting down; retry on another replica
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from gateway.core.canonical import PromptInput
from gateway.core.fingerprint import Scope
from gateway.core.sessions import session_problems
from gateway.core.tags import tag_problems

FinishReason = Literal["stop", "length", "eos", "cancelled", "deadline"]

MAX_NEW_TOKENS_LIMIT = 8192
"""The most tokens one request may ask to generate (the model's context bounds it further)."""

MIN_PRIORITY = -1000
MAX_PRIORITY = 1000
"""The range of a generation's ``priority`` (vLLM's meaning: lower is served first; 0 by
default). vLLM bounds it by nothing but an integer; kvgate bounds it so that the wire's int32
(and a JSON number) cannot carry a value no deployment means, and so that a client learns at once
that a time stamp or a request count is not a priority."""

MIN_SAMPLING_TEMPERATURE = 1e-5
"""The smallest temperature that samples; a smaller positive one is greedy, as 0 is.

NOTE: dividing float32 logits by a temperature near float32's smallest numbers (1e-38 and
below, denormals, values that round to 0) gives infinities, and softmax then NaN: the review of
issue 22 sent ``temperature = 1e-45``. Far above that, at 1e-5, two logits must lie within 1e-4
of each other for the second to keep even 1e-4 of the first's probability, so sampling there is
greedy in all but name; vLLM draws the same line (``_SAMPLING_EPS``). Refusing such values
instead would break OpenAI clients that send a tiny temperature to mean "deterministic"."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` is greedy (the default).

    Every value ``problems()`` accepts can be computed: a temperature below
    ``MIN_SAMPLING_TEMPERATURE`` is greedy (``is_greedy``), and top-p keeps at least the most
    likely token however small it is.

    Attributes:
        max_tokens: most tokens to generate (1..MAX_NEW_TOKENS_LIMIT).
        temperature: 0 for greedy, else in (0, 10]; below ``MIN_SAMPLING_TEMPERATURE`` (1e-5)
            it is greedy too (seed, top_p and top_k then change nothing).
        top_p: nucleus sampling mass in (0, 1]; the most likely token is always kept.
        top_k: keep the k most likely tokens; 0 keeps all.
        seed: seed of this request's own random generator (None: a fresh random seed).
        stop: strings that end generation when they appear in the output (not included).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    @property
    def is_greedy(self) -> bool:
        """Whether the next token is the argmax of the logits (no sampling, no generator)."""
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    def problems(self) -> list[str]:
        """Every out-of-range field, as messages a person can act on (empty if valid)."""
        errors = []
        if not 1 <= self.max_tokens <= MAX_NEW_TOKENS_LIMIT:
            errors.append(f"max_tokens must be between 1 and {MAX_NEW_TOKENS_LIMIT}, "
                          f"got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= 10):
            errors.append(f"temperature must be between 0 and 10, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            errors.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            errors.append(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            errors.append("seed must be in [0, 2**63)")
        if len(self.stop) > 16 or any(not s or len(s) > 256 for s in self.stop):
            errors.append("stop takes at most 16 non-empty strings of at most 256 characters")
        return errors


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheOptions:
    """What the cache may do with this request.

    Attributes:
        no_cache: nothing of this request is read from or stored in any tier.
        ttl_s: sliding TTL of the blocks this request stores (None: the server's default).
        session_id: the conversation this request belongs to, in its tenant
            (``gateway.core.sessions``): the blocks only that session uses are its own, and
            leave with it (None: no session).
        allow_lossy: the request may read lossy (quantized) copies of its prefix where no
            exact copy is cached (docs/design.md, "Lossy tiers"); its answer is then not the
            model's own (``Usage.lossy``) and what it stores stays in the lossy namespace.
        tag: an operator's name for the blocks of this request's prompt (``gateway.core.tags``),
            recorded on them where they are stored, for ``evict(tag=...)`` (None: no tag).
    """

    no_cache: bool = False
    ttl_s: float | None = None
    session_id: str | None = None
    allow_lossy: bool = False
    tag: str | None = None

    def problems(self, *, is_shared: bool) -> list[str]:
        """Every field a request cannot be served with, as messages a person can act on
        (empty if valid); ``is_shared``: the request is in the shared scope."""
        problems = ttl_problems(self.ttl_s)
        if self.session_id is not None:
            problems += session_problems(self.session_id, no_cache=self.no_cache,
                                         is_shared=is_shared)
        if self.tag is not None:
            problems += tag_problems(self.tag, no_cache=self.no_cache)
        return problems


def ttl_problems(ttl_s: float | None) -> list[str]:
    """What is wrong with a request's ``ttl_s`` ([] if nothing: None is the server's default)."""
    if ttl_s is None or (math.isfinite(ttl_s) and ttl_s > 0):
        return []
    return [f"ttl_s must be a positive number of seconds, got {ttl_s}"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateRequest:
    prompt: PromptInput
    scope: Scope
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache: CacheOptions = field(default_factory=CacheOptions)
    deadline: float | None = None
    """Absolute time on ``time.monotonic`` after which the request is abandoned."""
    priority: int = 0
    """Lower is served first, within the tenant's own fair share and never across tenants
    (``MIN_PRIORITY``..``MAX_PRIORITY``; docs/design.md, "Priority lanes")."""


def priority_problem(priority: int) -> str | None:
    """Why ``priority`` is not accepted, as a message a person can act on (None: accepted)."""
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        return (f"priority must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY} (lower is "
                f"served first; 0 by default), got {priority}")
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenDelta:
    """Newly generated tokens and the text they complete (may be empty mid-character)."""

    token_ids: tuple[int, ...]
    text: str


SHARED_SCOPE_TIER = "shared"
"""What ``cached_tokens_by_tier`` says, instead of a tier, for tokens a tenant's request got
from the shared scope: which tier holds a shared block depends on what *other* tenants used
recently, so naming it would tell one tenant about the others (docs/reliability.md, threat 1)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    """The final message of a generation.

    ``cached_tokens_by_tier`` maps a tier name (``device``, ``host``, ``disk``, ``redis``) to
    the tokens served from it, or ``SHARED_SCOPE_TIER`` to those a tenant's request got from the
    shared scope (its tier withheld). A tier that served lossy copies is named with their
    format (``disk:int8``), and then ``lossy`` is true: the answer was computed on quantized
    K/V, not the model's own (promise 1 does not hold for it).

    ``stored_tokens`` counts the prompt's tokens in the full blocks this request stored in the
    cache (new blocks only: none that it found cached, none of its answer's), what Anthropic's
    ``cache_creation_input_tokens`` reports; 0 with ``no_cache`` or where the cache refused them.
    """

    prompt_tokens: int
    cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    completion_tokens: int
    ttft_ms: float
    total_ms: float
    finish_reason: FinishReason
    lossy: bool = False
    stored_tokens: int = 0
    request_id: str = ""
    """The id a later Lookup may name (``previous_request_id``): set by the gRPC service for a
    chat prompt, read back by the client; the engine leaves it empty."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmRequest:
    prompt: PromptInput
    scope: Scope
    pin: bool = False
    ttl_s: float | None = None
    deadline: float | None = None
    tag: str | None = None
    """Recorded on the prompt's blocks where they are stored (``CacheOptions.tag``)."""

    def problems(self) -> list[str]:
        """Every field the warm cannot be served with (empty if valid)."""
        problems = ttl_problems(self.ttl_s)
        if self.tag is not None:
            problems += tag_problems(self.tag, no_cache=False)
        return problems


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmResult:
    prompt_tokens: int
    num_blocks: int
    num_new_blocks: int
    num_cached_blocks: int
    stored_bytes: int
    elapsed_ms: float


@dataclass(frozen=True, slots=True, kw_only=True)
class LookupRequest:
    prompt: PromptInput
    scope: Scope
    allow_lossy: bool = False
    """Count the lossy copies continuing the exact prefix too (as a Generate allowing them)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptComparison:
    """A prompt compared with an earlier request of the same tenant, by the parts each sent
    (gRPC ``PromptComparison``; ``gateway.service.miss_diagnosis`` makes it).

    Attributes:
        previous_known: False where the earlier request is unknown to the caller's tenant
            (never made, another tenant's, or forgotten); nothing else is then said.
        changed_part: the first part that differs (``model``, ``prompt_cache_key``, ``tools``,
            ``system``, ``messages``); None where the prompt repeats or only appends to it.
        first_changed_message: with ``messages``, the index after the system messages of the
            first message that differs.
        common_tokens: the prompt's tokens before the changed part.
        first_differing_block: the block holding the first token after them (the first that
            may differ); None where nothing departs.
        previous_cached_tokens: the tokens the earlier request left in the cache.
        missed_tokens: about how many of those the prompt cannot read because of the change.
    """

    previous_known: bool
    changed_part: str | None = None
    first_changed_message: int | None = None
    common_tokens: int = 0
    first_differing_block: int | None = None
    previous_cached_tokens: int = 0
    missed_tokens: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class LookupResult:
    """How much of a prompt is cached in the caller's scope; nothing computed.

    ``cached_tokens_by_tier`` as in ``Usage``: a hit in the shared scope is reported under
    ``SHARED_SCOPE_TIER``, never under the tier that holds it.
    """

    prompt_tokens: int
    cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    num_prompt_blocks: int
    diverges_at_block: int | None
    diverges_at_token: int | None
    text_around_divergence: str
    lossy: bool = False
    comparison: PromptComparison | None = None
    """With ``previous_request_id`` (over gRPC): the prompt compared with that request."""
