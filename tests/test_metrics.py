"""Live metrics: what the pipeline records per answer, and GET /metrics on the served app (tiny
profile): absent unless enabled, behind the login when one is set, and free of question text."""

from __future__ import annotations

import re

import numpy as np
import pytest

from medvqa.metrics import ServingMetrics
from medvqa.pipeline import Conversation, Done, Pipeline, Token

httpx = pytest.importorskip("httpx")
from gradio_client import Client, handle_file  # noqa: E402

QUESTION = "Is there a pleural effusion near patient-id-4711?"


def sample(metrics: ServingMetrics, name: str, labels: dict | None = None) -> float:
    value = metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


@pytest.fixture(scope="module")
def measured(tiny_pipeline):
    """The tiny pipeline's engine and model, recording into metrics of their own."""
    return Pipeline(tiny_pipeline.settings, tiny_pipeline.engine, tiny_pipeline.model, None, ServingMetrics())


def _image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (48, 48, 3), dtype=np.uint8)


def test_an_answer_is_recorded_and_a_stopped_one_leaves_the_gauges(measured):
    metrics = measured.metrics
    conversation = Conversation(image=_image(1))
    events = list(measured.ask(conversation, "Describe the image.", constrained=False, max_new_tokens=6, warm=False))
    done = events[-1]
    assert isinstance(done, Done)
    assert sample(metrics, "medvqa:time_to_first_token_seconds_count") == 1
    assert sample(metrics, "medvqa:e2e_request_latency_seconds_count") == 1
    assert sample(metrics, "medvqa:generation_tokens_total") == done.timings["output_tokens"] > 0
    assert sample(metrics, "medvqa:time_per_output_token_seconds_count") == \
        sum(isinstance(e, Token) for e in events) - 1
    assert sample(metrics, "medvqa:prompt_tokens_total") == done.timings["prompt_tokens"]
    assert sample(metrics, "medvqa:prefix_cache_queries_total") == done.timings["prompt_tokens"]
    assert sample(metrics, "medvqa:num_requests_running") == sample(metrics, "medvqa:num_requests_waiting") == 0

    list(measured.ask(conversation, "Which side?", constrained=False, max_new_tokens=6, warm=False))
    assert sample(metrics, "medvqa:prefix_cache_hits_total") > 0  # the second turn reused the first's prefix

    stream = measured.ask(conversation, "Which organ?", constrained=False, max_new_tokens=6, warm=False)
    assert next(event for event in stream if isinstance(event, Token))
    assert sample(metrics, "medvqa:num_requests_running") == 1
    stream.close()  # Stop
    assert sample(metrics, "medvqa:num_requests_running") == sample(metrics, "medvqa:num_requests_waiting") == 0
    measured.end_conversation(conversation)


def _launch(pipeline, **kwargs):
    from medvqa.ui import build_app, launch

    demo = build_app(pipeline, pipeline.settings)
    _, url, _ = launch(demo, port=None, block=False, quiet=True, **kwargs)
    return demo, url.rstrip("/")


def test_no_metrics_route_unless_enabled(measured):
    demo, url = _launch(measured)
    try:
        response = httpx.get(url + "/metrics", timeout=30)
        assert "medvqa:" not in response.text
    finally:
        demo.close()


def test_metrics_route_is_behind_the_login_and_holds_no_question_text(measured, tmp_path):
    from PIL import Image

    demo, url = _launch(measured, auth=("doc", "secret"), metrics=measured.metrics)
    try:
        assert httpx.get(url + "/metrics", timeout=30).status_code == 401
        scan = tmp_path / "scan.png"
        Image.fromarray(_image(2)).save(scan)
        client = Client(url + "/", auth=("doc", "secret"), verbose=False)
        client.predict(handle_file(str(scan)), api_name="/upload")
        client.predict(QUESTION, api_name="/ask")
        client.predict("", api_name="/ask")  # refused as empty: not an error of the model
        with httpx.Client(base_url=url, timeout=30) as browser:
            assert browser.post("/login", data={"username": "doc", "password": "secret"}).json() == {"success": True}
            response = browser.get("/metrics")
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        body = response.text
        for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "generation_tokens_total",
                     "abstentions_total",
                     "num_requests_running", "num_requests_waiting", "prefix_cache_hits_total",
                     "request_errors_total"):
            assert f"medvqa:{name}" in body
        assert re.search(r'medvqa:request_errors_total\{kind="model"\} 0\.0', body)
        # the number as a number of its own, not four digits inside a timestamp ("1.796270854471113e+09")
        assert "pleural" not in body and not re.search(r"(?<![\d.])4711(?!\d)", body)
    finally:
        demo.close()


def test_an_uncertain_closed_answer_is_counted(measured):
    from medvqa.confidence import CHOICE, YES_NO, Calibration

    saved = measured.calibration
    measured.calibration = Calibration({YES_NO: (0.0, 0.0), CHOICE: (0.0, 0.0)})  # every answer a coin flip
    try:
        done = [e for e in measured.ask(Conversation(image=_image(5)), "Is the liver enlarged?", use_retrieval=False,
                                        warm=False) if isinstance(e, Done)][-1]
    finally:
        measured.calibration = saved
    assert done.closed["abstained"] and sample(measured.metrics, "medvqa:abstentions_total") == 1
