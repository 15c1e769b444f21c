"""A dependency-free SVG line plot for the benchmark commands (tokens/s against concurrency)."""

import math


def svg_plot(xs, series: dict, title: str, xlabel: str, ylabel: str) -> str:
    """A line plot with a log2 x axis (concurrency doubles) and one line per series."""
    w, h, left, right, top, bottom = 640, 400, 70, 170, 40, 50
    pw, ph = w - left - right, h - top - bottom
    ymax = max(max(v) for v in series.values())
    step = 10 ** math.floor(math.log10(ymax / 2)) if ymax > 0 else 1
    ticks = [i * step for i in range(int(ymax // step) + 2)]
    ytop = ticks[-1] or 1
    lx = [math.log2(x) for x in xs]
    x0, x1 = min(lx), max(lx) if max(lx) > min(lx) else min(lx) + 1

    def px(x):
        return left + (math.log2(x) - x0) / (x1 - x0) * pw

    def py(y):
        return top + ph - y / ytop * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
           f'font-size="12"><rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{left}" y="22" font-size="14">{title}</text>']
    for t in ticks:
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="#ddd"/>'
                   f'<text x="{left - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
    for x in xs:
        out.append(f'<line x1="{px(x):.1f}" x2="{px(x):.1f}" y1="{top}" y2="{top + ph}" stroke="#eee"/>'
                   f'<text x="{px(x):.1f}" y="{top + ph + 16}" text-anchor="middle">{x}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>')
    out.append(f'<text x="{left + pw / 2}" y="{h - 10}" text-anchor="middle">{xlabel}</text>')
    out.append(f'<text transform="translate(18 {top + ph / 2}) rotate(-90)" text-anchor="middle">{ylabel}</text>')
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    for i, (name, ys) in enumerate(series.items()):
        c = colors[i % len(colors)]
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys))
        out.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="2"/>')
        out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.5" fill="{c}"/>' for x, y in zip(xs, ys)]
        ly = top + 16 + 20 * i
        out.append(f'<line x1="{left + pw + 12}" x2="{left + pw + 32}" y1="{ly - 4}" y2="{ly - 4}" stroke="{c}" '
                   f'stroke-width="2"/><text x="{left + pw + 38}" y="{ly}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
