"""The dashboard's server-side SVG charts: bars measured from the zero line (negative scores
go left), the values in their titles, axis labels that fit."""

from __future__ import annotations

import re

import pytest

from zoopick.app.dashboard.charts import _short, bar_chart, line_chart


def test_bars_are_proportional_and_negative_values_go_left_of_zero():
    svg = str(bar_chart("sms", [("a", 2.0), ("b", -1.0), ("c<script>", 0.5)], highlight="a"))
    rects = re.findall(r'<rect x="([\d.]+)" y="[\d.]+" width="([\d.]+)"', svg)
    zero = float(re.search(r'<line x1="([\d.]+)"', svg).group(1))
    (xa, wa), (xb, wb), (xc, wc) = [(float(x), float(w)) for x, w in rects]
    assert xa == zero and xc == zero and xb + wb == pytest.approx(zero, abs=0.1)  # b ends at 0
    # lengths in proportion to the values: a span of 3 over 260 px (drawn to 0.1 px)
    assert (wa, wb, wc) == pytest.approx((260 * 2 / 3, 260 / 3, 260 / 6), abs=0.06)
    assert "<script>" not in svg and "c&lt;script&gt;" in svg  # labels are escaped
    assert svg.count('fill="#d97706"') == 1  # the highlighted model


def test_lines_mark_every_point_and_axis_labels_stay_short():
    svg = str(line_chart("curve", {"loss": [(1, 2.0), (2, 1.0)], "acc": [(1, 0.5)]}))
    assert "loss at epoch 2: 1" in svg and "acc at epoch 1: 0.5" in svg
    assert svg.count("<circle") == 3
    assert str(line_chart("empty", {})) == ""
    assert (_short(1_491_916), _short(12_345), _short(0.25)) == ("1.49M", "12.3k", "0.25")
