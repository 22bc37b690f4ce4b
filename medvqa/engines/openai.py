"""The OpenAI-compatible engine: a remote chat-completions server (vLLM, SGLang, llama.cpp's server).

When a deployment outgrows one process, the exported LLaVA checkpoint (scripts/export_hf.py) is
served by such a server and the app sends it the windowed image plus the assembled prompt, retrieved
passages included. Citations still come from our own retrieval, never from the server's text.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
from typing import Callable, ContextManager, Iterator

import httpx
import numpy as np
from PIL import Image

from ..config import DecoderConfig
from ..prompt import IMAGE_PLACEHOLDER
from ..vision import pad_to_square
from .base import Engine, EngineRequest


class RemoteError(RuntimeError):
    """The model server failed; the message says how, in words a user can act on."""


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
        where = self.config.base_url
        try:
            with contextlib.ExitStack() as stack:
                with waiting():
                    response = stack.enter_context(self.client.stream("POST", "/chat/completions", json=body))
                    if response.status_code != 200:
                        detail = response.read().decode("utf-8", "replace")[:300]
                        raise RemoteError(f"The model server at {where} answered HTTP {response.status_code}: "
                                          f"{detail}")
                lines = response.iter_lines()
                while True:
                    with waiting():
                        line = next(lines, None)
                    if line is None:
                        return
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        return
                    try:
                        choice = json.loads(data)["choices"][0]
                    except (json.JSONDecodeError, KeyError, IndexError):
                        raise RemoteError(f"The model server at {where} sent a malformed stream event.") from None
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        yield piece
                    if choice.get("finish_reason"):
                        return
        except httpx.TimeoutException:
            raise RemoteError(f"The model server at {where} did not answer within {self.config.timeout_s:g} s.") from None
        except httpx.TransportError as error:
            raise RemoteError(f"Cannot reach the model server at {where} ({type(error).__name__}). "
                              f"Is it running?") from None

    def close(self) -> None:
        self.client.close()
