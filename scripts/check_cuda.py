"""The llava-med profile on CUDA in fp16, on tiny random weights (profile `tiny-llava-med`): one
prepared check for a machine with a GPU (issue 33, step 4).

    python scripts/check_cuda.py            # about a minute, plus vLLM's start
    python scripts/check_cuda.py --no-vllm  # the in-process checks only

1. The profile's dtype on CUDA is fp16 (`float16_on_gpu`), for the vision tower, the projector and
   the decoder.
2. The app's transformers engine (its own decode loop; with `decoder.batch_decode` the fused,
   batched decode step of engines/torch_steps.py, several answers at once) against transformers'
   own `generate` on the same prompt embeddings, token by token, greedy.
3. The exported checkpoint (scripts/export_hf.py, fp16) through `LlavaForConditionalGeneration.generate`
   against the app, token by token.
4. vLLM serving that export (if vLLM is installed), asked through the app's `openai` engine: the same
   answers as the app in process.

Prints one line per check and a final JSON line; exits 1 if any check failed, 2 without CUDA. Images
are 32 x 32 (the tiny tower's input side), so every path sees the same pixels without resizing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

QUESTIONS = ("Describe the image.", "Is there a pleural effusion?", "Which side is abnormal, left or right?")


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The first position where two token sequences differ (None when equal)."""
    for position, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return position
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def images(count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in range(count)]


def prompt_embeds(pipeline, image: np.ndarray, question: str) -> torch.Tensor:
    """(1, T, d) the first-turn prompt's embeddings, image tokens in place, as the app builds them."""
    from medvqa.model import embed_prompt

    prompt = pipeline.prompts.build(question)
    with torch.inference_mode():
        return embed_prompt(pipeline.engine.language_model.embed, prompt.token_ids, prompt.image_mask,
                            lambda: pipeline.model.image_tokens(image))


def engine_tokens(pipeline, image: np.ndarray, question: str, max_new_tokens: int) -> list[int]:
    """The app's engine's greedy tokens for one question (its own decode loop)."""
    generated: list[int] = []
    for _ in pipeline.engine.generate(prompt_embeds(pipeline, image, question), max_new_tokens=max_new_tokens,
                                      generated=generated):
        pass
    return generated


def reference_tokens(pipeline, image: np.ndarray, question: str, max_new_tokens: int) -> list[int]:
    """transformers' own greedy `generate` on the same prompt embeddings."""
    engine = pipeline.engine
    embeds = prompt_embeds(pipeline, image, question)
    with torch.inference_mode():
        out = engine.language_model.model.generate(
            inputs_embeds=embeds, attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device),
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(engine.stop_ids),
            pad_token_id=engine.tokenizer.eos_token_id, suppress_tokens=engine.never_ids or None)
    return [t for t in out[0].tolist() if t not in engine.stop_ids]


def exported_tokens(model, pipeline, image: np.ndarray, question: str, max_new_tokens: int) -> list[int]:
    prompt = pipeline.prompts.build(question)
    image_id = model.config.image_token_index
    ids = torch.tensor([[image_id if m else t for t, m in zip(prompt.token_ids, prompt.image_mask)]],
                       device=model.device)
    pixels = pipeline.model.vision.preprocess([image]).to(model.device, model.dtype)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=sorted(pipeline.engine.stop_ids))
    return [t for t in out[0, ids.shape[1]:].tolist() if t not in pipeline.engine.stop_ids]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_with_vllm(folder: Path, port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--served-model-name", "tiny", "--dtype", "float16", "--max-model-len", "1024",
               "--gpu-memory-utilization", "0.3", "--enforce-eager", "--host", "127.0.0.1", "--port", str(port)]
    return subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def wait_for_server(url: str, process: subprocess.Popen, timeout_s: float) -> bool:
    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if process.poll() is not None:
            return False
        try:
            if httpx.get(url + "/models", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(2)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--no-vllm", action="store_true", help="skip serving the export with vLLM")
    parser.add_argument("--vllm-timeout", type=float, default=240.0, help="seconds to wait for vLLM to start")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA device; this check runs on a GPU machine", file=sys.stderr)
        return 2

    from medvqa.config import load_settings
    from medvqa.device import pick_device, pick_dtype
    from medvqa.hf_export import export_llava
    from medvqa.pipeline import Done, Pipeline

    work = Path(tempfile.mkdtemp(prefix="medvqa-cuda-"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    settings = load_settings("tiny-llava-med", env={"MEDVQA_CACHE": str(work / "cache")})
    settings.retrieval.enabled = False
    results: dict[str, object] = {"device": torch.cuda.get_device_name(0)}
    failed: list[str] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        results[name] = ok
        if not ok:
            failed.append(name)
        print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)

    # 1. fp16 everywhere on CUDA
    device = pick_device(settings.device)
    dtype = pick_dtype(device, settings.dtype)
    pipeline = Pipeline.load(settings, with_retrieval=False, progress=False)
    engine = pipeline.engine
    dtypes = {"decoder": next(engine.language_model.model.parameters()).dtype,
              "vision": next(pipeline.model.vision.parameters()).dtype,
              "projector": next(pipeline.model.projector.parameters()).dtype}
    check("fp16_on_cuda", device.type == "cuda" and dtype == torch.float16
          and set(dtypes.values()) == {torch.float16}, str({k: str(v) for k, v in dtypes.items()}))

    # 2. the engine's decode loop (batched/fused step when on) against transformers' generate
    pictures = images(len(QUESTIONS))
    cases = list(zip(pictures, QUESTIONS))
    ours = {question: engine_tokens(pipeline, image, question, args.max_new_tokens) for image, question in cases}
    theirs = {question: reference_tokens(pipeline, image, question, args.max_new_tokens) for image, question in cases}
    for question in QUESTIONS:
        diff = first_difference(ours[question], theirs[question])
        check(f"engine_vs_generate[{question}]", diff is None,
              f"{len(ours[question])} tokens" if diff is None else f"first difference at token {diff}")
    results["batched_decode"] = engine.batcher is not None
    if engine.batcher is not None:  # several answers at once: each must still be its own greedy answer
        concurrent: dict[str, list[int]] = {}

        def answer(image, question):
            concurrent[question] = engine_tokens(pipeline, image, question, args.max_new_tokens)

        threads = [threading.Thread(target=answer, args=case) for case in cases]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for question in QUESTIONS:
            diff = first_difference(concurrent[question], theirs[question])
            check(f"batched_vs_generate[{question}]", diff is None,
                  "" if diff is None else f"first difference at token {diff}")

    # 3. the fp16 export through LlavaForConditionalGeneration
    from transformers import LlavaForConditionalGeneration

    folder = export_llava(pipeline.model, engine.language_model, work / "export", "tiny-llava-med",
                          settings.decoder.conversation_format, dtype=torch.float16)
    exported = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float16).to("cuda").eval()
    for image, question in cases:
        diff = first_difference(exported_tokens(exported, pipeline, image, question, args.max_new_tokens),
                                ours[question])
        check(f"export_vs_app[{question}]", diff is None, "" if diff is None else f"first difference at token {diff}")
    del exported
    torch.cuda.empty_cache()

    # 4. vLLM serving the export, asked through the app's openai engine
    try:
        import vllm  # noqa: F401
        have_vllm = True
    except ImportError:
        have_vllm = False
    if args.no_vllm or not have_vllm:
        results["vllm"] = "skipped" if args.no_vllm else "not installed"
        print(f"skip vllm: {results['vllm']}")
    else:
        port = free_port()
        log = work / "vllm.log"
        server = serve_with_vllm(folder, port, log)
        try:
            url = f"http://127.0.0.1:{port}/v1"
            if not wait_for_server(url, server, args.vllm_timeout):
                check("vllm_started", False, f"see {log}: " + log.read_text()[-800:])
            else:
                remote = load_settings("tiny-llava-med", env={"MEDVQA_CACHE": str(work / "cache")})
                remote.retrieval.enabled = False
                remote.decoder.engine, remote.decoder.base_url, remote.decoder.remote_model = "openai", url, "tiny"
                remote.decoder.remote_image_token_id = json.loads((folder / "config.json").read_text())[
                    "image_token_index"]
                client = Pipeline.load(remote, with_retrieval=False, progress=False)
                from medvqa.pipeline import Conversation

                for image, question in cases:
                    done = [e for e in client.ask(Conversation(image=image), question, warm=False,
                                                  max_new_tokens=args.max_new_tokens) if isinstance(e, Done)][-1]
                    expected = engine.tokenizer.decode(ours[question], skip_special_tokens=True).strip()
                    check(f"vllm_vs_app[{question}]", done.answer == expected,
                          "" if done.answer == expected else f"{done.answer!r} != {expected!r}")
        finally:
            from bench_app import stop_app  # scripts/ is on the path when run as a script

            stop_app(server)

    results["failed"] = failed
    print(json.dumps(results))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
