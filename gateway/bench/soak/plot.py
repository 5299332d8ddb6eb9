"""The soak's PNG (``--plot``): what a run looked like over time, every fault's window shaded
on every panel.

Four panels sharing the time axis: the share of checked answers' prompt tokens each tier served
(device, host, disk, Redis; stacked, per ``BIN_S`` of the run), and each process's resident
memory, open descriptors and threads as sampled. Drawn through ``gateway.bench.plotting`` (no
pyplot; nothing written, and a line said, without matplotlib).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from gateway.bench.plotting import new_figure, save_figure
from gateway.bench.soak.report import SoakReport
from gateway.bench.soak.workload import CHECKED_KINDS
from tiers.kinds.host import HOST

if TYPE_CHECKING:
    from matplotlib.axes import Axes

BIN_S = 10.0
"""The hit-rate panel's step: the answers that ended in each such stretch of the run."""
TIER_COLOURS = {"device": "tab:blue", HOST: "tab:green", "disk": "tab:orange",
                "redis": "tab:red"}
FAULT_COLOURS = {"redis_kill_restart": "tab:red", "redis_cluster_failover": "tab:pink",
                 "redis_pause": "tab:purple", "redis_slow": "tab:olive",
                 "replica_kill_restart": "tab:brown", "disk_block_corrupt": "tab:cyan",
                 "disk_full": "tab:orange", "redis_value_corrupt": "tab:gray"}


def hit_shares(report: SoakReport, bin_s: float = BIN_S) -> tuple[list[float],
                                                                  dict[str, list[float]]]:
    """Each bin's start (seconds into the load) and, per tier, the share of the prompt tokens
    of the checked answers that ended in it served from that tier (0 where none ended)."""
    prompt_tokens: dict[int, int] = defaultdict(int)
    tier_tokens: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for outcome in report.outcomes:
        if outcome.kind not in CHECKED_KINDS or outcome.result != "ok":
            continue
        index = int((outcome.ended - report.started) // bin_s)
        prompt_tokens[index] += outcome.prompt_tokens
        for tier, tokens in outcome.tiers.items():
            tier_tokens[tier][index] += tokens
    if not prompt_tokens:
        return [], {}
    bins = range(max(prompt_tokens) + 1)
    shares = {tier: [by_bin[i] / prompt_tokens[i] if prompt_tokens[i] else 0.0 for i in bins]
              for tier, by_bin in sorted(tier_tokens.items())}
    return [i * bin_s for i in bins], shares


def plot_soak(report: SoakReport, path: Path, out: TextIO) -> bool:
    """Write the run's PNG at ``path``.

    Returns:
        False when matplotlib is not installed (nothing written).
    """
    figure = new_figure(path, out, size=(11.0, 11.0))
    if figure is None:
        return False
    hits, rss, fds, threads = figure.subplots(4, 1, sharex=True)
    starts, shares = hit_shares(report)
    if starts:
        hits.stackplot(starts, *shares.values(), labels=list(shares), step="post",
                       colors=[TIER_COLOURS.get(t, "tab:gray") for t in shares], alpha=0.8)
        hits.legend(loc="upper left", fontsize="small", ncols=len(shares))
    hits.set_ylim(0, 1)
    hits.set_ylabel(f"prompt tokens served\nby tier (per {BIN_S:g} s)")
    hits.set_title(_title(report))
    for ax, field, unit, label in ((rss, "rss_bytes", 1 << 20, "resident memory, MiB"),
                                   (fds, "open_fds", 1, "open descriptors"),
                                   (threads, "threads", 1, "threads")):
        for process in sorted({s.process for s in report.samples}):
            points = [(s.at_s, getattr(s.sample, field)) for s in report.samples
                      if s.process == process and getattr(s.sample, field) is not None]
            if points:
                ax.plot([at for at, _ in points], [value / unit for _, value in points],
                        label=process, linewidth=1.2)
        ax.set_ylabel(label)
    rss.legend(loc="upper left", fontsize="x-small", ncols=4)
    threads.set_xlabel("seconds into the load")
    for ax in (hits, rss, fds, threads):
        _shade_faults(ax, report)
        ax.grid(True, alpha=0.3)
    _label_faults(hits, report)
    save_figure(figure, path, out)
    return True


def _title(report: SoakReport) -> str:
    results = [o.result for o in report.outcomes]
    return (f"kvgate bench soak: {len(results)} requests, {results.count('wrong')} wrong, "
            f"{len(report.windows)} faults (shaded)")


def _shade_faults(ax: Axes, report: SoakReport) -> None:
    for window in report.windows:
        ax.axvspan(window.started - report.started,
                   max(window.ended, window.started + 1.0) - report.started,
                   color=FAULT_COLOURS.get(window.kind, "tab:gray"), alpha=0.25, linewidth=0)


def _label_faults(ax: Axes, report: SoakReport) -> None:
    for window in report.windows:
        ax.annotate(window.kind.replace("_", " "), (window.started - report.started, 1.0),
                    xycoords=("data", "axes fraction"), rotation=90, fontsize="x-small",
                    va="top", ha="right", color="black")
