"""Plot a closed-answer calibration (scripts/calibrate_closed.py) as one SVG (no plotting library needed).

    python scripts/plot_calibration.py [weights/offline/calibration.json] -o docs/calibration.svg

Two panels, both from the out-of-fold confidences (each question scored by a fit that had not seen
its image): the reliability diagram (per bin, mean confidence against the share right, with its
count; on the diagonal a confidence means what it says) and the risk-coverage curve (answering only
the most confident questions: the share answered against their accuracy), with the abstention
threshold the app uses marked. A file older than the curve draws the first panel only.
`--group grey|colour` draws the fit of one image group instead (the one the app uses for such images;
"grey, worded like training" and the like for a file fitted with --wording-similarity, "grey, image encoder
agrees" and the like for one fitted with --head-agreement):

    python scripts/plot_calibration.py --group grey -o docs/calibration-grey.svg
"""

from __future__ import annotations

import argparse
import html
import json
import math
from pathlib import Path

WIDTH, HEIGHT, PAD = 340, 280, 46
LINE, MARK, GUIDE = "#1f77b4", "#d62728", "#999"


def svg(calibration: dict, title: str = "") -> str:
    held_out = calibration.get("out_of_fold", {})
    if not held_out.get("reliability"):
        raise SystemExit("no out-of-fold reliability table in this file: refit it with scripts/calibrate_closed.py")
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * WIDTH}" height="{HEIGHT + 40}" '
             f'font-family="sans-serif" font-size="11">', '<rect width="100%" height="100%" fill="white"/>',
             f'<text x="10" y="16" font-size="13">{html.escape(title)}</text>']
    parts += _reliability_panel(held_out["reliability"], left=PAD)
    parts += _risk_coverage_panel(held_out, calibration.get("threshold"), left=WIDTH + PAD)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _axes(left: float, label: str, x_label: str, y_label: str):
    """A unit square panel with its ticks and labels; returns the parts and the data -> pixel map."""
    top, inner_w, inner_h = 46, WIDTH - PAD - 14, HEIGHT - 70

    def at(x: float, y: float) -> tuple[float, float]:
        return left + x * inner_w, top + inner_h - y * inner_h

    parts = [f'<rect x="{left}" y="{top}" width="{inner_w}" height="{inner_h}" fill="none" stroke="{GUIDE}"/>',
             f'<text x="{left}" y="{top - 8}">{html.escape(label)}</text>',
             f'<text x="{left + inner_w / 2}" y="{top + inner_h + 30}" text-anchor="middle">{html.escape(x_label)}</text>',
             f'<text transform="translate({left - 34},{top + inner_h / 2}) rotate(-90)" text-anchor="middle">'
             f'{html.escape(y_label)}</text>']
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        x, y = at(tick, tick)
        parts.append(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{tick:g}</text>')
        parts.append(f'<text x="{x:.1f}" y="{top + inner_h + 14}" text-anchor="middle">{tick:g}</text>')
    return parts, at


def _reliability_panel(bins: list[dict], left: float) -> list[str]:
    parts, at = _axes(left, "reliability, out of fold", "mean confidence of the bin", "share right")
    (x0, y0), (x1, y1) = at(0, 0), at(1, 1)
    parts.append(f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y1}" stroke="{GUIDE}" stroke-dasharray="4 3"/>')
    points = [at(row["mean_confidence"], row["accuracy"]) for row in bins]
    parts.append(f'<polyline points="{_path(points)}" fill="none" stroke="{LINE}" stroke-width="2"/>')
    largest = max(row["n"] for row in bins)
    for index, (row, (x, y)) in enumerate(zip(bins, points)):
        radius = 2.5 + 5 * math.sqrt(row["n"] / largest)  # area grows with the count
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{radius:.1f}" fill="{LINE}" fill-opacity="0.6"/>')
        below = 12 if index % 2 else -4  # neighbouring bins' counts above and below, apart where bins crowd
        parts.append(f'<text x="{x + radius:.1f}" y="{y + below:.1f}">n = {row["n"]}</text>')
    return parts


def _risk_coverage_panel(held_out: dict, threshold: dict | None, left: float) -> list[str]:
    parts, at = _axes(left, "risk-coverage, out of fold", "share answered", "accuracy of the answered")
    curve = held_out.get("risk_coverage")
    if not curve:
        x, y = at(0.5, 0.5)
        return parts + [f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="middle">no curve in this file '
                        f'(older than it)</text>']
    points = [at(x, y) for x, y in zip(curve["coverage"], curve["accuracy_answered"])]
    parts.append(f'<polyline points="{_path(points)}" fill="none" stroke="{LINE}" stroke-width="2"/>')
    if threshold and threshold.get("met"):
        share, accuracy = threshold["answered_share_out_of_fold"], threshold["accuracy_answered_out_of_fold"]
        label = f'chosen min_confidence {threshold["min_confidence"]:g}'
    else:  # the app keeps decoder.min_confidence: mark where that stood out of fold
        share, accuracy = held_out.get("answered"), held_out.get("accuracy_answered")
        label = f'min_confidence {held_out.get("min_confidence", "?")} (configured' + (
            ", no threshold met the target)" if threshold else ")")
    if threshold:
        (x0, y), (x1, _) = at(0, threshold["target_accuracy"]), at(1, 0)
        parts.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x1}" y2="{y:.1f}" stroke="{GUIDE}" stroke-dasharray="4 3"/>')
        parts.append(f'<text x="{x0 + 4}" y="{y - 4:.1f}">target {threshold["target_accuracy"]:g}</text>')
    if share and accuracy is not None:
        x, y = at(share, accuracy)
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{MARK}"/>')
        anchor = "end" if share > 0.5 else "start"
        parts.append(f'<text x="{x + (-6 if share > 0.5 else 6):.1f}" y="{y + 14:.1f}" text-anchor="{anchor}" '
                     f'fill="{MARK}">{html.escape(label)}</text>')
    return parts


def _path(points: list[tuple[float, float]]) -> str:
    return " ".join(f"{x:.1f},{y:.1f}" for x, y in points)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("calibration", nargs="?", default=None,
                        help="calibration JSON (default: the offline profile's decoder.calibration)")
    parser.add_argument("-o", "--output", type=Path, default=Path("docs/calibration.svg"), help="the SVG file to write")
    parser.add_argument("--group", default=None, help="an image group's fit (grey, colour) instead of the pooled one")
    args = parser.parse_args(argv)
    if args.calibration is None:
        from medvqa.config import load_settings

        args.calibration = load_settings("offline").decoder.calibration
    calibration = json.loads(Path(args.calibration).read_text())
    fitted = calibration.get("fitted_on", {})
    if args.group is not None:
        groups = calibration.get("groups") or {}
        if args.group not in groups:
            raise SystemExit(f"{args.calibration} has no fit for image group {args.group!r} "
                             f"(it has: {', '.join(sorted(groups)) or 'none'})")
        calibration = fitted = groups[args.group]
    group = args.group or ""
    images = (f"{group.split(',')[0]} training images" if group else "training images") + (
        ", questions worded like the training ones" if "worded like training" in group else
        ", questions worded otherwise" if "worded otherwise" in group else
        ", answers the encoder's head agrees with" if "encoder agrees" in group else
        ", answers the encoder's head disagrees with" if "encoder disagrees" in group else "")
    title = (f"{Path(args.calibration).name}: {fitted.get('questions', '?')} held-out closed questions "
             f"on {fitted.get('images', '?')} {images}")
    args.output.write_text(svg(calibration, title))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
