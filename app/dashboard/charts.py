"""Charts drawn on the server as inline SVG: no chart library, nothing to download, and the
numbers stay readable without scripts (every bar and point has a ``<title>``, which browsers
show on hover). Axes carry "nice" ticks (1, 2 or 5 times a power of ten) with gridlines, so a
value can be read off the chart, not only from its tooltip."""

from __future__ import annotations

import math
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


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round values covering ``[lo, hi]`` (Heckbert's "nice numbers"): steps of
    1, 2 or 5 times a power of ten, the first tick at or below ``lo``, the last at or above
    ``hi``."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0]
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:  # one value: a unit around it (an axis of zeros runs 0 to 1)
        lo, hi = (0.0, 1.0) if lo == 0 else (lo - 1, hi + 1)
    raw = (hi - lo) / max(1, count - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step + 1e-9) * step
    ticks = [round(first, 12)]
    while ticks[-1] < hi - step * 1e-9 and len(ticks) < 50:
        ticks.append(round(first + step * len(ticks), 12))
    return ticks


def _svg_open(title: str, width: int, height: int) -> list[str]:
    return [
        f'<svg class="chart" role="img" aria-label="{escape(title)}" viewBox="0 0 {width} {height}"'
        f' width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">',
        f'<text x="4" y="16" class="chart-title">{escape(title)}</text>',
    ]


def bar_chart(
    title: str, bars: Sequence[tuple[str, float]], *, highlight: str | None = None
) -> Markup:
    """Horizontal bars, one per ``(label, value)``; negative values go left of the zero line.
    ``highlight`` (a label) is drawn in the accent colour. A value axis with ticks and
    gridlines runs along the bottom."""
    label_w, bar_w, row_h, pad, axis_h = 150, 260, 22, 6, 18
    rows_h = row_h * max(1, len(bars))
    height = pad * 2 + 20 + rows_h + axis_h
    width = label_w + bar_w + 70
    values = [v for _, v in bars]
    lo, hi = min([0.0, *values]), max([0.0, *values])
    span = (hi - lo) or 1.0
    zero = label_w + bar_w * (0 - lo) / span
    bottom = 22 + rows_h + 2
    parts = _svg_open(title, width, height)
    parts.append(
        f'<line x1="{zero:.1f}" y1="22" x2="{zero:.1f}" y2="{bottom}" class="axis"/>',
    )
    for tick in nice_ticks(lo, hi, 4):
        if tick < lo - 1e-12 or tick > hi + 1e-12:
            continue
        x = label_w + bar_w * (tick - lo) / span
        parts.append(
            f'<line x1="{x:.1f}" y1="22" x2="{x:.1f}" y2="{bottom}" class="grid"/>'
            f'<text x="{x:.1f}" y="{bottom + 13}" text-anchor="middle" class="tick">'
            f"{_short(tick)}</text>"
        )
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
    title: str,
    series: dict[str, Sequence[tuple[float, float]]],
    *,
    x_label: str = "epoch",
    y_label: str = "",
    y_range: tuple[float, float] | None = None,
    thin: Sequence[str] = (),
) -> Markup:
    """One polyline per series over a shared x axis, points marked (so one epoch shows) with
    their value as a hover title; ticks and gridlines on both axes. ``y_range`` fixes the y
    axis (accuracy: 0 to 1); ``thin`` names series drawn dashed with small marks (sub-epoch
    points beside the per-epoch ones)."""
    series = {name: pts for name, pts in series.items() if pts}  # no legend for nothing
    points = [p for s in series.values() for p in s]
    if not points:
        return Markup("")
    # the legend's margin fits its longest name (about 7 px a character at 12 px)
    right = min(240, max(110, 16 + 7 * max(len(name) for name in series)))
    plot_w, height, left, top, bottom = 284, 250, 56, 26, 44
    width = left + plot_w + right
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x_ticks = nice_ticks(min(xs), max(xs), 6)
    if y_range is not None:
        y_ticks = nice_ticks(*y_range, 6)
    else:
        y_ticks = nice_ticks(min(0.0, min(ys)), max(ys), 5)
    x_lo, x_hi = min(x_ticks[0], min(xs)), max(x_ticks[-1], max(xs))
    y_lo, y_hi = min(y_ticks[0], min(ys)), max(y_ticks[-1], max(ys))
    x_span, y_span = (x_hi - x_lo) or 1.0, (y_hi - y_lo) or 1.0
    plot_h = height - top - bottom

    def sx(x: float) -> float:
        return left + plot_w * (x - x_lo) / x_span

    def sy(y: float) -> float:
        return top + plot_h * (1 - (y - y_lo) / y_span)

    parts = _svg_open(title, width, height)
    for tick in y_ticks:
        y = sy(tick)
        parts.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" class="grid"/>'
            f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end" class="tick">'
            f"{_short(tick)}</text>"
        )
    for tick in x_ticks:
        x = sx(tick)
        parts.append(
            f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + plot_h}" class="grid"/>'
            f'<text x="{x:.1f}" y="{top + plot_h + 14}" text-anchor="middle" class="tick">'
            f"{_short(tick)}</text>"
        )
    parts += [
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" class="axis"/>',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}"'
        ' class="axis"/>',
        f'<text x="{left + plot_w / 2:.1f}" y="{height - 6}" text-anchor="middle"'
        f' class="axis-label">{escape(x_label)}</text>',
    ]
    if y_label:
        parts.append(
            f'<text transform="translate(12 {top + plot_h / 2:.1f}) rotate(-90)"'
            f' text-anchor="middle" class="axis-label">{escape(y_label)}</text>'
        )
    for n, (name, pts) in enumerate(series.items()):
        colour = PALETTE[n % len(PALETTE)]
        is_thin = name in thin
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        stroke = 'stroke-width="1.2" stroke-dasharray="4 3"' if is_thin else 'stroke-width="2"'
        parts.append(
            f'<g class="series" data-series="{escape(name)}">'
            f'<polyline points="{coords}" fill="none" stroke="{colour}" {stroke}/>'
        )
        for x, y in pts:
            parts.append(
                f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="{2 if is_thin else 3.5}"'
                f' fill="{colour}"><title>{escape(name)} at {escape(x_label)} {x:.4g}:'
                f" {_fmt(y)}</title></circle>"
            )
        parts.append(
            f'<text x="{width - right + 8}" y="{top + 14 + 16 * n}" fill="{colour}">'
            f"{escape(name)}</text></g>"
        )
    parts.append("</svg>")
    return Markup("".join(parts))
