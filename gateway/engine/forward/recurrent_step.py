"""A step's rows through a recurrent layer: each sequence from the state it holds, its state at
every block's end kept in that block.

Why per sequence: a recurrent layer's output for a token depends on its own sequence's state,
which no other sequence shares; the layer kinds (``gateway.engine.forward.recurrent``) compute
one sequence's new rows from it, with the same bits however the rows are cut. So a step cuts
each sequence's rows at its block ends, runs each piece from the state the last one left, and
writes the state at each block's end into that block (``gateway.engine.kv.kept_states``): the
block, cached, carries the state a warm start resumes from. Between steps a sequence holds its
state in its slot (``KVSequence.states``); a sequence that holds none there -- built from cached
blocks, or truncated to a block's end -- reads it from its last block.

The kind's products (``project``) multiply one sequence's rows padded as the step's shared
product pads them, or a decode row alone where decode rows are products of their own
(``RowProducts.shares_decode_rows``): the bits a row would have had in the step's shared
product, whatever else runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gateway.engine.forward.recurrent.layer_state import Project, RecurrentState
from gateway.engine.forward.recurrent.mixers import RECURRENT_MIXERS, RecurrentMixer
from gateway.engine.forward.recurrent.short_conv import ConvWindow
from gateway.engine.kv.kept_states import StateRows, state_rows
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
        return cls(config, {i: RECURRENT_MIXERS[name] for i, name in mixers.items()},
                   {i: state_rows(config, name, layout) for i, name in mixers.items()})

    def mix(self, index: int, module: Any, normed: torch.Tensor,
            sequences: Sequence[tuple[KVSequence, bool]], spans: Sequence[tuple[int, int]],
            products: RowProducts) -> list[torch.Tensor]:
        """Layer ``index``'s output rows for each sequence (``(sequence, is_decode)``, its
        rows ``normed[start:end]`` for its span), in order; each sequence's state after them
        goes to its slot, its state at each block end passed into that block."""
        kind, rows = self.kinds[index], self.rows[index]
        outputs = []
        for (sequence, is_decode), (start, end) in zip(sequences, spans, strict=True):
            state = self._state_before(index, sequence, kind, rows, normed)
            project = _own_rows_product(products, decode_alone=is_decode
                                        and not products.shares_decode_rows)
            block = sequence.pool.page_tokens
            at, position, pieces = start, sequence.length, []
            while at < end:
                upto = min(end, at + block - position % block)
                step = kind.step(module, self.config, normed[at:upto], state, project=project,
                                 chunk=block)
                pieces.append(step.outputs)
                state = step.state
                position += upto - at
                at = upto
                if position % block == 0:
                    keys, values = rows.keys_values(state)
                    sequence.put_state(index, position - block, keys, values)
            sequence.states[index] = state
            outputs.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
        return outputs

    def _state_before(self, index: int, sequence: KVSequence, kind: RecurrentMixer,
                      rows: StateRows, like: torch.Tensor) -> RecurrentState:
        """The state ``sequence`` holds at its length: its slot's, else its last block's."""
        held = sequence.states.get(index)
        if held is not None:
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


def _own_rows_product(products: RowProducts, *, decode_alone: bool) -> Project:
    """``project`` over one sequence's rows with the bits they have in a step's product."""

    def project(linear: Any, rows: torch.Tensor) -> torch.Tensor:
        if decode_alone:
            return products.project(linear, rows, 0)
        count = rows.shape[0]
        padded_count = products.padding.rows_for(count)
        if padded_count != count:
            rows = torch.cat([rows, rows.new_zeros(padded_count - count, rows.shape[1])])
        out: torch.Tensor = products.project(linear, rows, padded_count)[:count]
        return out

    return project
