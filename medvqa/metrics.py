"""Live serving metrics in Prometheus' text format (prometheus_client).

    metrics = ServingMetrics()
    pipeline = Pipeline.load(settings, metrics=metrics)   # the pipeline records answers
    body, content_type = metrics.exposition()             # what GET /metrics answers (ui/metrics_route.py)

Names follow vLLM's metrics where they mean the same (`vllm:time_to_first_token_seconds` is
`medvqa:time_to_first_token_seconds` here), so dashboards built for a vLLM server read the app too.
Labels never carry question text, answer text or anything from a scan: the only label is an error's
kind, from a fixed list.

Each `ServingMetrics` has its own registry, so several pipelines in one process (the tests) do not
collide in prometheus_client's global one.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ERROR_KINDS = ("question", "scan", "retrieval", "memory", "model")  # the `kind` label's values
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)


class ServingMetrics:
    """The app's counters, gauges and histograms, in a registry of their own."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.time_to_first_token = Histogram(
            "medvqa:time_to_first_token_seconds", "From the question to the answer's first text.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.time_per_output_token = Histogram(
            "medvqa:time_per_output_token_seconds", "Between consecutive pieces of an answer's text.",
            buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            "medvqa:e2e_request_latency_seconds", "From the question to the finished answer with its sources.",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.generation_tokens = Counter("medvqa:generation_tokens", "Answer tokens generated.", registry=r)
        self.prompt_tokens = Counter("medvqa:prompt_tokens", "Prompt tokens of the answers asked.", registry=r)
        self.requests_running = Gauge(
            "medvqa:num_requests_running", "Answers being generated (their first text is out).", registry=r)
        self.requests_waiting = Gauge(
            "medvqa:num_requests_waiting", "Answers asked whose first text is not out yet.", registry=r)
        self.prefix_cache_queries = Counter(
            "medvqa:prefix_cache_queries", "Prompt tokens looked up in the engine's prefix cache.", registry=r)
        self.prefix_cache_hits = Counter(
            "medvqa:prefix_cache_hits", "Prompt tokens found in the engine's prefix cache.", registry=r)
        self.image_reliance_flags = Counter(
            "medvqa:image_reliance_flags", "Closed answers flagged as not depending on the image.", registry=r)
        self.abstentions = Counter(
            "medvqa:abstentions", "Closed answers given as Uncertain (below the calibrated threshold).", registry=r)
        self.open_abstentions = Counter(
            "medvqa:open_abstentions", "Open answers chosen among training answers given as Uncertain "
            "(below the open-answer calibration's threshold).", registry=r)
        self.request_errors = Counter(
            "medvqa:request_errors", "Answers and uploads that failed, by kind.", ["kind"], registry=r)
        for kind in ERROR_KINDS:
            self.request_errors.labels(kind=kind)  # every kind shown, at 0 until it happens

    def error(self, kind: str) -> None:
        self.request_errors.labels(kind=kind if kind in ERROR_KINDS else "model").inc()

    def exposition(self) -> tuple[bytes, str]:
        """(the metrics in Prometheus' text format, its content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class AnswerTracker:
    """One answer's part in the metrics: waiting until its first text, running after; its latencies and
    tokens when it is done. With no metrics it records nothing."""

    def __init__(self, metrics: ServingMetrics | None):
        self.metrics = metrics
        self.state = "waiting"
        self.last_piece: float | None = None
        if metrics is not None:
            metrics.requests_waiting.inc()

    def piece(self, now: float) -> None:
        """A piece of the answer's text went out at `now` (time.perf_counter())."""
        if self.metrics is None:
            return
        if self.state == "waiting":
            self._leave()
            self.state = "running"
            self.metrics.requests_running.inc()
        elif self.last_piece is not None:
            self.metrics.time_per_output_token.observe(now - self.last_piece)
        self.last_piece = now

    def done(self, timings: dict, pieces: int, closed: dict | None, open_choice: dict | None = None) -> None:
        """The answer is complete: `timings` as Done carries them, `pieces` of text streamed, `closed` and
        `open_choice` as Done carries them."""
        metrics = self.metrics
        if metrics is None:
            return
        metrics.time_to_first_token.observe(timings.get("ttft_s", 0.0))
        metrics.e2e_request_latency.observe(timings.get("total_s", 0.0))
        metrics.generation_tokens.inc(timings.get("output_tokens", pieces))
        prompt_tokens = timings.get("prompt_tokens", 0)
        metrics.prompt_tokens.inc(prompt_tokens)
        if "reused_tokens" in timings:
            metrics.prefix_cache_queries.inc(prompt_tokens)
            metrics.prefix_cache_hits.inc(timings["reused_tokens"])
        if closed and closed.get("flagged"):
            metrics.image_reliance_flags.inc()
        if closed and closed.get("abstained"):
            metrics.abstentions.inc()
        if open_choice and open_choice.get("abstained"):
            metrics.open_abstentions.inc()

    def close(self) -> None:
        """The answer ended (done, failed or stopped): it no longer counts as waiting or running."""
        if self.metrics is not None:
            self._leave()
            self.state = "closed"

    def _leave(self) -> None:
        gauge = {"waiting": self.metrics.requests_waiting, "running": self.metrics.requests_running}.get(self.state)
        if gauge is not None:
            gauge.dec()
