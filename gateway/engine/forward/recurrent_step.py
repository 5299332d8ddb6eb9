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
product); only the part between them -- a convolution over each sequence's window, and a scan
from its state (the scan's chunk dividing the block, ``scan_chunk``) -- runs per sequence,
piece by piece; except for the sequences that bring one token (a decode step), whose windows
and chunks stack into one convolution and one scan (``RecurrentMixer.mix_rows``), where the
machine keeps each one's bits that way (``stacking_is_exact``, checked once per kind).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gateway.engine.forward.kept_states import StateHome, state_homes
from gateway.engine.forward.recurrent.chunked_scan import stacking_is_exact
from gateway.engine.forward.recurrent.layer_state import RecurrentState
from gateway.engine.forward.recurrent.mixers import RECURRENT_MIXERS, RecurrentMixer
from gateway.engine.forward.recurrent.one_thread import one_thread
from gateway.engine.forward.recurrent.short_conv import ConvWindow
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.linear.row_products import RowProducts
from tiers.payload import KVLayout

SCAN_CHUNK = 16
"""The most tokens a scan computes at once: a model's chunk is the largest divisor of its block
size up to this (``scan_chunk``), so that every block's end is a chunk's end.

Why 16: a decoding token computes its chunk again, padded to the chunk (its bits must be a
prefill's), so a decode step's scan costs grow with the chunk while a prefill's shrink. Measured
on a 2-core Intel Xeon (Qwen3.5-shaped, ``python -m gateway.bench.decode_steps``; subnormals
flushed): chunks of 16, 32 and 64 took 108, 136 and 161 ms for one decoding row and 251, 348 and
444 ms for eight, and a 2,048-token prefill 5.5, 5.4 and 5.4 s."""


def scan_chunk(block_tokens: int) -> int:
    """The scan's chunk for blocks of ``block_tokens`` tokens."""
    return math.gcd(SCAN_CHUNK, block_tokens)


@dataclass(slots=True)
class RecurrentLayers:
    """A model's recurrent layers: each one's kind, and where its state lies in a block.

    Attributes:
        config: the model's config (transformers' attribute names), which the kinds read.
        kinds: the kind of each recurrent layer, by index.
        layout: the model's own K/V layout (its decoder layers; a cache's extra layers for
            states are numbered after them, ``gateway.engine.forward.kept_states``).
        beside_attention: the recurrent layers that run beside an attention (their states in
            extra layers only).
    """

    config: Any
    kinds: dict[int, RecurrentMixer]
    layout: KVLayout
    beside_attention: frozenset[int] = frozenset()
    _homes: dict[int, dict[int, StateHome]] = field(default_factory=dict)
    _stacks: dict[tuple[str, int, str], bool] = field(default_factory=dict)

    @classmethod
    def of(cls, config: Any, mixers: dict[int, str], layout: KVLayout,
           beside_attention: frozenset[int] = frozenset()) -> RecurrentLayers:
        """The layers ``mixers`` (kind names by index) of a model with ``config``.

        Raises:
            ValueError: a kind no module computes, or one computed one sequence at a time.
        """
        unknown = sorted(set(mixers.values()) - set(RECURRENT_MIXERS))
        if unknown:
            raise ValueError(f"recurrent layers of kinds nothing computes: {unknown}")
        one_at_a_time = sorted(name for name in set(mixers.values())
                               if RECURRENT_MIXERS[name].mix is None)
        if one_at_a_time:
            raise ValueError(f"recurrent layers of kinds computed one sequence at a time only: "
                             f"{one_at_a_time}")
        return cls(config, {i: RECURRENT_MIXERS[name] for i, name in mixers.items()}, layout,
                   beside_attention)

    def homes(self, block_tokens: int) -> dict[int, StateHome]:
        """Where each layer's state lies in blocks of ``block_tokens`` tokens."""
        homes = self._homes.get(block_tokens)
        if homes is None:
            names = {index: kind.name for index, kind in self.kinds.items()}
            homes = self._homes[block_tokens] = state_homes(self.config, names, self.layout,
                                                            block_tokens, self.beside_attention)
        return homes

    def written_layers(self, index: int, block_tokens: int, num_layers: int) -> tuple[int, ...]:
        """The layers whose slots of a step's positions layer ``index``'s mixing writes (zeros,
        then its states at block ends), in a pool of ``num_layers`` layers and blocks of
        ``block_tokens``: its home's, and for the first recurrent layer any extra layer no
        home uses at this block size (a pool planned for other blocks: the probe's), so that
        no slot holds what a page held before."""
        homes = self.homes(block_tokens)
        layers = homes[index].layers
        if index == min(homes):
            used = {layer for home in homes.values() for layer in home.layers}
            layers += tuple(layer for layer in range(self.layout.num_layers, num_layers)
                            if layer not in used)
        return layers

    def mix(self, index: int, module: Any, normed: torch.Tensor,
            sequences: Sequence[KVSequence], spans: Sequence[tuple[int, int]],
            products: RowProducts, num_shared: int) -> torch.Tensor:
        """Layer ``index``'s output ``[rows, hidden]`` for the step's ``normed`` rows: each
        sequence (its rows at its span) from its own state, which goes to its slot after them,
        its state at each block end passed into that block. The kind's products in and out take
        every row at once (the first ``num_shared`` in the shared product, as the attention's
        projections do); what lies between runs per sequence (``RecurrentMixer.mix``)."""
        kind = self.kinds[index]
        assert kind.mix is not None  # ``of`` takes no other kind
        into = normed if kind.before is None else kind.before(module, normed)
        projected = {name: products.project(getattr(module, name), into, num_shared)
                     for name in kind.inputs if getattr(module, name, None) is not None}
        out_of = getattr(module, kind.output)
        mixed = normed.new_zeros(normed.shape[0], out_of.weight.shape[1])
        with one_thread():  # small operations: waking sleeping threads costs more than they do
            self._mix_each(index, module, kind, projected, mixed, sequences, spans, normed)
        out: torch.Tensor = products.project(out_of, mixed, num_shared)
        return out

    def _mix_each(self, index: int, module: Any, kind: RecurrentMixer,
                  projected: dict[str, torch.Tensor], mixed: torch.Tensor,
                  sequences: Sequence[KVSequence], spans: Sequence[tuple[int, int]],
                  like: torch.Tensor) -> None:
        """Each sequence's rows of ``projected`` mixed into ``mixed`` (``RecurrentMixer.mix``),
        from its state, its state kept at each block end and held in its slot after; the
        sequences with one row (decoding) all at once where the kind can
        (``RecurrentMixer.mix_rows``, ``stacks``)."""
        assert kind.mix is not None
        decoding: dict[int, list[int]] = {}
        for at, (sequence, (start, end)) in enumerate(zip(sequences, spans, strict=True)):
            block = sequence.pool.page_tokens
            if end - start == 1 and self.stacks(kind, scan_chunk(block), like.device):
                decoding.setdefault(block, []).append(at)
                continue
            home = self._home(index, sequence)
            state = self._state_before(index, sequence, kind, home, like)
            for upto_at, upto, position in _pieces(sequence, start, end):
                mixed[upto_at:upto], state = kind.mix(
                    module, self.config,
                    {name: rows[upto_at:upto] for name, rows in projected.items()},
                    state, scan_chunk(block))
                self._keep(home, sequence, state, position)
            sequence.states[index] = state
        for block, group in decoding.items():
            self._mix_rows(index, module, kind, projected, mixed,
                           [sequences[at] for at in group],
                           [spans[at][0] for at in group], like, block)

    def _mix_rows(self, index: int, module: Any, kind: RecurrentMixer,
                  projected: dict[str, torch.Tensor], mixed: torch.Tensor,
                  sequences: list[KVSequence], rows: list[int], like: torch.Tensor,
                  block: int) -> None:
        """One row each of ``sequences`` (at ``rows``) mixed at once (``mix_rows``)."""
        assert kind.mix_rows is not None
        homes = [self._home(index, sequence) for sequence in sequences]
        states = [self._state_before(index, sequence, kind, home, like)
                  for sequence, home in zip(sequences, homes, strict=True)]
        at = torch.tensor(rows, device=mixed.device)
        out, after = kind.mix_rows(module, self.config,
                                   {name: taken[at] for name, taken in projected.items()},
                                   states, scan_chunk(block))
        mixed[at] = out
        for sequence, home, state in zip(sequences, homes, after, strict=True):
            self._keep(home, sequence, state, sequence.length + 1)
            sequence.states[index] = state

    def stacks(self, kind: RecurrentMixer, chunk: int, device: torch.device) -> bool:
        """Whether ``kind``'s decoding rows mix all at once here: it can, and its stacked scans
        of chunks of ``chunk`` keep each sequence's bits on ``device`` (checked once)."""
        if kind.mix_rows is None:
            return False
        known = self._stacks.get((kind.name, chunk, str(device)))
        if known is None:
            scan = kind.start(self.config, device).scan
            if scan is None:
                known = True
            else:
                heads, key_dim, value_dim = scan.state.shape
                known = stacking_is_exact(heads, key_dim, value_dim, chunk,
                                          delta=kind.delta_rule, device=device)
            self._stacks[(kind.name, chunk, str(device))] = known
        return known

    @staticmethod
    def _keep(home: StateHome, sequence: KVSequence, state: RecurrentState,
              position: int) -> None:
        """At a block's end (``position`` its length after), ``state`` into that block."""
        block = sequence.pool.page_tokens
        if position % block == 0:
            for piece in home.pieces(state):
                sequence.put_state(piece.layer, position - block, piece.keys, piece.values)

    def _home(self, index: int, sequence: KVSequence) -> StateHome:
        home = self.homes(sequence.pool.page_tokens)[index]
        if max(home.layers) >= sequence.layout.num_layers:
            raise RuntimeError(
                f"layer {index}'s state needs layer {max(home.layers)} of a block of "
                f"{sequence.pool.page_tokens} tokens, and the pool's layout has "
                f"{sequence.layout.num_layers}: build the pool with the cache's layout "
                "(gateway.engine.forward.kept_states.cache_layout)")
        return home

    def _state_before(self, index: int, sequence: KVSequence, kind: RecurrentMixer,
                      home: StateHome, like: torch.Tensor) -> RecurrentState:
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
        return home.state(lambda layer, rows: sequence.layer_state(layer, length - block, rows),
                          length)


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
