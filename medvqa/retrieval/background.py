"""Build the default literature index while the app already serves.

A first start used to build the index before the page answered: about five minutes on 2 cores
(24,512 passages). The app now starts at once without literature, builds the index in a child
process at low priority, and opens it when it is done: answers asked meanwhile say that the index
is still being built and have no sources.

    build = IndexBuild(settings.retrieval, on_ready=lambda retriever: ...).start()
    build.describe()   # "being built: embedding passages, 12,288 of 24,512 (50 %)"

Why a child process: its memory (the passage embedder, the build's buffers) goes back to the system
when it ends, and `nice` lets answers go first on a machine with two cores. The build itself is
`ensure_default_index`, so it resumes where an interrupted one stopped and takes the same lock: two
app processes starting together build it once. The child exits when the app does, however the app
ends: its stdin is a pipe the app holds open, and its end (EOF) ends the child. The next start
resumes the build's checkpoint.

The child reads the retrieval settings as one line of JSON on stdin and writes one JSON object per
line on stdout: {"phase", "done", "total"} as it goes, then {"error": message} if it failed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

from medvqa.config import RetrievalConfig

log = logging.getLogger(__name__)

_PHASES = {"starting": "starting", "reading": "reading the corpus", "embedding": "embedding passages",
           "keywords": "building the keyword index", "opening": "opening it"}
_REPORT_EVERY_S = 0.5  # the child's progress lines, at most this often (the last of a phase always)


class IndexBuild:
    """The default index built in a child process; `on_ready(retriever)` is called once it is open."""

    def __init__(self, config: RetrievalConfig, on_ready: Callable[[object], None] | None = None):
        self.config = config
        self.on_ready = on_ready
        self.state = "building"  # then "ready" or "failed"
        self.phase, self.done, self.total = "starting", 0, None
        self.error = ""
        self.began = time.monotonic()
        self.seconds: float | None = None  # how long it took, once ready
        self.pid: int | None = None  # the child's process ID, once started
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name="index-build", daemon=True)

    def start(self) -> "IndexBuild":
        self._thread.start()
        return self

    @property
    def building(self) -> bool:
        return self.state == "building"

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the build ended (ready or failed) within `timeout` seconds."""
        return self._finished.wait(timeout)

    def describe(self) -> str:
        """What the build is doing, for the page: "being built: embedding passages, 1,024 of 24,512 (4 %)"."""
        if self.state == "ready":
            return f"built in {self.seconds:.0f} s"
        if self.state == "failed":  # (the reason is in the server's log: paths are not every user's business)
            return "could not be built (the server's log says why)"
        what = _PHASES.get(self.phase, self.phase)
        if self.total:
            return f"being built: {what}, {self.done:,} of {self.total:,} ({100 * self.done // self.total} %)"
        return f"being built: {what}" + (f", {self.done:,} so far" if self.done else "")

    # --- the parent's side ------------------------------------------------------------------------

    def _run(self) -> None:
        # The child is started here, not by the caller, so that this thread outlives it: it reads the
        # child's lines until they end.
        child = None
        try:
            child = subprocess.Popen([sys.executable, "-m", "medvqa.retrieval.background"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     encoding="utf-8", errors="replace", env=_child_env())
            self.pid = child.pid
            child.stdin.write(json.dumps(dataclasses.asdict(self.config)) + "\n")
            child.stdin.flush()  # and left open: the child ends when it closes, as it does when this process ends
            error = ""
            for line in child.stdout:
                try:
                    message = json.loads(line)
                except json.JSONDecodeError:
                    continue  # not ours (a library printing to stdout)
                if not isinstance(message, dict):
                    continue
                if "error" in message:
                    error = str(message["error"])
                elif "phase" in message:
                    self.phase, self.done, self.total = message["phase"], message["done"], message["total"]
            code = child.wait()
            child.stdin.close()
            if code != 0:
                raise RuntimeError(error or f"the build process exited with status {code}")
            self.phase, self.done, self.total = "opening", 0, None
            from medvqa.assertion import warm
            from medvqa.retrieval.search import Retriever

            retriever = Retriever.open(self.config)
            warm()  # passages get support marks: their sentence check loads before the first one
            if self.on_ready is not None:
                self.on_ready(retriever)
            self.seconds = time.monotonic() - self.began
            self.state = "ready"
            log.info("literature index built in %.0f s (%d passages); retrieval is on", self.seconds, len(retriever))
        except Exception as error:  # noqa: BLE001 - the app keeps serving without literature, and says why
            self.error = str(error).strip() or type(error).__name__
            self.state = "failed"
            log.warning("the literature index could not be built, serving without literature: %s", self.error)
        finally:
            if child is not None and child.poll() is None:  # (an error while reading it) not left running
                child.kill()
                child.wait()
            self._finished.set()


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # The child imports medvqa from wherever this process did: a checkout not installed needs its folder on
    # the path (an installed package is found anyway, and its site-packages must not go before the stdlib).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.basename(root) not in ("site-packages", "dist-packages"):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))
    # glibc's allocator as app.py tunes it for itself: with its defaults the build's threads kept 1,411 MiB
    # at its peak on the default corpus, with these 883 MiB (2026-12-05, 2-core EPYC).
    env.setdefault("MALLOC_ARENA_MAX", "2")
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(4 * 2**20))
    return env


# What a build beside the app needs on top of it: the child's peak on the default corpus (883 MiB) and a margin.
BUILD_BESIDE_MB = 1024


def room_to_build_beside(app_mb: float = 1400, meminfo_path: str = "/proc/meminfo") -> bool:
    """Whether this machine has the memory to build the index beside the app (the app's own `app_mb`, its
    measured 1,317 MiB peak on the offline profile and a margin, and BUILD_BESIDE_MB), judged by Linux's
    MemAvailable before the app loads; True where it cannot be read."""
    try:
        with open(meminfo_path) as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        available_mb = int(fields["MemAvailable"].split()[0]) / 1024
    except (OSError, KeyError, ValueError):
        return True
    return available_mb >= app_mb + BUILD_BESIDE_MB


# --- the child's side ------------------------------------------------------------------------------

def _main() -> int:
    # Ctrl+C in the app's terminal reaches this process too: the app's end (stdin closed) ends it instead,
    # without a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    line = sys.stdin.readline()
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    if hasattr(os, "nice"):
        os.nice(10)  # answers first: this process only gets the CPU the app leaves
    last = {"phase": None, "at": 0.0}

    def report(phase: str, done: int, total: int | None) -> None:
        now = time.monotonic()
        if phase == last["phase"] and now - last["at"] < _REPORT_EVERY_S and done != total:
            return
        last.update(phase=phase, at=now)
        print(json.dumps({"phase": phase, "done": done, "total": total}), flush=True)

    try:
        config = RetrievalConfig(**json.loads(line))
        from medvqa.retrieval.index import ensure_default_index

        ensure_default_index(config, progress=True, report=report)  # its progress bars go to stderr, as before
    except Exception as error:  # noqa: BLE001 - said to the parent, which logs it and serves without
        print(json.dumps({"error": str(error).strip() or type(error).__name__}), flush=True)
        return 1
    return 0


def _exit_with_parent() -> None:
    """End this process when the app's ends: the pipe it holds open as this one's stdin then closes. The
    build's checkpoint lets the next start resume it."""
    sys.stdin.read()  # returns at EOF only: the app closed it, or ended
    os._exit(1)


if __name__ == "__main__":
    sys.exit(_main())
