"""Bar charts of bench figures (``--plot PATH``); matplotlib is imported only here, only when drawing."""

from __future__ import annotations

import textwrap
from typing import Any, List

TITLE_WIDTH = 90  # characters per line of the chart's title
LABEL_WIDTH = 34  # characters per line of a loader's name
REFERENCE_COLOUR, OTHER_COLOUR, MISSING_COLOUR = "#2b6cb0", "#a0aec0", "#e2e8f0"


def image_chart(path: str, title: str, rows: List[Any], reference: str) -> None:
    """Draws the images/s of each loader (median, whiskers from the slowest to the fastest run).

    ``rows`` are :class:`benchmarks.images.Figures`; the ``reference``
    loader's bar is highlighted and each other bar is labelled with the
    reference's ratio to it and its target. The format follows the suffix of
    ``path``. Raises ``ImportError`` without matplotlib.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    names = [textwrap.fill(row.name, LABEL_WIDTH) for row in rows]
    values = [row.images_per_s or 0.0 for row in rows]
    low = [0.0 if row.slowest is None else v - row.slowest for v, row in zip(values, rows)]
    high = [0.0 if row.fastest is None else row.fastest - v for v, row in zip(values, rows)]
    colours = [MISSING_COLOUR if row.images_per_s is None else
               REFERENCE_COLOUR if row.loader == reference else OTHER_COLOUR for row in rows]

    figure, axes = plt.subplots(figsize=(9, 0.75 * len(rows) + 1.6))
    positions = list(range(len(rows)))[::-1]  # the first row on top
    axes.barh(positions, values, color=colours, xerr=[low, high], capsize=3)
    axes.set_yticks(positions, names, fontsize=8)
    axes.set_xlabel("images/s (median; whiskers: slowest and fastest run)")
    axes.set_title(textwrap.fill(title, TITLE_WIDTH), fontsize=8)
    top = max(values + [1.0])
    for position, value, above, row in zip(positions, values, high, rows):
        if row.images_per_s is None:
            caption = "not run" if not row.runs else "failed"
        else:
            caption = f"{value:,.0f}"
            if row.ratio is not None:
                caption += f"   drop-in {row.ratio:.2f}x"
                if row.target is not None:
                    caption += f" (target >= {row.target:g}x)"
            if row.disturbed:
                caption += "   * disturbed by other processes"
        axes.text(value + above + top * 0.01, position, caption, va="center", fontsize=8)
    axes.set_xlim(0, top * 1.45)  # room for the captions
    figure.tight_layout()
    figure.savefig(path, dpi=150)
    plt.close(figure)


def remote_chart(path: str, title: str, panels: List[Any], reference: str, ceiling: str) -> None:
    """Draws ``bench --remote``: one panel per row of objects, the samples/s of each loader.

    ``panels`` are ``(heading, [(loader, name, samples_per_s or None), ...])``;
    the ``reference`` loader's bar is highlighted, the ``ceiling`` loader (the
    server's own rate) is drawn as a dashed line too, and each bar is labelled
    with its rate and its share of the ceiling. The format follows the suffix
    of ``path``. Raises ``ImportError`` without matplotlib.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    count = max(len(bars) for _, bars in panels)
    figure, all_axes = plt.subplots(len(panels), 1, figsize=(9, len(panels) * (0.42 * count + 1.2) + 0.6),
                                    squeeze=False)
    for axes, (heading, bars) in zip(all_axes[:, 0], panels):
        names = [textwrap.fill(name, LABEL_WIDTH + 16) for _, name, _ in bars]
        values = [rate or 0.0 for _, _, rate in bars]
        colours = [MISSING_COLOUR if rate is None else REFERENCE_COLOUR if loader == reference
                   else OTHER_COLOUR for loader, _, rate in bars]
        positions = list(range(len(bars)))[::-1]  # the first loader on top
        axes.barh(positions, values, color=colours)
        axes.set_yticks(positions, names, fontsize=7)
        axes.set_title(heading, fontsize=8)
        axes.set_xlabel("samples/s (median)", fontsize=8)
        top = max(values + [1.0])
        roof = next((rate for loader, _, rate in bars if loader == ceiling and rate), None)
        if roof:
            axes.axvline(roof, color="#c53030", linestyle="--", linewidth=1)
        for position, value, (_, _, rate) in zip(positions, values, bars):
            caption = "not run" if rate is None else f"{value:,.0f}"
            if rate is not None and roof:
                caption += f"  ({value / roof:.2f} of the ceiling)"
            axes.text(value + top * 0.01, position, caption, va="center", fontsize=7)
        axes.set_xlim(0, top * 1.45)  # room for the captions
    figure.suptitle(textwrap.fill(title, TITLE_WIDTH), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=150)
    plt.close(figure)
