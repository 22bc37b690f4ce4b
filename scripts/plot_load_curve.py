"""Plot load curves printed by scripts/bench_app.py as one SVG (no plotting library needed).

    python scripts/plot_load_curve.py before=runs/before.txt after=runs/after.txt -o docs/load_curve.svg

Each argument is LABEL=FILE, a file holding bench_app.py's output (its `clients=N ...` lines; other
lines are ignored). The SVG has one panel per figure (TTFT p95, TPOT p50, aggregate tokens/s) against
the number of concurrent sessions, one line per file.
"""

from __future__ import annotations

import argparse
import html
import math
import re
from pathlib import Path

PANELS = [("ttft_p95_s", "time to first token, p95 (s)"), ("tpot_p50_ms", "time per output token, p50 (ms)"),
          ("tokens_per_s", "output tokens/s, all sessions")]
COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
WIDTH, HEIGHT, PAD = 300, 220, 46


def read_levels(path: Path) -> list[dict[str, float]]:
    """The `clients=N key=value ...` lines of a bench_app.py output, as dicts of numbers."""
    levels = []
    for line in path.read_text().splitlines():
        if not line.startswith("clients="):
            continue
        fields = dict(re.findall(r"(\w+)=([-+.\w]+)", line))
        levels.append({key: float(value) for key, value in fields.items()})
    return levels


def svg(series: list[tuple[str, list[dict[str, float]]]], title: str = "") -> str:
    clients = sorted({level["clients"] for _, levels in series for level in levels})
    if not clients:
        raise SystemExit("no `clients=` lines in the files given")
    x_low, x_high = math.log2(min(clients)), math.log2(max(clients))
    shift = 20 if title else 0  # the title's line, above the panels' own labels
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH * len(PANELS)}" height="{HEIGHT + 60 + shift}" '
             f'font-family="sans-serif" font-size="11">', '<rect width="100%" height="100%" fill="white"/>']
    if title:
        parts.append(f'<text x="10" y="16" font-size="13">{html.escape(title)}</text>')
    for panel, (key, label) in enumerate(PANELS):
        left, top = panel * WIDTH + PAD, 30 + shift
        inner_w, inner_h = WIDTH - PAD - 14, HEIGHT - 40
        values = [level[key] for _, levels in series for level in levels if math.isfinite(level.get(key, math.nan))]
        high = max(values, default=1.0) * 1.1 or 1.0

        def at(x: float, y: float) -> tuple[float, float]:
            spread = (math.log2(x) - x_low) / (x_high - x_low) if x_high > x_low else 0.5
            return left + spread * inner_w, top + inner_h - y / high * inner_h

        parts.append(f'<rect x="{left}" y="{top}" width="{inner_w}" height="{inner_h}" fill="none" stroke="#999"/>')
        parts.append(f'<text x="{left}" y="{top - 6}">{html.escape(label)}</text>')
        for tick in range(5):
            y_value = high * tick / 4
            _, y = at(clients[0], y_value)
            parts.append(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{y_value:.3g}</text>')
        for n in clients:
            x, _ = at(n, 0)
            parts.append(f'<text x="{x:.1f}" y="{top + inner_h + 14}" text-anchor="middle">{n:g}</text>')
        parts.append(f'<text x="{left + inner_w / 2}" y="{top + inner_h + 28}" text-anchor="middle">'
                     f'concurrent sessions</text>')
        for index, (name, levels) in enumerate(series):
            colour = COLOURS[index % len(COLOURS)]
            points = [at(level["clients"], level[key]) for level in levels
                      if math.isfinite(level.get(key, math.nan))]
            if points:
                path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
                parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
                parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{colour}"/>' for x, y in points]
    for index, (name, _) in enumerate(series):
        x = 10 + index * 180
        colour = COLOURS[index % len(COLOURS)]
        parts.append(f'<rect x="{x}" y="{HEIGHT + 42 + shift}" width="12" height="4" fill="{colour}"/>')
        parts.append(f'<text x="{x + 16}" y="{HEIGHT + 48 + shift}">{html.escape(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("series", nargs="+", help="LABEL=FILE: bench_app.py output to draw as one line")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the SVG file to write")
    parser.add_argument("--title", default="", help="a line above the panels")
    args = parser.parse_args(argv)
    series = []
    for item in args.series:
        label, _, file = item.partition("=")
        if not file:
            parser.error(f"{item!r} is not LABEL=FILE")
        series.append((label, read_levels(Path(file))))
    args.output.write_text(svg(series, args.title))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
