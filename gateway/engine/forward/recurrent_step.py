"""A step's rows through a recurrent layer: each sequence from the state it holds, its state at
every block's end kept in that block.

Why per sequence: a recurrent layer's output for a token depends on its own sequence's state,
which no other sequence shares; the layer kinds (``gateway.engine.forward.recurrent``) compute
one sequence's new rows from it, with the same bits however the rows are cut. So a step cuts
each sequence's rows at its block ends, runs each piece from the state the last one left, and
writes the state at each block's end into that block (``gateway.engine.forward.kept_states``): the
block, cached, carries the state a warm start resumes from. Between steps a sequence holds its
state in its slot (``KVSequence.states``); a sequence that holds none there -- built from cached
blocks, or truncated to a block's end -- reads it from its last block.

The layer's products in and out are row-wise, so they multiply every sequence's rows of the
step at once, as the attention's projections do (a row keeps its bits whatever shares the
product); only the part between them -- a convolution over each sequence's window -- runs per
sequence, piece by piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gateway.engine.forward.kept_states import StateRows, state_rows
from gateway.engine.forward.recurrent.layer_state import RecurrentState
from gateway.engine.forward.recurrent.mixers import RECURRENT_MIXERS, RecurrentMixer
from gateway.engine.forward.recurrent.short_conv import ConvWindow
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.linear.row_products import RowProducts
from tiers.payload import KVLayout


@dataclass(frozen=True, slots=True)
class RecurrentLayers:
    """A model's recurrent layers: each one's kind and how its state lies in a block.

    Attributes:
        config: the model's config (transformers' attribute names), which the kinds read.
        kinds: the kind of each recurrent layer, by index.
        rows: how each one's state is laid in its blocks.
    """

    config: Any
    kinds: dict[int, RecurrentMixer]
    rows: dict[int, StateRows]

    @classmethod
    def of(cls, config: Any, mixers: dict[int, str], layout: KVLayout) -> RecurrentLayers:
        """The layers ``mixers`` (kind names by index) of a model with ``config``.

        Raises:
            ValueError: a kind no module computes, or whose state is not kept in blocks.
        """
        unknown = sorted(set(mixers.values()) - set(RECURRENT_MIXERS))
        if unknown:
            raise ValueError(f"recurrent layers of kinds nothing computes: {unknown}")
        one_at_a_time = sorted(name for name in set(mixers.values())
                               if RECURRENT_MIXERS[name].mix is None)
        if one_at_a_time:
            raise ValueError(f"recurrent layers of kinds computed one sequence at a time only: "
                             f"{one_at_a_time}")
        return cls(config, {i: RECURRENT_MIXERS[name] for i, name in mixers.items()},
                   {i: state_rows(config, name, layout) for i, name in mixers.items()})

    def mix(self, index: int, module: Any, normed: torch.Tensor,
            sequences: Sequence[KVSequence], spans: Sequence[tuple[int, int]],
            products: RowProducts, num_shared: int) -> torch.Tensor:
        """Layer ``index``'s output ``[rows, hidden]`` for the step's ``normed`` rows: each
        sequence (its rows at its span) from its own state, which goes to its slot after them,
        its state at each block end passed into that block. The kind's products in and out take
        every row at once (the first ``num_shared`` in the shared product, as the attention's
        projections do); what lies between runs per sequence (``RecurrentMixer.mix``)."""
        kind, rows = self.kinds[index], self.rows[index]
        assert kind.mix is not None  # ``of`` takes no other kind
        into, out_of = (getattr(module, name) for name in kind.products)
        projected = products.project(into, normed, num_shared)
        mixed = projected.new_zeros(normed.shape[0], out_of.weight.shape[1])
        for sequence, (start, end) in zip(sequences, spans, strict=True):
            state = self._state_before(index, sequence, kind, rows, normed)
            for at, upto, position in _pieces(sequence, start, end):
                mixed[at:upto], state = kind.mix(module, projected[at:upto], state)
                _keep_at_block_end(index, sequence, rows, position, state)
            sequence.states[index] = state
        out: torch.Tensor = products.project(out_of, mixed, num_shared)
        return out

    def _state_before(self, index: int, sequence: KVSequence, kind: RecurrentMixer,
                      rows: StateRows, like: torch.Tensor) -> RecurrentState:
        """The state ``sequence`` holds at its length: its slot's, else its last block's."""
        held = sequence.states.get(index)
        if held is not None:
            if not isinstance(held, RecurrentState):
                raise TypeError(f"layer {index}'s state is a {type(held).__name__}")
            return held
        length, block = sequence.length, sequence.pool.page_tokens
        if length == 0:
            start = kind.start(self.config, like.device)
            return RecurrentState(ConvWindow(start.conv.inputs.to(like.dtype)), start.scan)
        if length % block:
            raise RuntimeError(f"layer {index}'s state at position {length} is neither held "
                               f"nor kept (states are kept at block ends, every {block})")
        keys, values = sequence.layer_state(index, length - block, rows.rows)
        return rows.state(keys, values)


def _pieces(sequence: KVSequence, start: int, end: int) -> list[tuple[int, int, int]]:
    """The sequence's rows ``start..end`` of a step cut at its block ends: each piece's rows
    and the sequence's length after it."""
    block = sequence.pool.page_tokens
    position, at, pieces = sequence.length, start, []
    while at < end:
        upto = min(end, at + block - position % block)
        position += upto - at
        pieces.append((at, upto, position))
        at = upto
    return pieces


def _keep_at_block_end(index: int, sequence: KVSequence, rows: StateRows, position: int,
                       state: RecurrentState) -> None:
    """Keep ``state``, layer ``index``'s at ``position``, in the block it ends, if it ends one."""
    block = sequence.pool.page_tokens
    if position % block == 0:
        keys, values = rows.keys_values(state)
        sequence.put_state(index, position - block, keys, values)
