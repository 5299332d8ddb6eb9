"""What the soak's clients send: a fixed catalogue of prompts (chats under shared system
prompts, long documents) and a mix of request kinds over them, each sent with a deadline, each
ending in one ``Outcome``."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gateway.bench.chat_workload import question, system_prompt
from gateway.client import KvgateClient, KvgateError, NotFound, ResourceExhausted
from gateway.core.requests import Usage

FAMILY_HEADINGS = ("Northwind support desk", "Harbour Bank help line", "Juniper Clinic front desk")
"""Each family's system prompt differs from the others' from its first token."""
PINNED_HEADINGS = ("Lighthouse archive reading room", "Orchard co-op order desk")
"""The pinned prefixes' system prompts (``gateway.bench.soak.pins``): differing from every
family's from the first token, so no block of theirs is one the load pins or unpins."""
PINNED_PREFIX = "pinned-"


@dataclass(frozen=True, slots=True)
class SoakPrompt:
    """One prompt of the catalogue: its chat messages, by a stable name."""

    name: str
    messages: tuple[Mapping[str, str], ...]


def catalogue(*, families: int, questions: int, num_rules: int) -> list[SoakPrompt]:
    """Chats (a family's system prompt and one question) and long documents (the system prompt
    three times over, then a question), and the pinned prefixes' chats (``PINNED_HEADINGS``):
    every prompt an answer is checked against."""
    prompts = []
    for family in range(families):
        system = f"{FAMILY_HEADINGS[family % len(FAMILY_HEADINGS)]}.\n{system_prompt(num_rules)}"
        for q in range(questions):
            prompts.append(SoakPrompt(f"chat-{family}-{q}", (
                {"role": "system", "content": system},
                {"role": "user", "content": question(q, 0, num_rules)})))
        prompts.append(SoakPrompt(f"long-{family}", (
            {"role": "system", "content": "\n\n".join([system] * 3)},
            {"role": "user", "content": question(family, 1, num_rules)})))
    for index, heading in enumerate(PINNED_HEADINGS):
        prompts.append(SoakPrompt(f"{PINNED_PREFIX}{index}", (
            {"role": "system", "content": f"{heading}.\n{system_prompt(num_rules)}"},
            {"role": "user", "content": question(index, 2, num_rules)})))
    return prompts


def pinned_prompts(prompts: Sequence[SoakPrompt]) -> list[SoakPrompt]:
    """The catalogue's pinned prefixes' chats."""
    return [p for p in prompts if p.name.startswith(PINNED_PREFIX)]


KIND_WEIGHTS: Mapping[str, int] = {
    "chat": 8, "session": 3, "priority": 2, "long": 2, "lossy": 1, "disconnect": 1,
    "prewarm": 1, "pin": 1, "evict": 1, "reset_session": 1}
"""How often each kind of request is sent (generations are most of a deployment's calls)."""

CHECKED_KINDS = frozenset({"chat", "session", "priority", "long", "lossy"})
"""The kinds whose answer is compared with the cold one."""


@dataclass(slots=True)
class Outcome:
    """One request's end.

    Attributes:
        kind: which kind of request (``KIND_WEIGHTS``).
        replica: the replica it went to.
        started, ended: wall-clock seconds.
        result: ``ok``, ``wrong`` (an answer that is not the cold one), ``refused``
            (RESOURCE_EXHAUSTED, or NOT_FOUND for a session nobody had), or ``error``.
        error: the error's class (its gRPC status name) where ``result`` is ``error``.
        prompt: the catalogue prompt it sent, if any.
        tiers: cached tokens by tier of a checked answer.
        prompt_tokens: a checked answer's prompt tokens.
        lossy: the answer said it came from lossy copies.
    """

    kind: str
    replica: int
    started: float
    ended: float = 0.0
    result: str = "ok"
    error: str = ""
    prompt: str = ""
    tiers: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    lossy: bool = False


@dataclass(frozen=True, slots=True)
class ClientContext:
    """What a client thread needs: where the replicas are, the keys, the catalogue, the
    cold answers, and the request settings."""

    ports: Callable[[], Sequence[int]]
    api_key: str
    admin_key: str
    tenant: str
    prompts: Sequence[SoakPrompt]
    cold: Mapping[str, tuple[int, ...]]
    max_tokens: int
    deadline_s: float


def run_client(ctx: ClientContext, index: int, stop_at: float,
               record: Callable[[Outcome], None]) -> None:
    """One client thread: requests of random kinds to the replicas in turn until ``stop_at``."""
    rng = random.Random(index)
    kinds = list(KIND_WEIGHTS)
    weights = [KIND_WEIGHTS[k] for k in kinds]
    session = f"soak-{index}"
    turn = 0
    while time.time() < stop_at:
        ports = ctx.ports()
        replica = turn % len(ports)
        turn += 1
        kind = rng.choices(kinds, weights)[0]
        outcome = Outcome(kind=kind, replica=replica, started=time.time())
        with KvgateClient("127.0.0.1", ports[replica], api_key=ctx.api_key,
                          timeout_s=ctx.deadline_s) as client, \
                KvgateClient("127.0.0.1", ports[replica], api_key=ctx.admin_key,
                             timeout_s=ctx.deadline_s) as admin:
            try:
                _send(ctx, client, admin, rng, kind, session, outcome)
            except ResourceExhausted:
                outcome.result = "refused"
            except NotFound:
                outcome.result = "refused" if kind == "reset_session" else "error"
                outcome.error = "" if kind == "reset_session" else "NOT_FOUND"
            except KvgateError as exc:
                outcome.result, outcome.error = "error", exc.code.name
        outcome.ended = time.time()
        record(outcome)


EVICT_IDLE_S = 30.0
"""The load's admin evictions take the tenant's prompts idle this long."""


def evict_idle(admin: KvgateClient, tenant: str) -> None:
    """Evict ``tenant``'s prompts idle ``EVICT_IDLE_S``, one by one by key, except those
    listed as pinned (a pinned block is on their path).

    NOTE: not one eviction of everything the tenant left idle: an operator's eviction takes
    pinned blocks too, and the pinned prefixes (``gateway.bench.soak.pins``) belong to this
    tenant and must be on disk at the end. A prompt another eviction took since the listing is
    no longer there to evict (NotFound), which is no error.
    """
    for listed in admin.list_prefixes(tenant=tenant):
        if listed.is_pinned or listed.idle_s < EVICT_IDLE_S:
            continue
        try:
            admin.evict(key_hex=listed.key_hex, tenant=tenant, older_than_s=EVICT_IDLE_S)
        except NotFound:
            continue


def _send(ctx: ClientContext, client: KvgateClient, admin: KvgateClient, rng: random.Random,
          kind: str, session: str, outcome: Outcome) -> None:
    prompts = [p for p in ctx.prompts if p.name.startswith("long-") == (kind == "long")
               # the load's own pins and unpins leave the pinned prefixes alone
               and not (kind == "pin" and p.name.startswith(PINNED_PREFIX))]
    prompt = rng.choice(prompts)
    outcome.prompt = prompt.name
    if kind == "prewarm":
        client.warm(messages=prompt.messages[:1], add_generation_prompt=False)
    elif kind == "pin":
        admin.pin(messages=prompt.messages[:1], add_generation_prompt=False, tenant=ctx.tenant,
                  unpin=rng.random() < 0.5)
    elif kind == "evict":
        evict_idle(admin, ctx.tenant)
    elif kind == "reset_session":
        admin.reset_session(session, tenant=ctx.tenant)
    elif kind == "disconnect":
        stream = client.generate(messages=prompt.messages, max_tokens=ctx.max_tokens)
        next(iter(stream))
        stream.close()  # the client goes away mid-stream
    else:
        tokens, usage = _answer(client, kind, prompt, session, ctx.max_tokens)
        outcome.tiers = dict(usage.cached_tokens_by_tier)
        outcome.prompt_tokens = usage.prompt_tokens
        outcome.lossy = usage.lossy
        if tuple(tokens) != ctx.cold[prompt.name] and not (kind == "lossy" and usage.lossy):
            outcome.result = "wrong"


def answer_of(client: KvgateClient, prompt: SoakPrompt, *,
              max_tokens: int) -> tuple[list[int], Usage]:
    """A plain chat's greedy tokens and usage."""
    return _answer(client, "chat", prompt, "", max_tokens)


def _answer(client: KvgateClient, kind: str, prompt: SoakPrompt, session: str,
            max_tokens: int) -> tuple[list[int], Usage]:
    tokens: list[int] = []
    usage: Usage | None = None
    for item in client.generate(
            messages=prompt.messages, max_tokens=max_tokens,
            session_id=session if kind == "session" else None,
            priority=-5 if kind == "priority" else None, allow_lossy=kind == "lossy"):
        if isinstance(item, Usage):
            usage = item
        else:
            tokens.extend(item.token_ids)
    assert usage is not None
    return tokens, usage


def cold_answers(port: int, api_key: str, prompts: Sequence[SoakPrompt], max_tokens: int,
                 deadline_s: float) -> dict[str, tuple[int, ...]]:
    """Each prompt's answer computed without the cache (``no_cache``): the oracle."""
    answers = {}
    with KvgateClient("127.0.0.1", port, api_key=api_key, timeout_s=deadline_s) as client:
        for prompt in prompts:
            tokens: list[int] = []
            for item in client.generate(messages=prompt.messages, max_tokens=max_tokens,
                                        no_cache=True):
                if not isinstance(item, Usage):
                    tokens.extend(item.token_ids)
            answers[prompt.name] = tuple(tokens)
    return answers
