"""Charts drawn on the server as inline SVG: no chart library, nothing to download, and the
numbers stay readable without scripts (every bar and point has a ``<title>``)."""

from __future__ import annotations

from collections.abc import Sequence

from markupsafe import Markup, escape

PALETTE = ("#2563eb", "#d97706", "#059669", "#dc2626", "#7c3aed", "#0891b2", "#65a30d")


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def _short(v: float) -> str:
    """An axis label that fits its margin: 1.49M rather than 1.492e+06."""
    for size, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= size:
            return f"{v / size:.3g}{unit}"
    return _fmt(v)


def bar_chart(
    title: str, bars: Sequence[tuple[str, float]], *, highlight: str | None = None
) -> Markup:
    """Horizontal bars, one per ``(label, value)``; negative values go left of the zero line.
    ``highlight`` (a label) is drawn in the accent colour."""
    label_w, bar_w, row_h, pad = 150, 260, 22, 6
    height = pad * 2 + 20 + row_h * max(1, len(bars))
    width = label_w + bar_w + 70
    values = [v for _, v in bars]
    lo, hi = min([0.0, *values]), max([0.0, *values])
    span = (hi - lo) or 1.0
    zero = label_w + bar_w * (0 - lo) / span
    parts = [
        f'<svg class="chart" role="img" aria-label="{escape(title)}" viewBox="0 0 {width} {height}"'
        f' width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">',
        f'<text x="4" y="16" class="chart-title">{escape(title)}</text>',
        f'<line x1="{zero:.1f}" y1="22" x2="{zero:.1f}" y2="{height - pad}" class="axis"/>',
    ]
    for i, (label, value) in enumerate(bars):
        y = 24 + i * row_h
        x0 = label_w + bar_w * (min(value, 0) - lo) / span
        w = max(1.0, bar_w * abs(value) / span)
        colour = "#d97706" if label == highlight else "#2563eb"
        parts.append(
            f'<g class="bar" data-model="{escape(label)}" data-value="{value!r}">'
            f"<title>{escape(label)}: {_fmt(value)}</title>"
            f'<text x="{label_w - 6}" y="{y + 14}" text-anchor="end">{escape(label)}</text>'
            f'<rect x="{x0:.1f}" y="{y + 3}" width="{w:.1f}" height="{row_h - 6}"'
            f' fill="{colour}"/>'
            f'<text x="{label_w + bar_w + 6}" y="{y + 14}">{_fmt(value)}</text></g>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))


def line_chart(
    title: str, series: dict[str, Sequence[tuple[float, float]]], *, x_label: str = "epoch"
) -> Markup:
    """One polyline per series over a shared x axis (points marked, so one epoch shows)."""
    width, height, left, right, top, bottom = 440, 220, 56, 120, 26, 30
    points = [p for s in series.values() for p in s]
    if not points:
        return Markup("")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x_lo, x_hi = min(xs), max(xs)
    y_lo, y_hi = min(0.0, min(ys)), max(ys)
    x_span, y_span = (x_hi - x_lo) or 1.0, (y_hi - y_lo) or 1.0
    plot_w, plot_h = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + plot_w * (x - x_lo) / x_span if x_hi > x_lo else left + plot_w / 2

    def sy(y: float) -> float:
        return top + plot_h * (1 - (y - y_lo) / y_span)

    parts = [
        f'<svg class="chart" role="img" aria-label="{escape(title)}" viewBox="0 0 {width} {height}"'
        f' width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">',
        f'<text x="4" y="16" class="chart-title">{escape(title)}</text>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" class="axis"/>',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}"'
        ' class="axis"/>',
        f'<text x="{left - 4}" y="{top + 8}" text-anchor="end">{_short(y_hi)}</text>',
        f'<text x="{left - 4}" y="{top + plot_h}" text-anchor="end">{_short(y_lo)}</text>',
        f'<text x="{left}" y="{height - 8}">{x_label} {_fmt(x_lo)}</text>',
        f'<text x="{left + plot_w}" y="{height - 8}" text-anchor="end">{_fmt(x_hi)}</text>',
    ]
    for n, (name, pts) in enumerate(series.items()):
        colour = PALETTE[n % len(PALETTE)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        parts.append(
            f'<g class="series" data-series="{escape(name)}">'
            f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="2"/>'
        )
        for x, y in pts:
            parts.append(
                f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{colour}">'
                f"<title>{escape(name)} at {x_label} {_fmt(x)}: {_fmt(y)}</title></circle>"
            )
        parts.append(
            f'<text x="{width - right + 8}" y="{top + 14 + 16 * n}" fill="{colour}">'
            f"{escape(name)}</text></g>"
        )
    parts.append("</svg>")
    return Markup("".join(parts))
