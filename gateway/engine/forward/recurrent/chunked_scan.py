"""The recurrent rules of hybrid models' linear layers -- the gated delta rule (Gated DeltaNet:
Qwen3-Next, Qwen3.5) and the decayed linear rule (Mamba-2's state-space duality: Granite 4.0-H,
Falcon-H1, Bamba, Nemotron-H) -- scanned in chunks aligned to each sequence's positions, so that
its state at every chunk's end is exact.

The rules: a head keeps a ``[key_dim, value_dim]`` state ``S``; token ``t`` decays it by
``exp(g_t)`` and reads ``q_t S`` after writing. The decayed linear rule writes ``k_t^T v_t``
(Mamba-2: ``k`` its ``B``, ``q`` its ``C``, ``v`` its ``dt * x``, ``g`` its ``dt * A``; its state
is the transpose of transformers'). The delta rule writes ``beta_t * (v_t - k_t S)`` along
``k_t``: only what ``S`` does not already predict.

Computed a token at a time they are slow; computed a chunk of ``C`` tokens at a time (products
within the chunk, one triangular solve for the delta rule) they are fast, but a chunk's bits
depend on where the chunk starts. So chunks start where the sequence's positions are multiples
of ``C`` -- always, whatever a step holds:

- the state is advanced only by whole chunks (``ScanStream.state`` is the state after the last
  whole chunk, at a position that is a multiple of ``C``);
- the tokens after it (fewer than ``C``) wait in the stream, and a step that brings more tokens
  computes their chunk again from its start, padded to ``C`` rows. A token's output reads only
  the rows before it in its chunk (its row of the causal products; later rows meet zeros), so it
  has the same bits whether its chunk was whole, partial, or recomputed one decode token at a
  time.

With ``C`` dividing the cache's block size, the state at every block's end is the state after a
whole chunk: the same bits in a cold prefill, a warm start that loaded the state of an earlier
block, or a sequence that decoded its way there. That state is what a hybrid model's block
keeps beside its attention layers' K/V.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gateway.engine.forward.recurrent.one_thread import one_thread, subnormals_flushed


@dataclass(frozen=True, slots=True)
class ScanInputs:
    """A run of tokens' inputs to one layer's rule, each ``[tokens, heads, ...]`` in float32:
    queries and keys as the rule reads them (normalised and scaled where the layer does that),
    values, log-decays ``g`` (<= 0) and the delta rule's write strengths ``beta`` (ones for the
    decayed linear rule, which does not read them)."""

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    decays: torch.Tensor
    betas: torch.Tensor

    def __post_init__(self) -> None:
        n, heads = self.queries.shape[:2]
        for name in ("keys", "values", "decays", "betas"):
            shape = getattr(self, name).shape
            if tuple(shape[:2]) != (n, heads):
                raise ValueError(f"{name} {tuple(shape)} do not match queries' "
                                 f"{n} tokens x {heads} heads")

    @property
    def num_tokens(self) -> int:
        return int(self.queries.shape[0])

    def then(self, more: ScanInputs) -> ScanInputs:
        """These tokens followed by ``more``'s."""
        return ScanInputs(*(torch.cat([a, b]) for a, b in zip(self._parts(), more._parts(),
                                                                 strict=True)))

    def rows(self, start: int, end: int) -> ScanInputs:
        return ScanInputs(*(part[start:end] for part in self._parts()))

    def _parts(self) -> tuple[torch.Tensor, ...]:
        return (self.queries, self.keys, self.values, self.decays, self.betas)

    @classmethod
    def none(cls, heads: int, key_dim: int, value_dim: int, *,
             device: torch.device | str = "cpu") -> ScanInputs:
        def empty(*shape: int) -> torch.Tensor:
            return torch.zeros(0, heads, *shape, dtype=torch.float32, device=device)
        return cls(empty(key_dim), empty(key_dim), empty(value_dim), empty(), empty())


@dataclass(frozen=True, slots=True)
class ScanStream:
    """One sequence's place in one layer's rule.

    Attributes:
        state: ``[heads, key_dim, value_dim]`` after the first ``position`` tokens.
        position: a multiple of the chunk size: where the last whole chunk ended.
        waiting: the inputs of the tokens after ``position`` (fewer than a chunk).
    """

    state: torch.Tensor
    position: int
    waiting: ScanInputs

    @classmethod
    def start(cls, heads: int, key_dim: int, value_dim: int, *,
              device: torch.device | str = "cpu") -> ScanStream:
        """A sequence with no tokens: a zero state."""
        return cls(torch.zeros(heads, key_dim, value_dim, dtype=torch.float32, device=device),
                   0, ScanInputs.none(heads, key_dim, value_dim, device=device))

    @classmethod
    def at(cls, state: torch.Tensor, position: int) -> ScanStream:
        """A sequence resumed from ``state``, its state after ``position`` tokens (a warm start
        from a cached block's end)."""
        heads, key_dim, value_dim = state.shape
        return cls(state.to(torch.float32), position,
                   ScanInputs.none(heads, key_dim, value_dim, device=state.device))

    @property
    def length(self) -> int:
        """Tokens the stream has seen."""
        return self.position + self.waiting.num_tokens


@dataclass(frozen=True, slots=True)
class ScanStep:
    """What one step of a sequence gives: its new tokens' outputs ``[n, heads, value_dim]``, its
    stream after them, and the state at each chunk end it passed, by position."""

    outputs: torch.Tensor
    stream: ScanStream
    states: tuple[tuple[int, torch.Tensor], ...]


def scan_step(stream: ScanStream, new: ScanInputs, chunk: int, *, delta: bool) -> ScanStep:
    """Advance ``stream`` by the tokens ``new`` (see the module docstring).

    Args:
        stream: the sequence's place before them.
        new: their inputs (at least one token).
        chunk: the chunk size ``C`` (the stream's ``position`` is a multiple of it).
        delta: the gated delta rule; False: the decayed linear rule.
    """
    if chunk < 1:
        raise ValueError(f"a chunk holds at least one token, not {chunk}")
    if stream.position % chunk:
        raise ValueError(f"a stream at {stream.position} does not start a chunk of {chunk}")
    with one_thread(), subnormals_flushed():
        return _scan(stream, new, chunk, delta=delta)


def _scan(stream: ScanStream, new: ScanInputs, chunk: int, *, delta: bool) -> ScanStep:
    pending = stream.waiting.then(new)
    num_old = stream.waiting.num_tokens
    state, position = stream.state, stream.position
    outputs: list[torch.Tensor] = []
    states: list[tuple[int, torch.Tensor]] = []
    start = 0
    while start < pending.num_tokens:
        end = min(start + chunk, pending.num_tokens)
        rows, after = _chunk(state, pending.rows(start, end), chunk, delta=delta,
                             whole=end - start == chunk)
        first_new = max(num_old - start, 0)
        outputs.append(rows[first_new:])
        if after is None:
            break
        state, position = after, position + chunk
        states.append((position, state))
        start = end
    waiting = pending.rows(position - stream.position, pending.num_tokens)
    return ScanStep(outputs=torch.cat(outputs), stream=ScanStream(state, position, waiting),
                     states=tuple(states))


def scan_rows(streams: Sequence[ScanStream], new: ScanInputs, chunk: int, *,
              delta: bool) -> tuple[torch.Tensor, list[ScanStream]]:
    """Advance each of ``streams`` by one token, row ``i`` of ``new`` for stream ``i``: their
    outputs ``[len(streams), heads, value_dim]`` and the streams after them.

    Why: a decode step brings every running sequence one token, whose chunk each computes
    again (padded to ``chunk`` rows); the chunks of every stream, stacked along the heads,
    are one set of operations instead of one per stream. A stream's rows keep the bits
    ``scan_step`` gives them where ``stacking_is_exact`` holds for the layer's shapes -- each
    head's products are their own in a stacked product, element-wise steps are exact or read
    one number -- which the caller checks on the machine before it stacks.
    """
    if new.num_tokens != len(streams):
        raise ValueError(f"{new.num_tokens} rows for {len(streams)} streams: one each")
    for stream in streams:
        if stream.position % chunk:
            raise ValueError(f"a stream at {stream.position} does not start a chunk of {chunk}")
    count, heads = len(streams), int(new.queries.shape[1])
    waiting = [stream.waiting.num_tokens for stream in streams]
    every = torch.arange(count)
    with one_thread(), subnormals_flushed():
        rows_first = []  # each part [count, chunk, heads, ...]: waiting rows, the new one, zeros
        for index, fresh in enumerate(new._parts()):
            padded = fresh.new_zeros(count, chunk, *fresh.shape[1:])
            for i, stream in enumerate(streams):
                if waiting[i]:
                    padded[i, :waiting[i]] = stream.waiting._parts()[index]
            padded[every, torch.tensor(waiting)] = fresh
            rows_first.append(padded)
        parts = [part.transpose(1, 2).reshape(count * heads, chunk, *part.shape[3:])
                 for part in rows_first]
        state = torch.cat([stream.state for stream in streams])
        outputs, after = _chunk_rule(state, *parts, delta=delta)
    assert after is not None  # asked for
    mine = outputs.view(count, heads, chunk, -1)[every, :, torch.tensor(waiting)]
    after_each: list[ScanStream] = []
    for i, stream in enumerate(streams):
        m = waiting[i] + 1
        if m == chunk:  # the token ends its chunk: the state moves past it
            after_each.append(ScanStream(after[i * heads:(i + 1) * heads].clone(),
                                         stream.position + chunk, stream.waiting.rows(0, 0)))
        else:
            after_each.append(ScanStream(stream.state, stream.position,
                                         ScanInputs(*(part[i, :m] for part in rows_first))))
    return mine, after_each


STACKS_TRIED = (1, 2, 3, 4, 5, 8, 16, 32, 64, 128)
"""How many streams ``stacking_is_exact`` stacks: a kernel may change its way at some batch
size, so sizes up to a large decode step's."""


def stacking_is_exact(heads: int, key_dim: int, value_dim: int, chunk: int, *, delta: bool,
                      device: torch.device | str = "cpu") -> bool:
    """Whether ``scan_rows`` gives streams of these shapes the bits ``scan_step`` gives each
    alone, here: tried on made-up numbers, ``STACKS_TRIED`` streams at once, on ``device``
    (whether a stacked product keeps each matrix's summation order is its kernels' choice, on
    this CPU or GPU)."""
    g = torch.Generator().manual_seed(0)

    def made_up(count: int) -> ScanInputs:
        def unit(*shape: int) -> torch.Tensor:
            x = torch.randn(*shape, generator=g)
            rows: torch.Tensor = (x / x.norm(dim=-1, keepdim=True)).to(device)
            return rows
        return ScanInputs(queries=unit(count, heads, key_dim), keys=unit(count, heads, key_dim),
                          values=torch.randn(count, heads, value_dim, generator=g).to(device),
                          decays=-torch.rand(count, heads, generator=g).to(device),
                          betas=torch.rand(count, heads, generator=g).to(device))

    kinds = []  # partly filled chunks, from differing states
    for waiting in range(5):
        state = torch.randn(heads, key_dim, value_dim, generator=g) / 8
        stream = ScanStream.at(state.to(device), 0)
        if waiting % chunk:
            stream = scan_step(stream, made_up(waiting % chunk), chunk, delta=delta).stream
        kinds.append(stream)
    new = made_up(len(kinds))
    alone = [scan_step(stream, new.rows(i, i + 1), chunk, delta=delta)
             for i, stream in enumerate(kinds)]
    for count in STACKS_TRIED:
        which = [i % len(kinds) for i in range(count)]
        rows = ScanInputs(*(part[torch.tensor(which, device=part.device)]
                            for part in new._parts()))
        outputs, after = scan_rows([kinds[i] for i in which], rows, chunk, delta=delta)
        for at, i in enumerate(which):
            if not (torch.equal(outputs[at], alone[i].outputs[0])
                    and torch.equal(after[at].state, alone[i].stream.state)):
                return False
    return True


def _chunk(state: torch.Tensor, inputs: ScanInputs, chunk: int, *, delta: bool,
           whole: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The outputs ``[m, heads, value_dim]`` of a chunk's first ``m`` tokens from ``state``
    (padded to ``chunk`` rows, so that every chunk's products have one shape), and the state
    after the chunk when it is ``whole``."""
    m = inputs.num_tokens
    q, k, v, g, beta = (_heads_first(part, chunk) for part in inputs._parts())
    outputs, after = _chunk_rule(state, q, k, v, g, beta, delta=delta, whole=whole)
    return outputs[:, :m].transpose(0, 1), after


def _heads_first(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[m, heads, ...]`` to ``[heads, chunk, ...]``, zeros after the ``m`` rows."""
    x = x.transpose(0, 1)
    pad = chunk - x.shape[1]
    if pad:
        x = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1)
    out: torch.Tensor = x.contiguous()
    return out


def _chunk_rule(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                g: torch.Tensor, beta: torch.Tensor, *, delta: bool, whole: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk of the rule for each head, its inputs ``[heads, chunk, ...]``: the outputs
    ``[heads, chunk, value_dim]`` and, where asked (``whole``), the state after the chunk."""
    chunk = q.shape[1]
    cum = g.cumsum(dim=-1)                                           # [H, C]
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()
    if delta:
        k_beta = k * beta.unsqueeze(-1)
        # (I + strictly-lower(beta k k^T decay)) folds the chunk's writes into one solve.
        system = (k_beta @ k.transpose(-1, -2)) * decay
        written = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False,
                                                unitriangular=True)
        read_back = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1),
                                                  upper=False, unitriangular=True)
        corrections = written - read_back @ state                    # [H, C, value_dim]
    else:
        corrections = v  # written as they are
    outputs = ((q * cum.exp().unsqueeze(-1)) @ state
               + ((q @ k.transpose(-1, -2)) * decay) @ corrections)
    if not whole:
        return outputs, None
    last = cum[:, -1:]
    after = (state * last.exp().unsqueeze(-1)
             + (k * (last - cum).exp().unsqueeze(-1)).transpose(-1, -2) @ corrections)
    return outputs, after
