"""Small inline-SVG charts for the HTML report: no JavaScript, no CDN, no image files.

The report must open anywhere (an air-gapped operator laptop, an e-mail attachment), so each
chart is a self-contained ``<svg>`` string built here: a multi-series line chart for
throughput, and vertical / horizontal bar charts for latencies, attempts and DLQ reasons.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

PALETTE = ["#2563eb", "#16a34a", "#dc2626", "#d97706", "#7c3aed", "#0891b2"]
_FONT = 'font-family="system-ui, sans-serif" font-size="11"'


def nice_max(value: float) -> float:
    """A round axis maximum at or above ``value`` (1, 2, 2.5, 5 x 10^n)."""
    if value <= 0:
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        candidate = step * 10**exponent
        if candidate >= value:
            return float(candidate)
    return float(10 ** (exponent + 1))  # pragma: no cover - the loop always returns


def _fmt(value: float) -> str:
    if value >= 1_000_000:
        return f"{value / 1_000_000:g}M"
    if value >= 1_000:
        return f"{value / 1_000:g}k"
    return f"{value:g}"


def _frame(width: int, height: int, title: str, body: list[str]) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">'
        f"<title>{escape(title)}</title>" + "".join(body) + "</svg>"
    )


def _y_axis(left: int, top: int, plot_w: int, plot_h: int, top_value: float) -> list[str]:
    out = []
    for i in range(5):
        value = top_value * i / 4
        y = top + plot_h - plot_h * i / 4
        out.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" '
            'stroke="#e5e7eb"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" {_FONT} '
            f'fill="#6b7280">{_fmt(value)}</text>'
        )
    return out


def line_chart(
    title: str,
    labels: Sequence[str],
    series: dict[str, Sequence[float]],
    *,
    width: int = 860,
    height: int = 240,
) -> str:
    """Lines over ``labels`` (time buckets), one per series, with a legend."""
    left, right, top, bottom = 48, 12, 28, 40
    plot_w, plot_h = width - left - right, height - top - bottom
    peak = nice_max(max((max(v, default=0) for v in series.values()), default=0))
    body = _y_axis(left, top, plot_w, plot_h, peak)
    n = len(labels)

    def x(i: int) -> float:
        return left + (plot_w * i / (n - 1) if n > 1 else plot_w / 2)

    for index, (name, values) in enumerate(series.items()):
        color = PALETTE[index % len(PALETTE)]
        points = " ".join(
            f"{x(i):.1f},{top + plot_h - plot_h * v / peak:.1f}" for i, v in enumerate(values)
        )
        if n == 1:
            cx, cy = points.split(",")
            body.append(f'<circle cx="{cx}" cy="{cy}" r="3" fill="{color}"/>')
        else:
            body.append(
                f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"/>'
            )
        lx = left + index * 130
        body.append(
            f'<rect x="{lx}" y="8" width="10" height="10" fill="{color}"/>'
            f'<text x="{lx + 14}" y="17" {_FONT}>{escape(name)}</text>'
        )
    for i in sorted({0, n // 2, n - 1}) if n else []:
        anchor = "start" if i == 0 and n > 1 else "end" if i == n - 1 and n > 1 else "middle"
        body.append(
            f'<text x="{x(i):.1f}" y="{height - 22}" text-anchor="{anchor}" {_FONT} '
            f'fill="#6b7280">{escape(labels[i])}</text>'
        )
    return _frame(width, height, title, body)


def bar_chart(
    title: str,
    labels: Sequence[str],
    values: Sequence[float],
    *,
    width: int = 420,
    height: int = 220,
    color: str = PALETTE[0],
    unit: str = "",
) -> str:
    """Vertical bars with their values on top."""
    left, right, top, bottom = 48, 12, 16, 36
    plot_w, plot_h = width - left - right, height - top - bottom
    peak = nice_max(max(values, default=0))
    body = _y_axis(left, top, plot_w, plot_h, peak)
    n = max(1, len(values))
    slot = plot_w / n
    for i, (label, value) in enumerate(zip(labels, values, strict=True)):
        h = plot_h * value / peak
        bx = left + i * slot + slot * 0.15
        body.append(
            f'<rect x="{bx:.1f}" y="{top + plot_h - h:.1f}" width="{slot * 0.7:.1f}" '
            f'height="{h:.1f}" fill="{color}"><title>{escape(label)}: {value:g}{unit}</title>'
            "</rect>"
            f'<text x="{bx + slot * 0.35:.1f}" y="{top + plot_h - h - 3:.1f}" '
            f'text-anchor="middle" {_FONT}>{_fmt(value)}</text>'
            f'<text x="{bx + slot * 0.35:.1f}" y="{height - 18}" text-anchor="middle" '
            f'{_FONT} fill="#374151">{escape(label)}</text>'
        )
    return _frame(width, height, title, body)


def hbar_chart(
    title: str,
    labels: Sequence[str],
    values: Sequence[float],
    *,
    width: int = 640,
    color: str = PALETTE[2],
) -> str:
    """Horizontal bars (long labels such as DLQ reasons), largest first as given."""
    row, label_w, top = 22, 300, 8
    height = top * 2 + row * max(1, len(values))
    peak = nice_max(max(values, default=0))
    plot_w = width - label_w - 60
    body = []
    for i, (label, value) in enumerate(zip(labels, values, strict=True)):
        y = top + i * row
        short = label if len(label) <= 48 else label[:47] + "…"
        w = plot_w * value / peak
        body.append(
            f'<text x="{label_w - 8}" y="{y + 15}" text-anchor="end" {_FONT}>'
            f"<title>{escape(label)}</title>{escape(short)}</text>"
            f'<rect x="{label_w}" y="{y + 4}" width="{w:.1f}" height="{row - 8}" '
            f'fill="{color}"/>'
            f'<text x="{label_w + w + 6:.1f}" y="{y + 15}" {_FONT}>{_fmt(value)}</text>'
        )
    return _frame(width, height, title, body)
