"""The soak's pinned prefixes: pinned on every replica before the load, never unpinned, and
checked at the end (issue 44's target: "0 pinned blocks lost from the disk tier across kill -9
and restarts; after a Redis restart without persistence, pinned blocks are served again ... and
never wrong").

Their system prompts share no block with the families' (``workload.PINNED_PREFIX``: their
headings differ from the first token), so the load's own pins and unpins, which act on the
families' system prompts, never touch them; the load asks their chats like any other prompt.
The end check kills each replica (-9) and restarts it on its data -- its memory tiers are then
empty, so a lookup answers from disk, or from Redis, or not at all -- and then, for every
pinned prefix: a lookup of it must find all its full blocks on the disk tier, and its chat
must be served warm and equal to the cold answer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gateway.bench.soak.processes import SoakReplica
from gateway.bench.soak.workload import SoakPrompt, answer_of
from gateway.client import KvgateClient, KvgateError


@dataclass(frozen=True, slots=True, kw_only=True)
class PinCheck:
    """One pinned prefix on one replica at the end.

    Attributes:
        prompt: the catalogue prompt whose system prompt was pinned.
        replica: the replica that pinned it.
        pinned_tokens: its full blocks' tokens, as pinned before the load.
        disk_tokens: the tokens of it a lookup found on the disk tier after the replica's
            last kill -9 and restart (the other tiers' in ``tiers``).
        tiers: the lookup's cached tokens by tier.
        served_tokens: the chat's cached tokens (by any tier).
        is_equal: the chat's answer is the cold answer.
        error: why the check could not be made (a failed call), else "".
        was_restarted: the replica was killed and restarted by a fault during the load, after
            it pinned the prefix (as well as by the check itself). Pins are kept over restarts
            (``gateway.cache.pins``), so this explains nothing away: a prefix not kept fails
            the run wherever it was lost.
    """

    prompt: str
    replica: str
    pinned_tokens: int
    disk_tokens: int = 0
    tiers: Mapping[str, int] | None = None
    served_tokens: int = 0
    is_equal: bool = False
    error: str = ""
    was_restarted: bool = False

    @property
    def is_kept(self) -> bool:
        """Held on the disk tier whole, served warm, and equal to the cold answer."""
        return (not self.error and self.disk_tokens >= self.pinned_tokens
                and self.served_tokens >= self.pinned_tokens and self.is_equal)


def pin_all(replicas: Sequence[SoakReplica], prompts: Sequence[SoakPrompt], *, api_key: str,
            admin_key: str, tenant: str, deadline_s: float) -> dict[tuple[str, str], int]:
    """Warm and pin each prompt's system prompt on every replica; (prompt, replica) -> the
    tokens pinned (its full blocks).

    Raises:
        KvgateError: a replica refused (the soak cannot start without its pins).
    """
    pinned = {}
    for replica in replicas:
        assert replica.port is not None
        with KvgateClient("127.0.0.1", replica.port, api_key=api_key,
                          timeout_s=deadline_s) as client, \
                KvgateClient("127.0.0.1", replica.port, api_key=admin_key,
                             timeout_s=deadline_s) as admin:
            for prompt in prompts:
                system = prompt.messages[:1]
                client.warm(messages=system, add_generation_prompt=False)
                admin.pin(messages=system, add_generation_prompt=False, tenant=tenant)
                looked = client.lookup(messages=system, add_generation_prompt=False)
                pinned[(prompt.name, replica.name)] = looked.cached_tokens
    return pinned


def check_all(replicas: Sequence[SoakReplica], prompts: Sequence[SoakPrompt],
              pinned: Mapping[tuple[str, str], int], *, api_key: str,
              cold: Mapping[str, tuple[int, ...]], max_tokens: int, deadline_s: float,
              log: Callable[[str], None]) -> list[PinCheck]:
    """Kill (-9) and restart each replica on its data, then check its pinned prefixes."""
    found = []
    for replica in replicas:
        was_restarted = replica.num_starts > 1
        replica.kill()
        replica.start()
        log(f"[soak] {replica.name} killed (-9) and restarted for the pinned-blocks check")
        assert replica.port is not None
        with KvgateClient("127.0.0.1", replica.port, api_key=api_key,
                          timeout_s=deadline_s) as client:
            for prompt in prompts:
                want = pinned[(prompt.name, replica.name)]
                try:
                    looked = client.lookup(messages=prompt.messages[:1],
                                           add_generation_prompt=False)
                    tokens, usage = answer_of(client, prompt, max_tokens=max_tokens)
                except KvgateError as exc:
                    found.append(PinCheck(prompt=prompt.name, replica=replica.name,
                                          pinned_tokens=want, error=exc.code.name,
                                          was_restarted=was_restarted))
                    continue
                found.append(PinCheck(
                    prompt=prompt.name, replica=replica.name, pinned_tokens=want,
                    disk_tokens=looked.cached_tokens_by_tier.get("disk", 0),
                    tiers=dict(looked.cached_tokens_by_tier),
                    served_tokens=usage.cached_tokens, is_equal=tuple(tokens) == cold[prompt.name],
                    was_restarted=was_restarted))
    return found
