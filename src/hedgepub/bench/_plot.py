"""The bench's plot: the latency distribution of every publisher, with the tail made visible.

The y axis is the cumulative share of publishes on a logit scale, so 50%, 90%, 99% and 99.9% are evenly
spaced and the tail, where hedging acts, gets as much room as the median. The x axis (latency) is
logarithmic because the latencies span 1 ms to seconds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

#: Colours per publisher name; other names take the next of _OTHER_COLOURS (neither red nor green).
_COLOURS = {"unhedged": "#d62728", "adaptive": "#2ca02c"}
_OTHER_COLOURS = ("#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")
#: Vertical offsets (points) of the percentile labels, one per curve in turn, so that labels of curves
#: passing close to each other do not print on top of each other.
_LABEL_OFFSETS = (5, -12, 14, -21, 23, -30)
_MARKED = ((50.0, "p50"), (90.0, "p90"), (99.0, "p99"), (99.9, "p99.9"))


def _percentile(sorted_values: Sequence[float], percentile: float) -> float:
    """The nearest-rank percentile of ``sorted_values`` (the same definition HdrHistogram uses)."""
    rank = max(1, -(-len(sorted_values) * percentile // 100))
    return sorted_values[min(int(rank), len(sorted_values)) - 1]


def plot_latency_cdf(
    latencies_ms: Mapping[str, Sequence[float]],
    path: str | Path,
    *,
    title: str = "Publish latency: unhedged vs hedged",
    subtitle: str | None = None,
) -> Path:
    """Draw the latency CDF of each publisher in ``latencies_ms`` and save it as a PNG at ``path``.

    Each publisher's p50, p90, p99 and p99.9 are marked on its curve and labelled with their value.
    Publishers without any latency are left out. Returns the path written.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display: the bench runs in terminals and CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(9, 5.5), dpi=110)
    try:
        highest_share = 0.999
        others = iter(_OTHER_COLOURS * len(latencies_ms))
        for index, (name, values) in enumerate(latencies_ms.items()):
            ordered = sorted(values)
            count = len(ordered)
            if count == 0:
                continue
            # plotting positions (i + 0.5) / n stay inside (0, 1), where the logit scale is defined
            shares = [(rank + 0.5) / count for rank in range(count)]
            highest_share = max(highest_share, shares[-1])
            colour = _COLOURS.get(name) or next(others)
            axes.step(ordered, shares, where="post", color=colour, linewidth=1.8, label=f"{name} ({count:,})")
            for percentile, label in _MARKED:
                value = _percentile(ordered, percentile)
                share = percentile / 100.0
                axes.plot([value], [share], marker="o", color=colour, markersize=5, zorder=3)
                axes.annotate(
                    f"{label} {value:,.0f} ms" if value >= 10 else f"{label} {value:.1f} ms",
                    (value, share),
                    textcoords="offset points",
                    xytext=(6, _LABEL_OFFSETS[index % len(_LABEL_OFFSETS)]),
                    fontsize=8,
                    color=colour,
                )
        axes.set_xscale("log")
        axes.set_yscale("logit")
        axes.set_ylim(0.3, min(highest_share, 0.9999))
        axes.yaxis.set_major_formatter(FuncFormatter(lambda share, _: f"{share * 100:g}%"))
        axes.yaxis.set_minor_formatter(FuncFormatter(lambda share, _: ""))
        axes.set_yticks([0.5, 0.9, 0.99, 0.999])
        axes.xaxis.set_major_formatter(FuncFormatter(lambda ms, _: f"{ms:g} ms"))
        axes.set_xlabel("publish latency, caller side (log scale)")
        axes.set_ylabel("share of publishes at or below (logit scale)")
        axes.grid(True, which="major", alpha=0.35)
        axes.grid(True, which="minor", axis="x", alpha=0.12)
        axes.legend(loc="lower right")
        axes.set_title(title if subtitle is None else f"{title}\n{subtitle}", fontsize=11)
        figure.tight_layout()
        figure.savefig(path, format="png")
    finally:
        plt.close(figure)
    return path
