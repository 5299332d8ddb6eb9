"""``[limits]``: what one API key may hold of the gateway, checked after its key and before work.

docs/reliability.md, threat 5: a call that is admitted before its key is checked lets anyone without
a key take the server's slots (64 header-only calls locked keyed calls and health checks out of
an earlier kvgate). So admission is per key, after authentication, and these are its bounds
(``gateway.service.admission`` enforces them, for the gRPC front and any other front alike):

- calls in flight, all keys together (each holds one worker thread) and per key;
- Lookups in flight (they tokenise on the caller's thread), all keys and per key, and a
  Lookup rate per key (a token bucket: ``lookups_per_s`` sustained, ``lookup_burst`` at once);
- Warm calls in flight per key (a warm computes whole prompts).

Prompt size limits (characters, messages) bound the work before the chat template is rendered
or anything is tokenised (``gateway.core.prompt_limits``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True, kw_only=True)
class LimitSettings:
    """Per-key admission and request-size bounds.

    Attributes:
        max_calls: calls in flight, all keys together; each holds one worker thread, and the
            worker pool has exactly this many, so an admitted call never waits for a thread.
        max_calls_per_key: calls one key may have in flight (one key cannot take the others'
            threads); more get RESOURCE_EXHAUSTED at once.
        max_lookups: Lookups in flight, all keys together.
        max_lookups_per_key: Lookups one key may have in flight.
        lookups_per_s: Lookups one key may start per second, sustained.
        lookup_burst: Lookups one key may start at once after a quiet period.
        max_warms_per_key: Warm calls one key may have in flight.
        max_prompt_chars: characters of one prompt (message contents, raw prompt and tool
            schemas together), checked before the chat template is rendered.
        max_messages: messages of one prompt.
    """

    max_calls: int = 64
    max_calls_per_key: int = 16
    max_lookups: int = 8
    max_lookups_per_key: int = 4
    lookups_per_s: float = 50.0
    lookup_burst: int = 100
    max_warms_per_key: int = 2
    max_prompt_chars: int = 262_144
    max_messages: int = 512

    def problems(self) -> list[str]:
        errors = []
        for f in fields(self):
            value = getattr(self, f.name)
            is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if f.name == "lookups_per_s":
                if not (is_number and math.isfinite(value) and value > 0):
                    errors.append(f"limits.{f.name} must be a number > 0, got {value!r}")
            elif not (is_number and isinstance(value, int) and value >= 1):
                errors.append(f"limits.{f.name} must be an integer >= 1, got {value!r}")
        if errors:
            return errors
        if self.max_calls_per_key > self.max_calls:
            errors.append("limits.max_calls_per_key must be <= limits.max_calls")
        if self.max_lookups_per_key > self.max_lookups:
            errors.append("limits.max_lookups_per_key must be <= limits.max_lookups")
        if self.max_lookups >= self.max_calls:
            errors.append("limits.max_lookups must be < limits.max_calls, so that Lookups "
                          "never take every worker thread")
        return errors
