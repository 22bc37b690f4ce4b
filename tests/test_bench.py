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
