"""The literature index built beside the running app (retrieval.background, app.py's first start):
the app answers at once without sources and says why, the index arrives while it serves, a build that
fails leaves it serving without literature, and the build ends with the app."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from medvqa.config import RetrievalConfig
from medvqa.retrieval.background import IndexBuild
from medvqa.retrieval.index import default_index_ready

from .test_browser import browser  # noqa: F401 - the fixture
from .test_retrieval import EMBEDDER, corpus_rows, write_jsonl

REPO = Path(__file__).resolve().parents[1]


def _config(root: Path, corpus: Path, name: str = "default") -> RetrievalConfig:
    return RetrievalConfig(embedder=EMBEDDER, index_dir=str(root / "index"), index_name=name,
                           corpus=[str(corpus)], device="cpu", top_k=3, chunk_tokens=64, chunk_overlap=16)


def test_the_build_runs_in_a_child_and_hands_over_an_open_retriever(tmp_path):
    config = _config(tmp_path, write_jsonl(tmp_path / "corpus.jsonl", corpus_rows()))
    handed = []
    build = IndexBuild(config, on_ready=handed.append)
    assert build.building and build.describe() == "being built: starting"
    build.start()
    assert build.wait(300), "the build did not end"
    assert build.state == "ready", build.error
    assert build.pid is not None and build.pid != os.getpid()  # built in a process of its own
    assert default_index_ready(config)
    (retriever,) = handed
    assert retriever.search("pleural effusion on a chest radiograph", 3)
    assert build.describe().startswith("built in ")


def test_a_build_that_fails_says_why_and_hands_over_nothing(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    handed = []
    build = IndexBuild(_config(tmp_path, empty), on_ready=handed.append).start()
    assert build.wait(300)
    assert build.state == "failed" and not handed
    assert "no passages" in build.error
    assert build.describe() == "could not be built (the server's log says why)"


def test_progress_is_described_by_phase():
    build = IndexBuild(RetrievalConfig())
    build.phase, build.done, build.total = "embedding", 1024, 24512
    assert build.describe() == "being built: embedding passages, 1,024 of 24,512 (4 %)"
    build.phase, build.done, build.total = "reading", 300, None
    assert build.describe() == "being built: reading the corpus, 300 so far"


def held_back_pipeline(tiny_cache, root: Path):
    """The tiny profile loaded as app.py loads it on a first start, its index not built yet, and a function
    that lets the build go: until then the child waits on the index folder's lock, which the test holds."""
    from medvqa.config import load_settings
    from medvqa.pipeline import Pipeline
    from medvqa.retrieval.index import _build_lock

    settings = load_settings("tiny", env={"MEDVQA_CACHE": str(tiny_cache)})
    settings.retrieval = _config(root, write_jsonl(root / "corpus.jsonl", corpus_rows()))
    lock = _build_lock(Path(settings.retrieval.index_dir) / settings.retrieval.index_name)
    lock.__enter__()
    try:
        pipeline = Pipeline.load(settings, progress=False, index_in_background=True)
    except BaseException:
        lock.__exit__(None, None, None)
        raise
    released = []

    def release() -> None:
        if not released:
            released.append(lock.__exit__(None, None, None))

    return pipeline, release


@pytest.fixture(scope="module")
def background_pipeline(tiny_cache, tmp_path_factory):
    return held_back_pipeline(tiny_cache, tmp_path_factory.mktemp("background"))


def test_the_pipeline_answers_before_its_index_is_built_and_says_so(background_pipeline, tmp_path):
    from PIL import Image

    from medvqa.imaging import load_scan
    from medvqa.pipeline import Sources
    from medvqa.ui.layout import footer_text

    pipeline, release = background_pipeline
    assert pipeline.retriever is None and pipeline.index_build.building
    assert "literature retrieval off until its index is built — the index is being built" in footer_text(
        pipeline, pipeline.settings)
    Image.fromarray(np.full((32, 32), 90, np.uint8)).save(tmp_path / "scan.png")
    conversation = pipeline.new_conversation(load_scan(tmp_path / "scan.png"))
    events = list(pipeline.ask(conversation, "What does the chest radiograph show?", max_new_tokens=2))
    (sources,) = [e for e in events if isinstance(e, Sources)][:1]
    assert sources.passages == []
    assert sources.note.startswith("The literature index is still being built"), sources.note
    assert sources.note.endswith("so this answer has no sources.")

    release()  # the build goes on
    assert pipeline.index_build.wait(300)
    assert pipeline.index_build.state == "ready", pipeline.index_build.error
    assert pipeline.retriever is not None
    assert footer_text(pipeline, pipeline.settings).startswith(
        f"Profile `tiny` · literature retrieval on ({len(pipeline.retriever):,} indexed passages)")
    events = list(pipeline.ask(conversation, "Is there a pleural effusion on the chest radiograph?",
                               max_new_tokens=2))
    assert any(isinstance(e, Sources) and e.passages for e in events)


def test_no_corpus_to_build_from_is_said_at_load(tiny_cache, tmp_path):
    from medvqa.config import load_settings
    from medvqa.pipeline import Pipeline
    from medvqa.retrieval import IndexMissingError

    settings = load_settings("tiny", env={"MEDVQA_CACHE": str(tiny_cache)})
    settings.retrieval = _config(tmp_path, tmp_path / "absent.jsonl")
    with pytest.raises(IndexMissingError, match="absent.jsonl"):
        Pipeline.load(settings, progress=False, index_in_background=True)


def test_the_build_ends_with_the_app(tmp_path):
    """The app's process gone (killed, as a container is stopped), its build goes too within seconds, and
    a later start resumes it."""
    rows = corpus_rows() * 1  # enough to be still embedding when the parent dies
    rows += [{"id": f"p{n}", "text": f"Passage {n} about the radiographic follow-up of pulmonary nodules "
                                     f"number {n} in a cohort of smokers, measured on serial CT.",
              "url": f"https://example.org/p{n}"} for n in range(20000)]
    config = _config(tmp_path, write_jsonl(tmp_path / "corpus.jsonl", rows))
    parent = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time
        from medvqa.config import RetrievalConfig
        from medvqa.retrieval.background import IndexBuild
        build = IndexBuild(RetrievalConfig(**{config.__dict__!r})).start()
        while build.phase in ("starting",):
            time.sleep(0.05)
        print(build.pid, flush=True)
        os._exit(0)
        """)], cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert parent.returncode == 0, parent.stderr[-2000:]
    child = int(parent.stdout.split()[-1])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _running(child):
        time.sleep(0.2)
    assert not _running(child), "the build outlived the app"
    assert not default_index_ready(config)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in state  # a zombie has ended; only its parent's wait is missing


@pytest.mark.browser
def test_the_page_says_the_index_is_being_built_and_then_that_retrieval_is_on(browser, tiny_cache, tmp_path):
    from medvqa.ui import build_app, launch

    from .test_browser import open_page

    pipeline, release = held_back_pipeline(tiny_cache, tmp_path)
    try:
        demo = build_app(pipeline, pipeline.settings)
        _, url, _ = launch(demo, host="127.0.0.1", port=None, block=False, quiet=True)
        try:
            page = open_page(browser, url)
            footer = "#medvqa-footer"
            assert "literature retrieval off until its index is built — the index is being built" in \
                page.inner_text(footer)
            release()
            page.wait_for_function(f"() => document.querySelector('{footer}').innerText"
                                   f".includes('literature retrieval on (')", timeout=300_000)
            later = open_page(browser, url)  # a page opened afterwards says so at once
            assert "literature retrieval on (" in later.inner_text(footer)
            later.context.close()
            page.context.close()
        finally:
            demo.close()
    finally:
        release()


def test_the_index_is_built_beside_the_app_only_where_memory_allows(tmp_path):
    from medvqa.retrieval.background import BUILD_BESIDE_MB, room_to_build_beside

    meminfo = tmp_path / "meminfo"
    for available_mb, room in ((1400 + BUILD_BESIDE_MB, True), (1400 + BUILD_BESIDE_MB - 1, False), (16000, True)):
        meminfo.write_text(f"MemTotal:       32000000 kB\nMemAvailable:   {available_mb * 1024} kB\n")
        assert room_to_build_beside(meminfo_path=str(meminfo)) is room
    assert room_to_build_beside(meminfo_path=str(tmp_path / "absent"))  # not Linux: as if there were room
