"""Shared fixtures: the tiny profile's random models (built once per session) and data locations."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def require_shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}; these tests need ../shared/data")
    return SHARED_DATA


def load_script(name: str):
    """scripts/<name>.py as a module (the scripts are not a package), for testing its functions."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there while the class is made
    spec.loader.exec_module(module)
    return module


def jsonl_bench(folder: Path, images: int, shade: int, rows_of) -> Path:
    """A tiny JSONL split (`folder`/test.jsonl and images/im{i}.png, each a flat grey of `shade` x i) whose rows
    for image i are `rows_of(i)` (dicts without "image"): the layout evaluate.py's --dataset jsonl reads."""
    import json

    import numpy as np
    from PIL import Image

    (folder / "images").mkdir(parents=True)
    rows = []
    for i in range(images):
        Image.fromarray(np.full((40, 40, 3), shade * i, dtype=np.uint8)).save(folder / "images" / f"im{i}.png")
        rows += [{"image": f"im{i}.png", **row} for row in rows_of(i)]
    (folder / "test.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return folder


def stop_process(process, timeout_s: float = 30) -> None:
    """Ask a server the test started to end; kill it if it has not within `timeout_s`."""
    import subprocess

    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()


@contextlib.contextmanager
def prompt_gate(pipeline, gate: str):
    """Run with `retrieval.prompt_gate` set to `gate` on a shared pipeline, then put it back."""
    before = pipeline.settings.retrieval.prompt_gate
    pipeline.settings.retrieval.prompt_gate = gate
    try:
        yield
    finally:
        pipeline.settings.retrieval.prompt_gate = before


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("medvqa-cache")
    return folder


@pytest.fixture(scope="session")
def tiny_settings(tiny_cache):
    from medvqa.config import load_settings

    settings = load_settings("tiny", env={"MEDVQA_CACHE": str(tiny_cache)})
    settings.retrieval.enabled = False
    return settings


@pytest.fixture(scope="session")
def tiny_pipeline(tiny_settings):
    from medvqa.pipeline import Pipeline

    return Pipeline.load(tiny_settings, with_retrieval=False)
