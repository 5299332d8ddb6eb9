"""A conversation tail that carries its recurrent layers' states (issue 46).

Why a record of its own: a tail (``gateway.engine.kv.tail_cache``) ends inside a block, where no
block keeps a recurrent layer's state (``gateway.engine.forward.kept_states`` keeps them at block
ends), so a tail of a model with recurrent layers takes its states at its end along. Kept apart
from the tail cache so that a sequence (``KVSequence.from_blocks``) reads it without importing
the cache's index.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tiers.payload import KVBlock


@dataclass(frozen=True, slots=True)
class StatefulTail(KVBlock):
    """A tail of a model with recurrent layers: its K/V, and each recurrent layer's state at
    its end (opaque here: ``gateway.engine.forward.recurrent``'s records), which no block keeps
    -- a tail ends inside a block. It lives in the engine's memory only, never in a tier; a
    sequence built with it last (``KVSequence.from_blocks``) starts from these states.

    Attributes:
        states: each recurrent layer's state at the tail's end, by layer index.
        states_nbytes: the bytes they hold (counted in the tail's ``nbytes``).
    """

    states: Mapping[int, object] = field(default_factory=dict)
    states_nbytes: int = 0

    def __post_init__(self) -> None:
        KVBlock.__post_init__(self)
        object.__setattr__(self, "_nbytes", self._nbytes + self.states_nbytes)

    @classmethod
    def of(cls, kv: KVBlock, states: Mapping[int, object], states_nbytes: int) -> StatefulTail:
        """``kv`` (a fresh copy) with ``states`` of ``states_nbytes`` bytes."""
        return cls(keys=kv.keys, values=kv.values, quantization=kv.quantization,
                   packed=kv.packed, states=dict(states), states_nbytes=states_nbytes)
