"""scripts/bench_app.py's load curve on a tiny run: one app start, one line per level in the
documented format, every answer clean."""

from __future__ import annotations

import re

from .conftest import load_script

LEVEL_LINE = re.compile(r"^clients=(\d+) answers=(\d+) errors=0 mixups=0 ttft_p50_s=[\d.]+ ttft_p95_s=[\d.]+ "
                        r"tpot_p50_ms=(nan|[\d.]+) tpot_p95_ms=(nan|[\d.]+) e2e_p50_s=[\d.]+ "
                        r"tokens_per_s=[\d.]+ goodput=(0|1)\.\d\d$")


def test_the_load_curve_prints_one_line_per_level(tiny_pipeline, tiny_cache, monkeypatch, capsys):
    """(tiny_pipeline: the tiny models are built once, in the test process; the app finds them in the
    shared cache.)"""
    bench = load_script("bench_app")
    monkeypatch.setenv("MEDVQA_CACHE", str(tiny_cache))
    monkeypatch.setenv("MEDVQA_RETRIEVAL__ENABLED", "false")
    monkeypatch.setenv("MEDVQA_DECODER__MAX_NEW_TOKENS", "8")
    assert bench.main(["--profile", "tiny", "--clients", "1", "2", "--questions", "2", "--arrival", "staggered",
                       "--stagger-s", "0.1", "--warm"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("clients=")]
    levels = [LEVEL_LINE.match(line) for line in lines]
    assert all(levels), lines
    assert [(int(m.group(1)), int(m.group(2))) for m in levels] == [(1, 2), (2, 4)]


def test_level_figures_from_session_results():
    bench = load_script("bench_app")
    fast = bench.SessionResult(0, answers=2, ttft_s=[0.5, 0.8], tpot_s=[0.02, None], e2e_s=[1.0, 1.2], pieces=11)
    slow = bench.SessionResult(1, answers=1, ttft_s=[1.5], tpot_s=[0.06], e2e_s=[3.0], pieces=9)
    summary = bench.summarise([fast, slow], wall_s=4.0)
    assert summary["answers"] == 3 and summary["tokens_per_s"] == 5.0
    assert abs(summary["goodput"] - 2 / 3) < 1e-9  # the slow answer misses both targets
    assert summary["tpot_p50_ms"] == 40.0  # of the answers that have a TPOT (two pieces or more)
    line = bench.level_line(2, summary)
    assert line.startswith("clients=2 answers=3 errors=0 mixups=0 ttft_p50_s=0.80 ")
    assert line.endswith("tokens_per_s=5.0 goodput=0.67")


def test_the_curve_plot_draws_each_run_in_each_panel(tmp_path):
    """scripts/plot_load_curve.py reads bench_app.py's level lines (other lines ignored) and draws
    one line per run in each of its three panels."""
    import xml.etree.ElementTree as ElementTree

    plot = load_script("plot_load_curve")
    runs = []
    for name, scale in (("before", 1.0), ("after", 0.5)):
        lines = ["starting app.py --profile offline"] + [
            f"clients={n} answers={2 * n} errors=0 mixups=0 ttft_p50_s={0.1 * n * scale:.2f} "
            f"ttft_p95_s={0.2 * n * scale:.2f} tpot_p50_ms={20 * n * scale:.1f} tpot_p95_ms=nan e2e_p50_s=1.00 "
            f"tokens_per_s={10 * n / scale:.1f} goodput=0.50" for n in (1, 2, 4, 8)]
        (tmp_path / f"{name}.txt").write_text("\n".join(lines) + "\n")
        runs.append(f"{name}={tmp_path / f'{name}.txt'}")
    output = tmp_path / "curve.svg"
    assert plot.main([*runs, "-o", str(output), "--title", "load <curve>"]) == 0
    root = ElementTree.parse(output).getroot()  # well-formed, the title escaped
    lines = root.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 3 * 2 and all(len(line.get("points").split()) == 4 for line in lines)
    texts = {text.text for text in root.iter("{http://www.w3.org/2000/svg}text")}
    assert {"before", "after", "load <curve>", "8"} <= texts
