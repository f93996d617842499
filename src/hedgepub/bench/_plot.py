"""The bench's plot: the latency distribution of every publisher, with the tail made visible.

The y axis is the cumulative share of publishes on a logit scale, so 50%, 90%, 99% and 99.9% are evenly
spaced and the tail, where hedging acts, gets as much room as the median. The x axis (latency) is
logarithmic because the latencies span 1 ms to seconds.

The percentile values are printed in a small table to the right of the axes, one row per percentile (at
the height of its grid line) and one column per publisher, rather than next to the curves: labels beside
the curves collide with each other and with the curves whenever two publishers have similar latencies, and
a table keeps any number of publishers apart by construction. The values come from the same results as
the printed table and ``results.json`` (:data:`~hedgepub.bench._report.PERCENTILES`, formatted by
:func:`~hedgepub.bench._report.format_ms`), so the three never disagree.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hedgepub.bench._report import PERCENTILES, LatencyRecorder, PublisherResult, format_ms

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Colours per publisher name; other names take the next of _OTHER_COLOURS (neither red nor green).
_COLOURS = {"unhedged": "#d62728", "hedged": "#1f77b4", "adaptive": "#2ca02c"}
_OTHER_COLOURS = ("#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")
#: Line styles in drawing order: the first publisher is drawn widest and solid, each later one narrower
#: and dashed on top of it, so that where two curves coincide both stay visible (the one below shows
#: around and between the dashes of the one above).
_LINE_STYLES: tuple[tuple[float, Any], ...] = (
    (3.2, "solid"),
    (2.0, (0, (6, 3))),
    (1.6, (0, (2, 2))),
    (1.4, (0, (7, 2, 1, 2))),
    (1.2, (0, (1, 1))),
)
_MARKERS = ("o", "s", "D", "^", "v", "P", "X")
#: ``gid`` of the texts of the percentile table (tests find them by it).
LABEL_GID = "percentile-label"
_LABEL_FONT = 8.0
#: points between the axes and the table, and between the table's columns
_GAP_PT = 8.0
_COLUMN_GAP_PT = 10.0
_FIGURE_SIZE = (9.0, 5.5)
#: inches for the axes and their labels, left of the percentile table
_PLOT_WIDTH_IN = 6.8
_DPI = 110


def _results_of(latencies_ms: Mapping[str, Sequence[float]]) -> dict[str, dict[str, Any]]:
    """Results entries computed from raw latencies, the way the bench computes its own."""
    results = {}
    for name, values in latencies_ms.items():
        recorder = LatencyRecorder()
        for value in values:
            recorder.record(value / 1000.0)
        result = PublisherResult.from_measurements(
            recorder, failed=0, attempts_sent=recorder.count, hedges_sent=0, hedges_won=0, duplicates=0
        )
        results[name] = result.to_dict()
    return results


def latency_cdf_figure(
    latencies_ms: Mapping[str, Sequence[float]],
    *,
    results: Mapping[str, Mapping[str, Any]] | None = None,
    title: str = "Publish latency: unhedged vs hedged",
    subtitle: str | None = None,
) -> Figure:
    """The figure :func:`plot_latency_cdf` saves; the caller closes it (``matplotlib.pyplot.close``).

    ``results`` maps each publisher to its ``results.json`` entry (``p50_ms`` ... ``p999_ms``); without
    it, the entries are computed from ``latencies_ms`` the way the bench computes them.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display: the bench runs in terminals and CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    shown = {name: sorted(values) for name, values in latencies_ms.items() if len(values) > 0}
    if results is None:
        results = _results_of(shown)
    figure, axes = plt.subplots(figsize=_FIGURE_SIZE, dpi=_DPI)
    colours: dict[str, str] = {}
    highest_share = 0.0
    # Names without a colour of their own skip the ones taken by named publishers of this plot.
    taken = {_COLOURS[name] for name in latencies_ms if name in _COLOURS}
    others = iter([colour for colour in _OTHER_COLOURS if colour not in taken] * len(latencies_ms))
    for index, (name, ordered) in enumerate(latencies_ms.items()):
        colours[name] = _COLOURS.get(name) or next(others)
        if name not in shown:
            continue
        width, style = _LINE_STYLES[min(index, len(_LINE_STYLES) - 1)]
        marker = _MARKERS[index % len(_MARKERS)]
        ordered = shown[name]
        count = len(ordered)
        # plotting positions (i + 0.5) / n stay inside (0, 1), where the logit scale is defined
        shares = [(rank + 0.5) / count for rank in range(count)]
        highest_share = max(highest_share, shares[-1])
        axes.step(
            ordered, shares, where="post", color=colours[name], linewidth=width, linestyle=style,
            label=f"{name} ({count:,})", zorder=2 + index,
        )  # fmt: skip
        for key, percentile, _ in PERCENTILES:
            value = results.get(name, {}).get(f"{key}_ms")
            if value is not None:
                axes.plot(
                    [value], [percentile / 100.0], marker=marker, color=colours[name], markersize=5,
                    zorder=10 + index, linestyle="none",
                )  # fmt: skip
    axes.set_xscale("log")
    axes.set_yscale("logit")
    # room above the p99.9 row even for short runs, so its marker and label sit clear of the frame
    axes.set_ylim(0.3, min(max(highest_share, 0.9997), 0.9999))
    axes.yaxis.set_major_formatter(FuncFormatter(lambda share, _: f"{share * 100:g}%"))
    axes.yaxis.set_minor_formatter(NullFormatter())
    axes.set_yticks([percentile / 100.0 for _, percentile, _ in PERCENTILES])
    axes.xaxis.set_major_formatter(FuncFormatter(lambda ms, _: f"{ms:g} ms"))
    axes.xaxis.set_minor_formatter(NullFormatter())  # minor labels crowd each other on short ranges
    axes.set_xlabel("publish latency, caller side (log scale)")
    axes.set_ylabel("share of publishes at or below (logit scale)")
    axes.grid(True, which="major", alpha=0.35)
    axes.grid(True, which="minor", axis="x", alpha=0.12)
    if shown:
        axes.legend(loc="lower right")
    table_pt = _percentile_table(axes, {name: results.get(name, {}) for name in shown}, colours)
    # the figure widens with the table, so that more publishers do not squeeze the plot itself
    figure.set_figwidth(max(_FIGURE_SIZE[0], _PLOT_WIDTH_IN + table_pt / 72.0))
    _titles(figure, title, subtitle)
    return figure


def _percentile_table(
    axes: Any,
    results: Mapping[str, Mapping[str, Any]],
    colours: Mapping[str, str],
) -> float:
    """Percentile rows at their grid lines, right of the axes: a label column, then one per publisher.

    Column widths are measured with the renderer, so no column overlaps the next whatever the values.
    Returns the table's width in points.
    """
    from matplotlib.transforms import ScaledTranslation, blended_transform_factory

    figure = axes.figure
    renderer = figure.canvas.get_renderer()
    # x in axes coordinates (right of the axes), y in data coordinates (the percentile's grid line)
    rows = blended_transform_factory(axes.transAxes, axes.transData)
    columns: list[list[tuple[str, float | None, str]]] = [
        [(label, percentile / 100.0, "0.25") for _, percentile, label in PERCENTILES]
    ]
    for name, entry in results.items():
        column: list[tuple[str, float | None, str]] = [(name, None, colours[name])]
        for key, percentile, _ in PERCENTILES:
            value = entry.get(f"{key}_ms")
            column.append((f"{format_ms(value)} ms", percentile / 100.0, colours[name]))
        columns.append(column)
    offset_pt = _GAP_PT
    for column in columns:
        width_pt = 0.0
        for text, share, colour in column:
            rise = 0.0 if share is not None else 6 / 72.0
            shift = ScaledTranslation(offset_pt / 72.0, rise, figure.dpi_scale_trans)
            if share is None:  # the header: above the axes, so above the top row whatever the y range
                artist = axes.text(
                    1.0, 1.0, text, transform=axes.transAxes + shift, ha="left", va="bottom",
                    fontsize=_LABEL_FONT, fontweight="bold", color=colour, gid=LABEL_GID, clip_on=False,
                )  # fmt: skip
            else:
                artist = axes.text(
                    1.0, share, text, transform=rows + shift, ha="left", va="center",
                    fontsize=_LABEL_FONT, color=colour, gid=LABEL_GID, clip_on=False,
                )  # fmt: skip
            width_pt = max(width_pt, artist.get_window_extent(renderer).width * 72.0 / figure.dpi)
        offset_pt += width_pt + _COLUMN_GAP_PT
    return offset_pt


def _titles(figure: Any, title: str, subtitle: str | None) -> None:
    """Title and subtitle in their own band above the axes (and above the table's header)."""
    renderer = figure.canvas.get_renderer()
    width_px = figure.get_figwidth() * figure.dpi * 0.94
    lines = [figure.text(0.5, 0.985, title, ha="center", va="top", fontsize=11, fontweight="bold")]
    if subtitle:
        text = figure.text(0.5, 0.0, subtitle, ha="center", va="top", fontsize=9, color="0.3")
        # a subtitle wider than the figure is wrapped at words
        if text.get_window_extent(renderer).width > width_px:
            characters = max(20, int(len(subtitle) * width_px / text.get_window_extent(renderer).width))
            text.set_text("\n".join(textwrap.wrap(subtitle, characters)))
        lines.append(text)
    top_px = figure.get_figheight() * figure.dpi * 0.985
    for line in lines:
        line.set_y(top_px / (figure.get_figheight() * figure.dpi))
        top_px -= line.get_window_extent(renderer).height + 4
    band = top_px / (figure.get_figheight() * figure.dpi)
    figure.tight_layout(rect=(0.0, 0.0, 1.0, band))


def plot_latency_cdf(
    latencies_ms: Mapping[str, Sequence[float]],
    path: str | Path,
    *,
    results: Mapping[str, Mapping[str, Any]] | None = None,
    title: str = "Publish latency: unhedged vs hedged",
    subtitle: str | None = None,
) -> Path:
    """Draw the latency CDF of each publisher in ``latencies_ms`` and save it as a PNG at ``path``.

    Each publisher's p50, p90, p99 and p99.9 are marked on its curve, and their values are listed in a
    table right of the axes. Pass the bench's ``results`` (``document["results"]``) so that the plot shows
    exactly the numbers of the printed table and ``results.json``. Publishers without any latency are left
    out. Returns the path written.
    """
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure = latency_cdf_figure(latencies_ms, results=results, title=title, subtitle=subtitle)
    try:
        figure.savefig(path, format="png")
    finally:
        plt.close(figure)
    return path


def plot_frontier(
    predictions: Sequence[Any],
    path: str | Path,
    *,
    recommended: str | None = None,
    measured_p99_ms: float | None = None,
    title: str = "Predicted p99 publish latency against extra RPCs",
    subtitle: str | None = None,
) -> Path:
    """Plot ``hedgepub advise``'s predictions: extra RPCs per publish (x) against predicted p99 (y).

    Fixed delays are circles, adaptive ones triangles; the frontier (no other setting is better on both
    axes) is joined by a line; the recommended setting is ringed and named. ``predictions`` are
    :class:`~hedgepub.bench._advise.Prediction` objects. Returns the path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hedgepub.bench._advise import frontier

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(8.5, 5.5), dpi=_DPI)
    try:
        for adaptive, marker, colour, label in (
            (False, "o", "#1f77b4", "fixed delay"),
            (True, "^", "#2ca02c", "adaptive delay"),
        ):
            chosen = [
                p for p in predictions if p.delay.startswith("adaptive") == adaptive and p.name != "unhedged"
            ]
            if chosen:
                axes.scatter(
                    [p.extra_rpcs * 100 for p in chosen], [p.p99_ms for p in chosen], marker=marker,
                    color=colour, alpha=0.55, s=28, label=label, zorder=3,
                )  # fmt: skip
        for p in predictions:
            if p.name == "unhedged":
                axes.scatter([0], [p.p99_ms], marker="s", color=_COLOURS["unhedged"], s=50, zorder=4,
                             label="unhedged")  # fmt: skip
        best = frontier(predictions)
        axes.plot([p.extra_rpcs * 100 for p in best], [p.p99_ms for p in best], color="0.3", linewidth=1.2,
                  linestyle="--", label="frontier", zorder=2)  # fmt: skip
        if measured_p99_ms is not None:
            axes.axhline(measured_p99_ms, color=_COLOURS["unhedged"], linewidth=0.8, alpha=0.6)
        for p in predictions:
            if p.name == recommended:
                axes.scatter([p.extra_rpcs * 100], [p.p99_ms], s=180, facecolors="none", edgecolors="black",
                             linewidths=1.6, zorder=5, label=f"recommended: {p.name}")  # fmt: skip
        axes.set_yscale("log")
        # log-scale minor ticks get labels too when the range is short: the same plain "800 ms" for both
        milliseconds = matplotlib.ticker.FuncFormatter(lambda ms, _: f"{ms:g} ms")
        axes.yaxis.set_major_formatter(milliseconds)
        axes.yaxis.set_minor_formatter(milliseconds)
        axes.set_xlabel("extra RPCs per publish (%)")
        axes.set_ylabel("predicted p99 latency (log scale)")
        axes.grid(True, which="major", alpha=0.35)
        axes.legend(loc="upper right", fontsize=8)
        _titles(figure, title, subtitle)
        figure.savefig(path, format="png")
    finally:
        plt.close(figure)
    return path
