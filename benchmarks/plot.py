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
