"""The PNGs the benchmarks write beside their tables, and the one seam to matplotlib.

matplotlib is optional (the ``plot`` extra): ``new_figure`` says so on the report's stream and
returns None when it is missing, so a benchmark still prints its table. Figures are drawn on
matplotlib's Agg canvas through ``matplotlib.figure.Figure`` (no pyplot: no global figure
state, no display). ``kvgate bench load`` draws its own panels (``gateway.bench.load``),
``kvgate bench tiers`` its own (``gateway.bench.tiers``); the TTFT chart is drawn here because
``gateway.bench.ttft`` is already long.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from gateway.bench.rows import LengthResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

SYSTEM_COLOURS = {"kvgate": "tab:blue", "hf": "tab:orange", "llama.cpp": "tab:green"}


def new_figure(path: Path, out: TextIO, *, size: tuple[float, float]) -> Figure | None:
    """A blank figure of ``size`` inches, or None (having said so) without matplotlib."""
    try:
        from matplotlib.figure import Figure  # the Agg canvas: no pyplot, no display
    except ImportError:
        out.write(f"\nno plot: matplotlib is not installed (pip install 'kvgate[plot]'); "
                  f"{path} not written\n")
        return None
    return Figure(figsize=size, layout="constrained")


def save_figure(figure: Figure, path: Path, out: TextIO) -> None:
    """Write ``figure`` as a PNG at ``path`` (its directory is made) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    out.write(f"\nplot: {path}\n")


def plot_ttft(results: Sequence[LengthResult], path: Path, out: TextIO) -> bool:
    """Median TTFT of every measured row, one panel per prefix length, as a PNG.

    Bars are coloured by system (kvgate, transformers' recipe, llama.cpp) on a log scale, since
    a cold prefill and a warm hit differ by one to two orders of magnitude; rows without
    samples (n/a) are left out.

    Returns:
        False when matplotlib is not installed (nothing written).
    """
    measured = [(r, [row for row in r.rows if row.median_s is not None]) for r in results]
    figure = new_figure(path, out, size=(5.5 * max(1, len(measured)), 4.5))
    if figure is None:
        return False
    axes = figure.subplots(1, max(1, len(measured)), squeeze=False)[0]
    for ax, (result, rows) in zip(axes, measured, strict=True):
        labels = [row.label for row in rows][::-1]
        values = [(row.median_s or 0.0) * 1e3 for row in rows][::-1]
        colours = [SYSTEM_COLOURS.get(row.system, "tab:gray") for row in rows][::-1]
        bars = ax.barh(labels, values, color=colours)
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], padding=2, fontsize="small")
        ax.set_xscale("log")
        ax.set_title(f"prefix {result.prefix_tokens:,} tokens")
        ax.set_xlabel("time to first token, ms (median, log scale)")
        ax.grid(True, axis="x", alpha=0.3)
        ax.margins(x=0.25)
        _label_log_axis(ax)
    save_figure(figure, path, out)
    return True


def _label_log_axis(ax: Axes) -> None:
    """Ticks at the powers of ten (and 2 and 5 times them on an axis of under two decades),
    labelled as plain milliseconds ("500", "2k"), minor ticks unlabelled: matplotlib's default
    labels minor ticks of a short log axis in overlapping scientific notation."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    low, high = ax.get_xlim()
    decades = math.log10(high / low) if low > 0 and high > low else 0.0
    subs = (1.0, 2.0, 5.0) if decades < 2.0 else (1.0,)
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: _milliseconds(value)))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _milliseconds(value: float) -> str:
    return f"{value / 1e3:,.0f}k" if value >= 1e3 else f"{value:,.0f}"
