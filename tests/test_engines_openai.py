"""The openai engine against a small OpenAI-compatible stand-in server on loopback."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from medvqa.config import load_settings
from medvqa.pipeline import Conversation, Done, Pipeline, Sources, Token
from medvqa.engines.openai import OpenAIEngine, RemoteError


class StandIn(BaseHTTPRequestHandler):
    mode = "ok"
    seen: list = []
    lock = threading.Lock()
    open_now = most_open = 0  # requests being answered now, and the most at once

    def log_message(self, *args):  # keep test output quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StandIn.seen.append(body)
        with StandIn.lock:
            StandIn.open_now += 1
            StandIn.most_open = max(StandIn.most_open, StandIn.open_now)
        try:
            self._answer()
        finally:
            with StandIn.lock:
                StandIn.open_now -= 1

    def _answer(self):
        if StandIn.mode == "error":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b'{"error": "model crashed"}')
            return
        if StandIn.mode == "slow":
            time.sleep(1)
            return  # the client has given up by now; writing would only hit a closed socket
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if StandIn.mode == "overlap":  # hold the answer until another request comes (5 s at most)
            deadline = time.monotonic() + 5
            while StandIn.most_open < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
        for piece in ["There is ", "a small ", "left effusion [1]."]:
            event = {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture()
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    StandIn.mode, StandIn.seen, StandIn.open_now, StandIn.most_open = "ok", [], 0, 0
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()


def _settings(url: str, timeout: float = 5.0):
    settings = load_settings("offline", env={})
    settings.decoder.engine = "openai"
    settings.decoder.base_url = url
    settings.decoder.remote_model = "medvqa-llava"
    settings.decoder.timeout_s = timeout
    settings.retrieval.enabled = False
    return settings


def test_pipeline_streams_from_the_server_with_image_and_prompt(server):
    pipeline = Pipeline.load(_settings(server))
    image = np.full((30, 50, 3), 128, dtype=np.uint8)
    events = list(pipeline.ask(Conversation(image=image, window="lung window"), "Is there an effusion?"))
    # The offline profile's gate shows passages beside the answer: they are found after it.
    assert isinstance(events[-2], Sources) and isinstance(events[-1], Done)
    assert [e.text for e in events if isinstance(e, Token)] == ["There is ", "a small ", "left effusion [1]."]
    assert events[-1].answer == "There is a small left effusion [1]."
    request = StandIn.seen[-1]
    assert request["model"] == "medvqa-llava" and request["stream"] is True
    user = request["messages"][-1]["content"]
    assert user[0]["type"] == "image_url" and user[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert "Is there an effusion?" in user[1]["text"] and "<image>" not in user[1]["text"]


def test_a_streaming_answer_does_not_hold_other_conversations_back(server):
    """While one answer streams from the server, the pipeline's turn is given up: a second
    conversation's request reaches the server before the first answer ends (the server holds the
    first answer until then), and both answers arrive whole."""
    pipeline = Pipeline.load(_settings(server))
    StandIn.mode = "overlap"
    answers: dict = {}

    def ask(index):
        image = np.full((30, 50, 3), 60 * index, dtype=np.uint8)
        events = list(pipeline.ask(Conversation(image=image), f"Is there an effusion in view {index}?"))
        answers[index] = events[-1].answer

    threads = [threading.Thread(target=ask, args=(index,), daemon=True) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert StandIn.most_open == 2
    assert answers == {0: "There is a small left effusion [1].", 1: "There is a small left effusion [1]."}


def test_the_image_token_is_never_generated_when_its_id_is_set(server):
    """vLLM ignores generation_config.json's suppress_tokens: the engine asks with a logit bias."""
    image = np.zeros((8, 8, 3), dtype=np.uint8)
    messages = [{"role": "user", "content": "<image>\nQuestion: x"}]
    settings = _settings(server)
    list(OpenAIEngine(settings.decoder).stream_messages(messages, image))
    assert "logit_bias" not in StandIn.seen[-1]
    settings.decoder.remote_image_token_id = 32000
    list(OpenAIEngine(settings.decoder).stream_messages(messages, image))
    assert StandIn.seen[-1]["logit_bias"] == {"32000": -100}


def test_server_error_and_timeout_and_unreachable_are_clear(server):
    decoder = OpenAIEngine(_settings(server).decoder)
    image = np.zeros((8, 8, 3), dtype=np.uint8)
    messages = [{"role": "user", "content": "<image>\nQuestion: x"}]
    StandIn.mode = "error"
    with pytest.raises(RemoteError, match="HTTP 500"):
        list(decoder.stream_messages(messages, image))
    StandIn.mode = "slow"
    slow = OpenAIEngine(_settings(server, timeout=0.5).decoder)
    with pytest.raises(RemoteError, match="did not answer within 0.5 s"):
        list(slow.stream_messages(messages, image))
    gone = OpenAIEngine(_settings("http://127.0.0.1:9/v1").decoder)
    with pytest.raises(RemoteError, match="Cannot reach"):
        list(gone.stream_messages(messages, image))


def test_missing_base_url_is_explained():
    settings = _settings("")
    with pytest.raises(RemoteError, match="MEDVQA_DECODER__BASE_URL"):
        OpenAIEngine(settings.decoder)


def test_the_image_part_goes_where_the_prompt_puts_the_image():
    from medvqa.engines.openai import to_openai_messages

    image = np.zeros((8, 8, 3), dtype=np.uint8)
    first = to_openai_messages([{"role": "user", "content": "<image>\nQuestion: Is it normal?"}], image)
    assert [part["type"] for part in first[0]["content"]] == ["image_url", "text"]
    after = to_openai_messages([{"role": "user", "content": "Question: Is it normal?\n<image>"}], image)
    assert [part["type"] for part in after[0]["content"]] == ["text", "image_url"]
    assert after[0]["content"][0]["text"] == "Question: Is it normal?"


def _engine_answering(status: int, body: bytes, content_type: str = "text/event-stream", headers: dict | None = None,
                      timeout: float = 5.0) -> OpenAIEngine:
    """The engine against an httpx transport that answers every request with `status` and `body`."""
    import httpx

    def answer(request):
        return httpx.Response(status, headers={"content-type": content_type, **(headers or {})}, content=body)

    return OpenAIEngine(_settings("http://server.test/v1", timeout=timeout).decoder, transport=httpx.MockTransport(answer))


def _sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def _piece(text: str, finish=None) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


IMAGE = np.zeros((8, 8, 3), dtype=np.uint8)
MESSAGES = [{"role": "user", "content": "<image>\nQuestion: x"}]


def test_an_answer_the_server_cut_short_is_an_error_not_a_finished_answer():
    """A stream that ends without finish_reason or [DONE] (a proxy or server that gave up), or a 200 that is not
    a stream at all (a login page, a server that ignored "stream"): an error, never a short or empty answer."""
    cut = _engine_answering(200, _sse(_piece("There is a large "), _piece("mass in the")))
    pieces = []
    with pytest.raises(RemoteError, match="ended the answer early"):
        for piece in cut.stream_messages(MESSAGES, IMAGE):
            pieces.append(piece)
    assert "".join(pieces) == "There is a large mass in the"
    for content_type, body in (("application/json", b'{"choices": [{"message": {"content": "Yes"}}]}'),
                               ("text/html", b"<html>Please log in</html>")):
        with pytest.raises(RemoteError, match="did not stream an answer"):
            list(_engine_answering(200, body, content_type).stream_messages(MESSAGES, IMAGE))
    whole = _engine_answering(200, _sse(_piece("Yes"), _piece(".", finish="stop")))
    assert "".join(whole.stream_messages(MESSAGES, IMAGE)) == "Yes."


def test_empty_choices_are_skipped_and_an_error_event_says_the_answer_is_cut():
    """The API allows events with no choices (an opening or usage-only event); vLLM reports a failure
    mid-stream as an error event, whose words go to the log (RemoteError.detail), not the chat."""
    usage = {"choices": [], "usage": {"prompt_tokens": 5}}
    fine = _engine_answering(200, _sse(usage, _piece("No"), usage, b"[DONE]"))
    assert "".join(fine.stream_messages(MESSAGES, IMAGE)) == "No"
    failing = _engine_answering(200, _sse(_piece("No"), {"error": {"message": "EngineDeadError: CUDA out of memory"}}))
    with pytest.raises(RemoteError, match="failed while answering") as raised:
        list(failing.stream_messages(MESSAGES, IMAGE))
    assert "EngineDeadError" in raised.value.detail and "EngineDeadError" not in str(raised.value)
    older = _engine_answering(200, _sse(_piece("No"), {"object": "error", "message": "CUDA out of memory"}, b"[DONE]"))
    with pytest.raises(RemoteError, match="failed while answering") as raised:  # vLLM before 0.10
        list(older.stream_messages(MESSAGES, IMAGE))
    assert "CUDA out of memory" in raised.value.detail
    llama = _engine_answering(200, _sse(_piece("No")) + b'error: {"code": 500, "message": "context shift disabled"}\n\n')
    with pytest.raises(RemoteError, match="failed while answering") as raised:  # llama.cpp's server
        list(llama.stream_messages(MESSAGES, IMAGE))
    assert "context shift disabled" in raised.value.detail


@pytest.mark.parametrize("status, headers, said", [
    (401, {}, "refused the API key"),
    (404, {}, "does not know this model"),
    (429, {"retry-after": "7"}, "is busy \\(HTTP 429\\); try again in 7 s"),
    (503, {}, "busy or still starting \\(HTTP 503\\); try again shortly"),
    (502, {}, "failed \\(HTTP 502\\)"),
])
def test_a_refusal_says_what_its_status_means_and_keeps_the_servers_page_for_the_log(status, headers, said):
    page = b"<html><body><h1>" + b"x" * 100_000 + b"</h1></body></html>"
    with pytest.raises(RemoteError, match=said) as raised:
        list(_engine_answering(status, page, "text/html", headers).stream_messages(MESSAGES, IMAGE))
    assert "<html>" not in str(raised.value) and raised.value.detail.startswith("<html>")
    assert len(raised.value.detail) <= 4096  # the first 4 KB read, not the whole page


def test_keep_alive_comments_do_not_hold_an_answer_past_the_timeout():
    """A server sending only comments (": keep-alive") makes no progress: the answer fails after timeout_s."""
    import httpx

    def comments():
        for _ in range(40):
            time.sleep(0.05)
            yield b": keep-alive\n\n"

    def answer(request):
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=comments())

    engine = OpenAIEngine(_settings("http://server.test/v1", timeout=0.5).decoder, transport=httpx.MockTransport(answer))
    started = time.monotonic()
    with pytest.raises(RemoteError, match="did not answer within 0.5 s"):
        list(engine.stream_messages(MESSAGES, IMAGE))
    assert time.monotonic() - started < 1.5


def test_the_chat_says_a_servers_failure_in_the_engines_words_and_why_a_closed_answer_has_no_confidence(server):
    """The page shows RemoteError's message (not "could not answer (RemoteError)"), the server's own page
    staying in the log; a closed question through this engine says the engine gives no scores (the offline
    profile scores options, so the setting is not why)."""
    from medvqa.pipeline import UNSCORED_BY_ENGINE_NOTE
    from medvqa.ui.handlers import _failure_text

    text = _failure_text(RemoteError("The model server at http://x/v1 is busy (HTTP 429); try again in 7 s.",
                                     detail="<html>busy</html>"))
    assert text.startswith("The model server at http://x/v1 is busy") and "still running" in text
    assert "<html>" not in text
    pipeline = Pipeline.load(_settings(server))
    done = list(pipeline.ask(Conversation(image=np.zeros((30, 50, 3), np.uint8)), "Is there an effusion?"))[-1]
    assert done.confidence_note == UNSCORED_BY_ENGINE_NOTE


def test_messages_never_show_a_password_in_the_servers_address_and_media_types_are_read_as_such():
    """decoder.base_url may carry a user name and password: no message shows them. "Text/Event-Stream;
    charset=utf-8" is an event stream (media types ignore case and parameters)."""
    import httpx

    def refuse(request):
        return httpx.Response(401, content=b"no")

    settings = _settings("http://admin:hunter2@server.test/v1?key=secret")
    engine = OpenAIEngine(settings.decoder, transport=httpx.MockTransport(refuse))
    with pytest.raises(RemoteError) as raised:
        list(engine.stream_messages(MESSAGES, IMAGE))
    assert "hunter2" not in str(raised.value) and "secret" not in str(raised.value)
    assert "http://server.test/v1" in str(raised.value)
    upper = _engine_answering(200, _sse(_piece("Yes", finish="stop")), "Text/Event-Stream; charset=utf-8")
    assert "".join(upper.stream_messages(MESSAGES, IMAGE)) == "Yes"


def test_stream_lines_end_with_cr_lf_or_crlf_and_a_line_that_never_ends_is_refused_early():
    import httpx

    crlf = _engine_answering(200, b'data: {"choices": [{"delta": {"content": "A"}}]}\r\n\r\n'
                                  b'data: {"choices": [{"delta": {"content": "B"}, "finish_reason": "stop"}]}\r\r')
    assert "".join(crlf.stream_messages(MESSAGES, IMAGE)) == "AB"
    sent = []

    def endless():
        for _ in range(64):
            sent.append(1)
            yield b"x" * 65536  # 4 MB in all, never a line end

    def answer(request):
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=endless())

    engine = OpenAIEngine(_settings("http://server.test/v1").decoder, transport=httpx.MockTransport(answer))
    with pytest.raises(RemoteError, match="over 1024 KB"):
        list(engine.stream_messages(MESSAGES, IMAGE))
    assert len(sent) <= 17  # refused once past 1 MB, not after reading the whole line


def test_a_stream_the_server_stops_or_drops_before_any_answer_says_so():
    """finish_reason "abort" (the server gave the answer up) is not a complete answer; a connection dropped
    after the server answered 200 is not "Cannot reach … Is it running?"."""
    import httpx

    aborted = _engine_answering(200, _sse(_piece("There is a", finish="abort")))
    with pytest.raises(RemoteError, match="stopped the answer \\(abort\\)"):
        list(aborted.stream_messages(MESSAGES, IMAGE))

    def broken():
        yield b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n'
        raise httpx.RemoteProtocolError("peer closed connection")

    def answer(request):
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=broken())

    engine = OpenAIEngine(_settings("http://server.test/v1").decoder, transport=httpx.MockTransport(answer))
    with pytest.raises(RemoteError, match="closed the connection before the answer was complete") as raised:
        list(engine.stream_messages(MESSAGES, IMAGE))
    assert "nothing of the answer came" in str(raised.value) and "Is it running" not in str(raised.value)
