"""A causal depthwise convolution over a short window of past tokens (the short convolutions of
Gated DeltaNet, Mamba-2 and LFM2), one token's output a fixed sum of its window.

Why not ``conv1d``: a convolution kernel picks its own summation order by the length it is
given, so the same token's output would take other bits in a prompt of 9 tokens than in one
decode step. Here each output is ``bias + w[0] * x[t - L + 1] + ... + w[L - 1] * x[t]`` summed in
that order, element by element: the same bits whether the token came alone or among others,
and what a sequence keeps between steps is its last ``L - 1`` inputs (``ConvWindow``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ConvWindow:
    """The last ``kernel - 1`` inputs of a sequence, ``[kernel - 1, channels]`` (zeros before its
    first token): all a short convolution needs of the past."""

    inputs: torch.Tensor

    @classmethod
    def empty(cls, kernel: int, channels: int, *, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> ConvWindow:
        """The window of a sequence with no tokens yet."""
        if kernel < 1:
            raise ValueError(f"a convolution's kernel covers at least one token, not {kernel}")
        return cls(torch.zeros(kernel - 1, channels, dtype=dtype, device=device))


def causal_conv(window: ConvWindow, rows: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, ConvWindow]:
    """The convolution of a sequence's new ``rows`` ``[n, channels]`` after ``window``.

    Args:
        window: the sequence's last ``kernel - 1`` inputs before ``rows``.
        rows: its next ``n`` inputs.
        weight: ``[channels, kernel]`` (``conv1d``'s ``[channels, 1, kernel]`` squeezed), tap
            ``kernel - 1`` on the token itself.
        bias: ``[channels]``, or None.

    Returns:
        The ``n`` outputs ``[n, channels]`` (before any activation) and the window after them.
    """
    kernel = weight.shape[-1]
    if window.inputs.shape[0] != kernel - 1:
        raise ValueError(f"a kernel of {kernel} taps needs a window of {kernel - 1} inputs, "
                         f"got {window.inputs.shape[0]}")
    n = rows.shape[0]
    padded = torch.cat([window.inputs, rows])
    out = (torch.zeros_like(rows) if bias is None
           else bias.to(rows.dtype).expand(n, -1).clone())
    for tap in range(kernel):
        out = out + padded[tap:tap + n] * weight[:, tap].to(rows.dtype)
    return out, ConvWindow(padded[padded.shape[0] - (kernel - 1):].clone())


def causal_conv_rows(windows: Sequence[ConvWindow], rows: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> tuple[torch.Tensor, list[ConvWindow]]:
    """``causal_conv`` of one new row per sequence, row ``i`` of ``rows`` after ``windows[i]``,
    all at once: each output the same sum in the same order, so the bits ``causal_conv`` gives
    the row alone."""
    kernel = weight.shape[-1]
    if rows.shape[0] != len(windows):
        raise ValueError(f"{rows.shape[0]} rows for {len(windows)} windows: one each")
    padded = torch.cat([torch.stack([window.inputs for window in windows]),
                        rows.unsqueeze(1)], dim=1)                   # [n, kernel, channels]
    n = rows.shape[0]
    out = (torch.zeros_like(rows) if bias is None
           else bias.to(rows.dtype).expand(n, -1).clone())
    for tap in range(kernel):
        out = out + padded[:, tap] * weight[:, tap].to(rows.dtype)
    return out, [ConvWindow(after[1:]) for after in padded]  # views of one small tensor
