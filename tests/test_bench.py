"""bench_latency.py's helpers: bytes read per token and reading llama.cpp's own benchmark output."""

from __future__ import annotations

import json
import stat

import pytest
import torch

from .conftest import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_latency")


def test_llama_bench_output_is_read_per_test_kind(bench, tmp_path):
    """llama-bench -o json prints one object per test and depth: prefill into an empty context, decode
    after as many context tokens as our prompt (our decode figure follows a prompt too)."""
    tests = [{"n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 201.25},
             {"n_prompt": 512, "n_gen": 0, "n_depth": 512, "avg_ts": 150.0},
             {"n_prompt": 0, "n_gen": 64, "n_depth": 0, "avg_ts": 130.0},
             {"n_prompt": 0, "n_gen": 64, "n_depth": 512, "avg_ts": 88.5}]
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\n"
                    f"echo \"$@\" > {tmp_path / 'args'}\n"
                    f"cat <<'EOF'\n{json.dumps(tests, indent=2)}\nEOF\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    result = bench.run_llama_bench(str(fake), "model.gguf", 512, 64, 2, 3)
    assert result == {"prefill": 201.2, "decode": 88.5}
    assert (tmp_path / "args").read_text().split() == ["-m", "model.gguf", "-p", "512", "-n", "64", "-d", "0,512",
                                                       "-t", "2", "-r", "3", "-o", "json"]


def test_weight_bytes_count_a_tied_head_once(bench):
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(10, 4)
    model.head = torch.nn.Linear(4, 10, bias=False)
    model.head.weight = model.embed.weight
    model.get_input_embeddings = lambda: model.embed
    model.get_output_embeddings = lambda: model.head
    assert bench.weight_bytes_per_token(model) == 10 * 4 * 4


def test_the_batch_shape_benchmark_times_every_shape_on_the_real_decoder(capsys):
    """scripts/bench_llama_batch.py on the offline GGUF (skipped without llama-cpp-python): one row per
    batch shape, each a positive time."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    shapes = load_script("bench_llama_batch")
    assert shapes.main(["--runs", "1", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [row["shape"] for row in summary["shapes"]] == [name for name, _, _ in shapes.SHAPES]
    assert all(row["ms"] > 0 and row["positions_per_s"] > 0 for row in summary["shapes"])
    assert summary["weights"] == "Q4_1" and summary["eight_slot_step_vs_one"] > 0


def test_the_bandwidth_probe_leaves_the_benchmarks_peak_memory_alone():
    """The probe's buffer lives in a child process: `peak_rss_mb` is the app's memory, not the probe's.
    Run in a fresh interpreter, whose peak is not already set by earlier tests."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_latency.py"
    code = ("import importlib.util, resource, sys\n"
            f"spec = importlib.util.spec_from_file_location('bench_latency', {str(script)!r})\n"
            "bench = importlib.util.module_from_spec(spec); spec.loader.exec_module(bench)\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "gbps = bench.measure_bandwidth_gbps(megabytes=512, repeats=2)\n"
            "print(gbps, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    gbps, grown_mb = map(float, out.split()[-2:])
    assert gbps > 0
    assert grown_mb < 64
