"""Soak test of the web app: many sessions over several minutes, with the mistakes and abandons of
real use, watching the app's memory, file descriptors and upload folder.

    python scripts/soak_app.py --minutes 10 --clients 8                  # starts app.py (offline profile)
    python scripts/soak_app.py --minutes 1 --clients 2 --profile tiny
    python scripts/soak_app.py --minutes 4 --clients 4 --archive-delay-s 40   # issue 34's mix

Each client runs one session after another until the time is up. A session is a new gradio_client
(a new tab) that uploads a scan (a PNG of its own size or one of pydicom's DICOM files) and asks one
to three questions, sometimes exporting the conversation, sometimes closing the tab in the middle of
an answer. Mixed in: an oversize file, a cut-off DICOM, a file that is not an image, and a file
posted to Gradio's upload route with no /upload event after it (a stray upload), a 5,900 × 5,900 PNG
of a few tens of KB (a huge image), and a *Find* in the PACS panel against a fake archive
(scripts/fake_archive.py, started here) that answers after --archive-delay-s. The refusals the
app is meant to give (413 for oversize, "The scan could not be opened" for the damaged ones) count as
refusals, as do a Find that ends with the deadline's message and a huge image refused by the memory
budget; anything else that goes wrong counts as an error. The upload times of the normal sessions
(PNG and DICOM) are kept: their p95 shows whether the slow archive and the huge images cost anyone
else time.

The app is started here (scripts/bench_app.py's start_app) with its own upload folder
(GRADIO_TEMP_DIR) and --max-upload-mb 2. Every second the app's RSS, its open file descriptors and the
files in the upload folder are sampled. The first --warmup-minutes are warm-up; RSS growth is the RSS
at the end (load stopped, sessions ended: 20 s after the last client closed) minus the RSS when the
warm-up ended. At the end the
script waits up to --settle-s for the upload sweeper, then counts the files left. Last line:

    errors=E rss_growth_mb=G files_left=F upload_p95_s=P
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench_app import QUESTIONS, answer_text, percentile, plain, session_image, start_app, stop_app, text_of
from bench_pacs import huge_png, plain_status
from fake_archive import Behaviour, FakeArchive

MAX_UPLOAD_MB = 2
KINDS = ("png", "dicom", "oversize", "corrupt", "not_an_image", "stray", "huge", "pacs_slow")
WEIGHTS = (40, 25, 8, 9, 8, 10, 5, 5)
OPEN_REFUSAL = "The scan could not be opened"
SESSION_END_S = 20  # after the load stops: Gradio's 15 s heartbeat, and a margin


@dataclass
class Tally:
    """What the clients did and saw; one lock for all of them."""

    sessions: int = 0
    answers: int = 0
    closed_tabs: int = 0
    exports: int = 0
    upload_s: list[float] = field(default_factory=list)  # the normal sessions' uploads
    refusals: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def refused(self, kind: str) -> None:
        with self.lock:
            self.refusals[kind] = self.refusals.get(kind, 0) + 1

    def error(self, text: str) -> None:
        with self.lock:
            self.errors.append(text[:300])


@dataclass
class Sample:
    t: float
    rss_mb: float
    fds: int
    upload_files: int
    threads: int


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10, help="how long the clients run")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (1-64)")
    parser.add_argument("--profile", default="offline", help="profile of the app started here (default offline)")
    parser.add_argument("--warmup-minutes", type=float, default=None, help="default: a quarter of the run, at most 2")
    parser.add_argument("--settle-s", type=float, default=90, help="seconds to wait for the upload sweeper at the end")
    parser.add_argument("--answer-timeout", type=float, default=300)
    parser.add_argument("--startup-timeout", type=float, default=1800)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--archive-delay-s", type=float, default=40.0, help="the fake archive's answer delay")
    args = parser.parse_args(argv)
    if not (1 <= args.clients <= 64 and args.minutes > 0):
        parser.error("--clients must be 1-64 and --minutes positive")
    warmup_s = 60 * (args.warmup_minutes if args.warmup_minutes is not None else min(2.0, args.minutes / 4))

    with tempfile.TemporaryDirectory(prefix="medvqa-soak-") as work:
        work_dir = Path(work)
        upload_dir = work_dir / "uploads"
        upload_dir.mkdir()
        env = {**os.environ, "GRADIO_TEMP_DIR": str(upload_dir), "MEDVQA_PACS_USERNAME": "",
               "MEDVQA_PACS_PASSWORD": "", "MEDVQA_PACS_TOKEN": ""}
        archive = FakeArchive(Behaviour(delay_s=args.archive_delay_s)).__enter__()
        server, url = start_app(args.profile, args.startup_timeout,
                                ["--max-upload-mb", str(MAX_UPLOAD_MB), "--pacs-url", archive.url], env)
        try:
            return soak(server, url, upload_dir, work_dir, args, warmup_s)
        finally:
            archive.__exit__(None, None, None)
            stop_app(server)


def soak(server: subprocess.Popen, url: str, upload_dir: Path, work_dir: Path, args, warmup_s: float) -> int:
    samples: list[Sample] = []
    stop_sampling = threading.Event()
    sampler = threading.Thread(target=sample_loop, args=(server.pid, upload_dir, samples, stop_sampling), daemon=True)
    sampler.start()
    tally = Tally()
    started = time.monotonic()
    deadline = started + 60 * args.minutes
    files = fixture_files(work_dir)
    clients = [threading.Thread(target=client_loop, daemon=True, name=f"client-{i}",
                                args=(url, i, deadline, files, tally, args.answer_timeout, args.seed))
               for i in range(args.clients)]
    for i, thread in enumerate(clients):
        thread.start()
        time.sleep(min(2.0, 10.0 / args.clients))  # tabs open over a few seconds, not at one instant
    for thread in clients:
        thread.join(timeout=max(1.0, deadline - time.monotonic() + args.answer_timeout + 60))
        if thread.is_alive():
            tally.error(f"{thread.name} did not finish")
    load_ended = time.monotonic()
    settle_deadline = load_ended + args.settle_s
    while time.monotonic() < settle_deadline and count_files(upload_dir):
        time.sleep(1)
    # End-of-run samples, app idle: once the last clients' sessions have ended (a gradio_client Client's
    # close() ends its session only at the next heartbeat, up to 15 s later), 10 s of them.
    time.sleep(max(0.0, load_ended + SESSION_END_S - time.monotonic()))
    time.sleep(max(0.0, min(10.0, settle_deadline - time.monotonic())))
    stop_sampling.set()
    sampler.join(timeout=5)
    files_left = count_files(upload_dir)
    if server.poll() is not None:
        tally.error(f"the app exited with status {server.returncode}")
    return report(samples, tally, started, warmup_s, load_ended, files_left, server.pid)


# ── Clients ──────────────────────────────────────────────────────────────────────────────────

def fixture_files(folder: Path) -> dict[str, list[Path]]:
    """The files sessions upload: PNGs of several sizes, pydicom's DICOM test files, and the bad ones."""
    import pydicom.data

    dicoms = [Path(p) for p in (pydicom.data.get_testdata_file(name, download=False)
                                for name in ("CT_small.dcm", "MR_small.dcm")) if p]
    oversize = folder / "oversize.dcm"
    oversize.write_bytes(b"\0" * (MAX_UPLOAD_MB * 2**20 + 4096))
    corrupt = folder / "corrupt.dcm"
    source = dicoms[0].read_bytes() if dicoms else b"\0" * 128 + b"DICM" + b"\x02\x00" * 64
    corrupt.write_bytes(source[:max(200, len(source) // 3)])
    not_an_image = folder / "notes.png"
    not_an_image.write_bytes(b"These are not pixels, whatever the name says.\n" * 20)
    huge = folder / "huge.png"
    huge_png(huge)
    return {"png": [session_image(i, folder) for i in range(6)], "dicom": dicoms or [session_image(7, folder)],
            "oversize": [oversize], "corrupt": [corrupt], "not_an_image": [not_an_image], "huge": [huge]}


def client_loop(url: str, index: int, deadline: float, files: dict, tally: Tally, answer_timeout: float,
                seed: int) -> None:
    rng = random.Random(seed * 1000 + index)
    while time.monotonic() < deadline:
        kind = rng.choices(KINDS, WEIGHTS)[0]
        try:
            run_session(url, kind, rng, files, tally, answer_timeout, deadline)
        except Exception as error:  # noqa: BLE001 - counted and reported
            tally.error(f"client {index} ({kind}): {type(error).__name__}: {error}")
            time.sleep(1)


def run_session(url: str, kind: str, rng: random.Random, files: dict, tally: Tally, answer_timeout: float,
                deadline: float) -> None:
    import httpx
    from gradio_client import Client, handle_file

    with tally.lock:
        tally.sessions += 1
    if kind in ("stray", "oversize"):
        path = rng.choice(files["png"]) if kind == "stray" else files["oversize"][0]
        with open(path, "rb") as handle:
            response = httpx.post(url + "gradio_api/upload", files={"files": (path.name, handle)}, timeout=60)
        if kind == "stray" and response.status_code != 200:
            tally.error(f"stray upload: HTTP {response.status_code}")
        elif kind == "oversize":
            if response.status_code == 413:
                tally.refused("oversize (413)")
            else:
                tally.error(f"oversize upload: HTTP {response.status_code}, expected 413")
        return
    client = Client(url, verbose=False)
    try:
        if kind == "pacs_slow":
            status = client.predict("ACC-SOAK", api_name="/pacs_find")[2]
            status = plain_status(status)
            if "did not finish the search" in status or "Found 1 series" in status:
                tally.refused("slow archive (message)")
            else:
                tally.error(f"slow archive: {status[:200]!r}")
            return
        path = rng.choice(files[kind])
        began = time.monotonic()
        *_, meta, chat = client.predict(handle_file(str(path)), api_name="/upload")
        if kind in ("png", "dicom"):
            with tally.lock:
                tally.upload_s.append(time.monotonic() - began)
        reply = text_of(chat[-1]) if chat else ""
        if kind == "huge" and "the server keeps for decoded scans" in reply:
            tally.refused("huge image (budget message)")
            return
        if kind in ("corrupt", "not_an_image"):
            if OPEN_REFUSAL in reply:
                tally.refused(f"{kind} (message)")
            else:
                tally.error(f"{kind} upload was not refused: {plain(reply)[:120]!r}")
            return
        if reply:
            tally.error(f"{kind} upload: {plain(reply)[:200]}")
            return
        for n in range(rng.randint(1, 3)):
            if time.monotonic() > deadline:
                break
            question = rng.choice(QUESTIONS)
            if rng.random() < 0.15:
                close_mid_answer(client, question, tally)
                return
            ask(client, question, tally, answer_timeout)
        if rng.random() < 0.5:
            client.predict(api_name="/export")
            with tally.lock:
                tally.exports += 1
    finally:
        client.close()


def ask(client, question: str, tally: Tally, answer_timeout: float) -> None:
    sent = time.monotonic()
    job = client.submit(question, api_name="/ask")
    for _ in job:
        if time.monotonic() - sent > answer_timeout:
            job.cancel()
            tally.error(f"no answer within {answer_timeout:.0f} s")
            return
    outputs = job.outputs()
    reply = text_of(outputs[-1][0][-1]) if outputs and outputs[-1][0] else ""
    if "medvqa-sources" in reply and "medvqa-error" not in reply:
        with tally.lock:
            tally.answers += 1
    else:
        tally.error(f"{question!r}: {plain(reply)[:200]!r}")


def close_mid_answer(client, question: str, tally: Tally) -> None:
    """A tab closed while its answer streams: the job is cancelled and the session's heartbeat ends."""
    job = client.submit(question, api_name="/ask")
    started = time.monotonic()
    while time.monotonic() - started < 30:
        outputs = job.outputs()
        if outputs and outputs[-1][0] and answer_text(text_of(outputs[-1][0][-1])):
            break
        if job.done():
            break
        time.sleep(0.1)
    job.cancel()
    with tally.lock:
        tally.closed_tabs += 1


# ── Measurements ─────────────────────────────────────────────────────────────────────────────

def sample_loop(pid: int, upload_dir: Path, samples: list[Sample], stop: threading.Event) -> None:
    start = time.monotonic()
    while not stop.wait(1.0):
        rss = rss_mb(pid)
        if rss is None:
            return
        samples.append(Sample(time.monotonic() - start, rss, open_fds(pid), count_files(upload_dir),
                              int(proc_status(pid, "Threads") or 0)))


def rss_mb(pid: int, field_name: str = "VmRSS") -> float | None:
    """A memory figure of the process from /proc (Linux), in MiB."""
    value = proc_status(pid, field_name)
    return None if value is None else value / 1024


def proc_status(pid: int, field_name: str) -> int | None:
    """A number from /proc/<pid>/status (Linux): kB for memory fields, a count for Threads."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def count_files(folder: Path) -> int:
    return sum(1 for path in folder.rglob("*") if path.is_file())


def report(samples: list[Sample], tally: Tally, started: float, warmup_s: float, load_ended: float,
           files_left: int, pid: int) -> int:
    load_s = load_ended - started
    after_warmup = [s for s in samples if warmup_s <= s.t <= load_s]
    baseline = statistics.median(s.rss_mb for s in after_warmup[:5]) if after_warmup else float("nan")
    end = statistics.median(s.rss_mb for s in samples[-5:]) if samples else float("nan")
    peak = max((s.rss_mb for s in after_warmup), default=float("nan"))
    growth = end - baseline
    print(f"sessions={tally.sessions} answers={tally.answers} closed_tabs={tally.closed_tabs} exports={tally.exports}")
    print("refusals (expected): " + (", ".join(f"{k}={v}" for k, v in sorted(tally.refusals.items())) or "none"))
    for error in tally.errors[:20]:
        print(f"  error: {error}")
    if len(tally.errors) > 20:
        print(f"  ... and {len(tally.errors) - 20} more errors")
    by_minute = [min(samples, key=lambda s, t=t: abs(s.t - t)) for t in range(60, int(load_s) + 1, 60)]
    print("rss_mb by minute: " + " ".join(f"{round(s.t / 60)}:{s.rss_mb:.0f}" for s in by_minute))
    print("threads by minute: " + " ".join(f"{round(s.t / 60)}:{s.threads}" for s in by_minute))
    start = statistics.median(s.rss_mb for s in samples[:3]) if samples else float("nan")  # app idle, no session
    print(f"rss_mb: at the start {start:.0f}, after warm-up ({warmup_s:.0f} s) {baseline:.0f}, peak after warm-up "
          f"{peak:.0f}, at the end {end:.0f}; peak over the whole run (VmHWM) {rss_mb(pid, 'VmHWM') or float('nan'):.0f}")
    print(f"open fds: after warm-up {after_warmup[0].fds if after_warmup else -1}, "
          f"peak {max((s.fds for s in samples), default=-1)}, at the end {samples[-1].fds if samples else -1}")
    print(f"upload folder: most files at once {max((s.upload_files for s in samples), default=0)}, "
          f"left at the end {files_left}")
    upload_p95 = percentile(tally.upload_s, 95)
    print(f"normal sessions' uploads: {len(tally.upload_s)}, median {percentile(tally.upload_s, 50):.2f} s, "
          f"p95 {upload_p95:.2f} s")
    print(f"errors={len(tally.errors)} rss_growth_mb={growth:.0f} files_left={files_left} upload_p95_s={upload_p95:.2f}")
    return 0 if not tally.errors and files_left == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
