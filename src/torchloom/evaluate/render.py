"""What every report page draws with: a matplotlib figure on Agg (no pyplot, nothing global changed) and its PNG,
a number and a Markdown table cell as the report writes them (evaluate/report.py, evaluate/tags.py)."""

from __future__ import annotations

import io
import math
from typing import Any


def figure(width: float, height: float, rows: int = 1, height_ratios: tuple[int, ...] | None = None):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    if rows == 1:
        return fig, fig.add_subplot()
    axes = fig.subplots(rows, 1, sharex=True, gridspec_kw={"height_ratios": height_ratios})
    return fig, axes


def png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


def fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if isinstance(value, float):
        # Small values such as learning rates keep their significant digits.
        return f"{value:.4f}" if value == 0 or abs(value) >= 1e-3 else f"{value:.3g}"
    return str(value)


def cell(value: Any) -> str:
    """Text safe inside a Markdown table cell."""
    return str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def heatmap(share, names: list[str], legend: str):
    """A figure and axes with `share` [k, k] in 0..1 drawn over the names on both axes, and its colour bar."""
    k = len(names)
    size = min(max(4.5, 0.7 * k + 2.5), 24.0)
    fig, ax = figure(size, size * 0.85)
    image = ax.imshow(share, cmap="Blues", vmin=0.0, vmax=1.0)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label=legend)
    ax.set_xticks(range(k), labels=names, rotation=45 if k > 3 else 0, ha="right" if k > 3 else "center")
    ax.set_yticks(range(k), labels=names)
    return fig, ax

