"""The OpenAI-compatible engine: a remote chat-completions server (vLLM, SGLang, llama.cpp's server).

When a deployment outgrows one process, the exported LLaVA checkpoint (scripts/export_hf.py) is
served by such a server and the app sends it the windowed image plus the assembled prompt, retrieved
passages included. Citations still come from our own retrieval, never from the server's text.
"""

from __future__ import annotations

import base64
import codecs
import contextlib
import io
import json
import os
import time
from typing import Callable, ContextManager, Iterator

import httpx
import numpy as np
from PIL import Image

from ..config import DecoderConfig
from ..prompt import IMAGE_PLACEHOLDER
from ..vision import pad_to_square
from .base import Engine, EngineRequest


class RemoteError(RuntimeError):
    """The model server failed; the message says how, in words a user can act on (`detail`, what the server
    itself said, goes to the log only: an error page may hold anything)."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


# What a status means to whoever runs the app (the server's own body goes to the log).
_STATUS_HINTS = {
    400: "refused the request (a prompt longer than the model's context, or a setting it does not take)",
    401: "refused the API key (set the environment variable decoder.api_key_env names)",
    403: "refused the API key (set the environment variable decoder.api_key_env names)",
    404: "does not know this model or route (check decoder.remote_model and decoder.base_url, which ends in /v1)",
    413: "refused a request this large",
    429: "is busy",
    503: "is busy or still starting",
}
_MAX_ERROR_BODY = 4096  # bytes of an error answer read, for the log
_MAX_LINE = 1 << 20  # an event line longer than this is no chat-completions stream


def image_data_url(image: np.ndarray, fill: tuple[int, int, int] = (0, 0, 0)) -> str:
    """The image padded to a square (as our own encoder sees it) as a PNG data URL."""
    buffer = io.BytesIO()
    Image.fromarray(pad_to_square(image, fill)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def to_openai_messages(messages: list[dict], image: np.ndarray, fill: tuple[int, int, int] = (0, 0, 0)) -> list[dict]:
    """Our messages (image placeholder inside the first user text) -> OpenAI content parts, the image
    part where the placeholder was."""
    converted = []
    for message in messages:
        content = message["content"]
        if message["role"] == "user" and IMAGE_PLACEHOLDER in content:
            before, after = (text.strip() for text in content.split(IMAGE_PLACEHOLDER, 1))
            parts = [{"type": "text", "text": before}] if before else []
            parts.append({"type": "image_url", "image_url": {"url": image_data_url(image, fill)}})
            if after:
                parts.append({"type": "text", "text": after})
            converted.append({"role": "user", "content": parts})
        else:
            converted.append({"role": message["role"], "content": content})
    return converted


class OpenAIEngine(Engine):
    """The server runs the whole vision-language model and keeps its own prefix cache: it is sent the
    windowed image and the assembled messages, passages included."""

    name = "openai"
    takes_image_tokens = False
    caches_prompts = False
    scores_options = False  # a chat-completions stream gives no scores of given answers

    def __init__(self, config: DecoderConfig, transport: httpx.BaseTransport | None = None,
                 pad_fill: tuple[int, int, int] = (0, 0, 0)):
        self.config = config
        self.pad_fill = pad_fill  # the profile's padding colour (vision.pad_fill_for)
        if not config.base_url:
            raise RemoteError("decoder.engine is 'openai' but decoder.base_url is empty; set "
                              "MEDVQA_DECODER__BASE_URL to the server, e.g. http://127.0.0.1:8000/v1.")
        headers = {}
        api_key = os.environ.get(config.api_key_env, "") if config.api_key_env else ""
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.client = httpx.Client(base_url=config.base_url.rstrip("/"), headers=headers, transport=transport,
                                   timeout=httpx.Timeout(config.timeout_s, connect=min(10.0, config.timeout_s)))

    def stream(self, request: EngineRequest, *, max_new_tokens: int | None = None, seed: int = 0,
               timings: dict | None = None, ignore_eos: bool = False) -> Iterator[str]:
        yield from self.stream_messages(request.prompt.messages, request.image, max_new_tokens, request.waiting)

    def stream_messages(self, messages: list[dict], image: np.ndarray, max_new_tokens: int | None = None,
                        waiting: Callable[[], ContextManager] = contextlib.nullcontext) -> Iterator[str]:
        """The server's answer, streamed. Every wait on the network (the connection, each event) is
        inside `waiting`: the pipeline's turn is given up, so other conversations' requests reach the
        server meanwhile and it batches them."""
        body = {
            "model": self.config.remote_model or self.config.name_or_path,
            "messages": to_openai_messages(messages, image, self.pad_fill),
            "max_tokens": max_new_tokens or self.config.max_new_tokens,
            "temperature": self.config.temperature,
            "top_p": self.config.top_p,
            "stream": True,
        }
        if self.config.remote_image_token_id >= 0:  # never generate the image token
            body["logit_bias"] = {str(self.config.remote_image_token_id): -100}
        where = shown_address(self.config.base_url)
        started = answered = False  # the server answered 200; it has sent a piece of the answer
        try:
            with contextlib.ExitStack() as stack:
                with waiting():
                    response = stack.enter_context(self.client.stream("POST", "/chat/completions", json=body))
                    if response.status_code != 200:
                        raise _status_error(response, where)
                started = True
                media_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
                if media_type != "text/event-stream":
                    # A proxy's login page or a server that ignored "stream": no answer, whatever it holds.
                    raise RemoteError(f"The model server at {where} did not stream an answer (it sent "
                                      f"{response.headers.get('content-type') or 'no content type'}); is "
                                      "decoder.base_url the server's /v1 address?")
                lines = _lines(response.iter_bytes(), where)
                last_progress = time.monotonic()
                while True:
                    with waiting():
                        line = next(lines, None)
                    if line is None:  # the stream ended before the server said the answer was complete
                        raise RemoteError(f"The model server at {where} ended the answer early, without saying "
                                          "it was complete: the answer may be cut short.")
                    if line.startswith("error:"):  # llama.cpp's server reports a failure mid-stream so
                        raise RemoteError(f"The model server at {where} failed while answering: the answer is "
                                          "cut short.", detail=line[len("error:"):].strip()[:_MAX_ERROR_BODY])
                    if not line.startswith("data:"):  # a comment (keep-alive) or a blank line: no progress
                        if time.monotonic() - last_progress > self.config.timeout_s:
                            raise httpx.ReadTimeout("no answer between keep-alive comments")
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        return
                    event = _event(data, where)
                    last_progress = time.monotonic()
                    choices = event.get("choices")
                    if not choices:  # a usage-only or opening event (the API allows an empty list)
                        continue
                    choice = choices[0] if isinstance(choices[0], dict) else {}
                    piece = (choice.get("delta") or {}).get("content")
                    if isinstance(piece, str) and piece:
                        answered = True
                        yield piece
                    if choice.get("finish_reason") in ("abort", "error"):  # the server gave the answer up
                        raise RemoteError(f"The model server at {where} stopped the answer "
                                          f"({choice['finish_reason']}): the answer is cut short.")
                    if choice.get("finish_reason"):
                        return
        except httpx.TimeoutException:
            raise RemoteError(f"The model server at {where} did not answer within {self.config.timeout_s:g} s"
                              + (" (the answer is cut short)." if answered else ".")) from None
        except httpx.TransportError as error:
            if started:
                cut = "the answer is cut short" if answered else "nothing of the answer came"
                raise RemoteError(f"The model server at {where} closed the connection before the answer was "
                                  f"complete ({type(error).__name__}): {cut}.") from None
            raise RemoteError(f"Cannot reach the model server at {where} ({type(error).__name__}). "
                              f"Is it running?") from None
        except httpx.HTTPError as error:  # e.g. a body that does not decode as its Content-Encoding says
            raise RemoteError(f"The model server at {where} sent an answer that could not be read "
                              f"({type(error).__name__}).") from None

    def close(self) -> None:
        self.client.close()


def shown_address(base_url: str) -> str:
    """The server's address as messages show it: scheme, host, port and path, never a user name, password
    or query a URL may carry."""
    try:
        url = httpx.URL(base_url)
        return str(url.copy_with(userinfo=b"", query=None, fragment=None)) if url.host else base_url.split("@")[-1]
    except (httpx.InvalidURL, TypeError, ValueError):
        return "(the address in decoder.base_url)"


def _lines(chunks: Iterator[bytes], where: str) -> Iterator[str]:
    """The stream's lines (ended by CR, LF or CRLF, as an event stream's may be), read from its bytes so that a
    line never ending cannot fill the memory: past _MAX_LINE it is an error."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    buffer = ""
    for chunk in chunks:
        buffer += decoder.decode(chunk)
        while True:
            end = min((i for i in (buffer.find("\r"), buffer.find("\n")) if i >= 0), default=-1)
            if end < 0 or (buffer[end] == "\r" and end == len(buffer) - 1):  # a CR may be half of a CRLF
                break
            line, rest = buffer[:end], buffer[end + 1:]
            if buffer[end] == "\r" and rest.startswith("\n"):
                rest = rest[1:]
            buffer = rest
            yield line
        if len(buffer) > _MAX_LINE:
            raise RemoteError(f"The model server at {where} sent a stream line over {_MAX_LINE // 1024} KB, "
                              "which is no chat-completions stream.")
    buffer += decoder.decode(b"", final=True)
    if buffer:
        yield buffer.rstrip("\r")


def _status_error(response: httpx.Response, where: str) -> RemoteError:
    """A non-200 answer as a RemoteError: what the status means, and the server's own words (its first 4 KB)
    as the error's detail, for the log."""
    detail = b""
    for chunk in response.iter_bytes():
        detail += chunk
        if len(detail) >= _MAX_ERROR_BODY:
            break
    status = response.status_code
    hint = _STATUS_HINTS.get(status, "failed")
    wait = response.headers.get("retry-after", "")
    retry = f"; try again in {wait} s" if wait.isdigit() else ("; try again shortly" if status in (429, 503) else "")
    return RemoteError(f"The model server at {where} {hint} (HTTP {status}){retry}.",
                       detail=detail[:_MAX_ERROR_BODY].decode("utf-8", "replace"))


def _event(data: str, where: str) -> dict:
    """One stream event's JSON; an error event (vLLM reports a failure mid-stream so) as a RemoteError."""
    try:
        event = json.loads(data)
    except json.JSONDecodeError:
        raise RemoteError(f"The model server at {where} sent a malformed stream event.") from None
    if not isinstance(event, dict):
        raise RemoteError(f"The model server at {where} sent a malformed stream event.")
    if event.get("error") or event.get("object") == "error":  # (the second: older vLLM's error events)
        error = event.get("error") or event
        message = error.get("message") if isinstance(error, dict) else error
        raise RemoteError(f"The model server at {where} failed while answering: the answer is cut short.",
                          detail=str(message)[:_MAX_ERROR_BODY])
    return event
