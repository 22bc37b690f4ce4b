"""Joining the threads a concurrency test starts, with the evidence when one of them hangs."""

from __future__ import annotations

import sys
import threading
import time
import traceback


def all_stacks() -> str:
    """Every thread's stack in this process: the test's own and, for an app served in-process, the
    server's (Gradio's workers, the engines' step threads)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident})\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def join_all(threads: list[threading.Thread], timeout: float, stages: dict | None = None) -> None:
    """Join every thread within `timeout` seconds in all; fail with each thread's stack if one is
    still running (and with `stages`, what each worker last said it was doing)."""
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [thread.name for thread in threads if thread.is_alive()]
    if alive:
        raise AssertionError(f"still running after {timeout:.0f} s: {alive}; stages: {stages}\n{all_stacks()}")


def until(condition, timeout: float = 30.0) -> bool:
    """Whether `condition()` holds within `timeout` seconds, polled (another thread's doing)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()
