"""Load test of the web app: a curve of N concurrent sessions, each uploading its own scan and asking M questions.

    python scripts/bench_app.py --clients 1 2 4 8 16 --questions 2       # starts app.py (offline profile) once
    python scripts/bench_app.py --clients 8 --questions 2 --arrival staggered --url http://127.0.0.1:7860/

Without --url the app is started on a free loopback port and stopped at the end; every level of the
curve runs against that one app, one level after the other. Every session uploads a different image
(its own size and pattern) and tags its questions with its number, so a mix-up shows: a chat, export
or scan that holds anything of another session counts as one. `--arrival burst` (default) sends
every session's first question at once; `staggered` starts session i `--stagger-s` x i seconds later.
A client of the API does not run what the page chains to an upload (warming: the image encoded and
the prompt up to the question cached while the clinician types), so each first question also pays
for those; `--warm` calls that warming (/warm) after each upload, as the page does.

All times are measured at the client: TTFT from sending a question to the first answer text
streamed, TPOT the mean time between the answer's later streamed pieces (answers of one piece, the
closed ones, have none), e2e until the answer is complete with its sources. tokens_per_s counts
streamed pieces (one per token) of all answers over the level's time from the first question to the
last answer; goodput is the share of answers with TTFT <= 1 s and TPOT <= 50 ms. One line per level:

    clients=N answers=A errors=E mixups=M ttft_p50_s= ttft_p95_s= tpot_p50_ms= tpot_p95_ms= e2e_p50_s= tokens_per_s= goodput=
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_CLIENTS, MAX_QUESTIONS = 64, 20
QUESTIONS = [
    "What abnormality is seen in this image?",
    "Is there a pleural effusion?",
    "Which organ is shown?",
    "Describe the main finding.",
    "Is this a CT or an MRI?",
    "Where is the lesion located?",
]


GOODPUT_TTFT_S, GOODPUT_TPOT_S = 1.0, 0.050  # an answer "good" for goodput meets both


@dataclass
class SessionResult:
    index: int
    answers: int = 0
    errors: list[str] = field(default_factory=list)
    mixups: list[str] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float | None] = field(default_factory=list)  # per answer; None for a one-piece answer
    e2e_s: list[float] = field(default_factory=list)
    pieces: int = 0  # streamed pieces of all its answers (tokens)
    asking: tuple[float, float] | None = None  # perf_counter() at its first question and last answer
    done: bool = False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[8],
                        help=f"concurrent sessions, one level of the curve each (1-{MAX_CLIENTS})")
    parser.add_argument("--questions", type=int, default=2, help=f"questions per session (1-{MAX_QUESTIONS})")
    parser.add_argument("--arrival", choices=("burst", "staggered"), default="burst",
                        help="first questions all at once (burst) or session i after i x --stagger-s")
    parser.add_argument("--stagger-s", type=float, default=0.25, help="gap between sessions' starts when staggered")
    parser.add_argument("--warm", action="store_true",
                        help="after each upload, warm the session as the page does once a scan is shown (/warm): "
                             "the image is encoded and the prompt up to the question cached before the questions")
    parser.add_argument("--profile", default="offline", help="profile of the app started here (default offline)")
    parser.add_argument("--url", default=None, help="an app already running; none is started then")
    parser.add_argument("--answer-timeout", type=float, default=300, help="seconds one answer may take")
    parser.add_argument("--deadline", type=float, default=1800, help="seconds one level may take")
    parser.add_argument("--startup-timeout", type=float, default=1800,
                        help="seconds to wait for the app to start (a first start builds the index)")
    parser.add_argument("--verbose", action="store_true", help="also print one line per session")
    args = parser.parse_args(argv)
    if not (all(1 <= n <= MAX_CLIENTS for n in args.clients) and 1 <= args.questions <= MAX_QUESTIONS):
        parser.error(f"--clients must be 1-{MAX_CLIENTS} and --questions 1-{MAX_QUESTIONS}")

    server = None
    url = args.url
    clean = True
    try:
        if url is None:
            server, url = start_app(args.profile, args.startup_timeout)
        for level, clients in enumerate(args.clients):
            stagger = args.stagger_s if args.arrival == "staggered" else 0.0
            with tempfile.TemporaryDirectory(prefix="medvqa-bench-") as folder:
                results = run_sessions(url, clients, args.questions, Path(folder), args.answer_timeout,
                                       args.deadline, level=level, stagger_s=stagger, warm=args.warm)
            for r in results:
                if args.verbose or r.errors or r.mixups:
                    print(session_line(r), flush=True)
            spans = [r.asking for r in results if r.asking]
            summary = summarise(results, max(end for _, end in spans) - min(start for start, _ in spans) if spans else 0)
            print(level_line(clients, summary), flush=True)
            clean &= summary["errors"] == 0 and summary["mixups"] == 0 and \
                summary["answers"] == clients * args.questions
    finally:
        if server is not None:
            stop_app(server)
    return 0 if clean else 1


def summarise(results: list[SessionResult], wall_s: float) -> dict:
    """The level's figures from its sessions' results and its wall time."""
    ttfts = sorted(t for r in results for t in r.ttft_s)
    tpots = sorted(t for r in results for t in r.tpot_s if t is not None)
    e2es = sorted(t for r in results for t in r.e2e_s)
    good = sum(ttft <= GOODPUT_TTFT_S and (tpot is None or tpot <= GOODPUT_TPOT_S)
               for r in results for ttft, tpot in zip(r.ttft_s, r.tpot_s))
    answers = sum(r.answers for r in results)
    return {"answers": answers, "errors": sum(len(r.errors) for r in results),
            "mixups": sum(len(r.mixups) for r in results),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95),
            "tpot_p50_ms": 1000 * percentile(tpots, 50), "tpot_p95_ms": 1000 * percentile(tpots, 95),
            "e2e_p50_s": percentile(e2es, 50),
            "tokens_per_s": sum(r.pieces for r in results) / wall_s if wall_s > 0 else float("nan"),
            "goodput": good / answers if answers else 0.0}


def level_line(clients: int, s: dict) -> str:
    return (f"clients={clients} answers={s['answers']} errors={s['errors']} mixups={s['mixups']} "
            f"ttft_p50_s={s['ttft_p50_s']:.2f} ttft_p95_s={s['ttft_p95_s']:.2f} "
            f"tpot_p50_ms={s['tpot_p50_ms']:.1f} tpot_p95_ms={s['tpot_p95_ms']:.1f} e2e_p50_s={s['e2e_p50_s']:.2f} "
            f"tokens_per_s={s['tokens_per_s']:.1f} goodput={s['goodput']:.2f}")


def session_line(r: SessionResult) -> str:
    return (f"session {r.index}: answers={r.answers} errors={len(r.errors)} mixups={len(r.mixups)} "
            f"ttft_s={[round(t, 2) for t in r.ttft_s]}" + "".join(f"\n  error: {e}" for e in r.errors)
            + "".join(f"\n  mixup: {m}" for m in r.mixups))


# ── The app ──────────────────────────────────────────────────────────────────────────────────

def stop_app(server: subprocess.Popen) -> None:
    """Stop a server started here: asked first, killed if it has not gone within 30 s."""
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()


def start_app(profile: str, timeout: float, extra_args: list[str] | tuple[str, ...] = (),
              env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """app.py on a free loopback port (with `extra_args`, in `env` or this process's environment),
    once its page answers. A missing literature index is built first (--wait-for-index): what is measured
    is the app serving with its literature, not beside its first build."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    print(f"starting app.py --profile {profile} on {url}", file=sys.stderr)
    server = subprocess.Popen([sys.executable, str(REPO / "app.py"), "--profile", profile, "--host", "127.0.0.1",
                               "--port", str(port), "--wait-for-index", *extra_args], cwd=REPO,
                              env=dict(os.environ) if env is None else env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"app.py exited with status {server.returncode} before serving")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return server, url
        except OSError:
            time.sleep(1)
    server.terminate()
    raise SystemExit(f"app.py did not serve {url} within {timeout:.0f} s")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ── Sessions ─────────────────────────────────────────────────────────────────────────────────

def run_sessions(url: str, clients: int, questions: int, folder: Path, answer_timeout: float,
                 deadline_s: float, level: int = 0, stagger_s: float = 0.0, warm: bool = False) -> list[SessionResult]:
    """Run `clients` sessions at once; the first questions go when all have uploaded (session i
    `stagger_s` x i seconds after that). `level` varies the images' patterns between levels, so one
    level's scans are never in the app's caches for the next."""
    results = [SessionResult(i) for i in range(clients)]
    start = threading.Barrier(clients)
    threads = [threading.Thread(target=session, daemon=True, name=f"session-{i}",
                                args=(url, results[i], questions, folder, start, answer_timeout,
                                      level, stagger_s * i, warm))
               for i in range(clients)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + deadline_s
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    for result in results:
        if not result.done:
            result.errors.append(f"not finished within the {deadline_s:.0f} s deadline")
    return results


def session(url: str, result: SessionResult, questions: int, folder: Path, start: threading.Barrier,
            answer_timeout: float, level: int = 0, delay_s: float = 0.0, warm: bool = False) -> None:
    from gradio_client import Client, handle_file

    i = result.index
    try:
        client = Client(url, verbose=False)
        image = session_image(i, folder, level)
        _, viewer, *_, meta, chat = client.predict(handle_file(str(image)), api_name="/upload")
        rows, columns = image_size(i)
        if (meta or {}).get("Rows") != str(rows) or (meta or {}).get("Columns") != str(columns):
            result.mixups.append(f"upload shows a scan of {meta.get('Rows')}x{meta.get('Columns')}, "
                                 f"expected {rows}x{columns}")
        if chat:
            result.errors.append(f"upload: {plain(text_of(chat[-1]))[:200]}")
            return
        if warm:
            client.predict("", api_name="/warm")  # the empty question box, as the page sends it
        start.wait(timeout=600)
        time.sleep(delay_s)
        asked = []
        began = time.perf_counter()
        for j in range(questions):
            question = f"{QUESTIONS[(i + j) % len(QUESTIONS)]} (session {i}, question {j})"
            asked.append(question)
            ask(client, question, asked, result, answer_timeout)
        result.asking = (began, time.perf_counter())
        as_json = client.predict(api_name="/export")[2]
        exported = [turn["question"] for turn in json.loads(as_json)["turns"]] if as_json else []
        if exported != asked:
            result.mixups.append(f"export holds questions {exported}, asked {asked}")
    except Exception as error:  # noqa: BLE001 - counted and reported
        result.errors.append(f"{type(error).__name__}: {error}")
    finally:
        result.done = True


def ask(client, question: str, asked: list[str], result: SessionResult, answer_timeout: float) -> None:
    """Ask one question, streaming; check that the chat holds exactly this session's questions."""
    sent = time.perf_counter()
    job = client.submit(question, api_name="/ask")
    first_token = last_piece = complete = None
    pieces, streamed = 0, ""
    chat = None
    for chat, _ in job:
        now = time.perf_counter()
        if now - sent > answer_timeout:
            job.cancel()
            result.errors.append(f"{question!r}: no answer within {answer_timeout:.0f} s")
            return
        reply = text_of(chat[-1]) if chat and chat[-1]["role"] == "assistant" else ""
        text = answer_text(reply)
        if "medvqa-sources" in reply:  # the final answer, with its sources
            complete = now if complete is None else complete
        elif text and text != streamed:
            first_token = now - sent if first_token is None else first_token
            last_piece, streamed = now, text
            pieces += 1
    outputs = job.outputs()
    chat = outputs[-1][0] if outputs else chat
    if not chat:
        result.errors.append(f"{question!r}: no reply")
        return
    users = [plain(text_of(m)) for m in chat if m["role"] == "user"]
    if users != asked:
        result.mixups.append(f"chat after {question!r} holds questions {users}")
    reply = text_of(chat[-1])
    if "medvqa-error" in reply:
        result.errors.append(f"{question!r}: {plain(re.sub(r'<[^>]+>', '', reply))[:200]}")
    elif "medvqa-sources" not in reply:
        result.errors.append(f"{question!r}: the answer did not complete")
    else:
        # e2e ends when the answer is shown complete; the event may go on (warming the next turn).
        done = (complete if complete is not None else time.perf_counter()) - sent
        result.answers += 1
        result.ttft_s.append(first_token if first_token is not None else done)
        pieces = max(pieces, 1)
        result.tpot_s.append((last_piece - sent - first_token) / (pieces - 1) if pieces > 1 else None)
        result.e2e_s.append(done)
        result.pieces += pieces


# ── Helpers ──────────────────────────────────────────────────────────────────────────────────

def image_size(index: int) -> tuple[int, int]:
    return 192 + 8 * index, 256 + 8 * index  # rows, columns: unique per session


def session_image(index: int, folder: Path, level: int = 0) -> Path:
    """A grey-level PNG of its own size and pattern, standing in for one patient's radiograph."""
    import numpy as np
    from PIL import Image

    rows, columns = image_size(index)
    y, x = np.mgrid[0:rows, 0:columns]
    rng = np.random.default_rng(1000 * level + index)
    pixels = 128 + 80 * np.sin(x / (9 + index)) * np.cos(y / 13) + rng.normal(0, 12, (rows, columns))
    path = folder / f"session-{index}.png"
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path)
    return path


def text_of(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content or "")


def answer_text(reply: str) -> str:
    """The streamed answer in a reply, without the status line or the sources block."""
    if "medvqa-status" in reply or "medvqa-error" in reply:
        return ""
    return reply.split('<div class="medvqa-sources', 1)[0].strip()


def plain(text: str) -> str:
    return html.unescape(re.sub(r"\\(.)", r"\1", text))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


if __name__ == "__main__":
    sys.exit(main())
