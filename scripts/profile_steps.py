"""Where the llama.cpp engine's step-loop thread spends its time, from a py-spy profile.

    py-spy record --native --idle --threads -r 200 -f raw -o steps.txt -- \
        python scripts/bench_latency.py --engine llama.cpp --runs 3
    python scripts/profile_steps.py steps.txt

Reads py-spy's raw (collapsed) output and sorts the samples of the thread named "llama.cpp steps"
(medvqa/engines/llama_steps.py) into: llama.cpp computing; llama.cpp's threads waiting for each
other at a barrier (the frames libgomp leaves under ggml's compute function: with --native, py-spy
names libgomp's futex wait by address only); the loop's Python between calls (planning, sampling,
handing tokens over); and the loop idle, waiting for work. Prints each as a share of the thread's
samples, then the most frequent Python frames outside llama_decode.
"""

from __future__ import annotations

import argparse
import collections
import sys

THREAD = "llama.cpp steps"


def category(frames: list[str]) -> str:
    """One of four places for a sample's stack (outermost frame first)."""
    inside = next((index for index, frame in enumerate(frames) if frame.startswith("llama_decode ")), None)
    if inside is None:
        python = [frame for frame in frames if ".py:" in frame]
        if python and python[-1].startswith(("Condition.wait", "Lock.acquire", "Condition.__enter__")):
            return "idle: waiting for work"
        return "Python: between llama_decode calls"
    leaf = frames[-1]
    if "libgomp" in leaf and not leaf.startswith("GOMP_parallel"):
        return "llama_decode: threads waiting at a barrier (libgomp)"
    return "llama_decode: computing"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="py-spy record -f raw output (with --threads)")
    parser.add_argument("--thread", default=THREAD, help="thread name to read (default: the step loop's)")
    args = parser.parse_args(argv)
    places, python = collections.Counter(), collections.Counter()
    with open(args.profile) as lines:
        for line in lines:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            if args.thread not in frames[0]:
                continue
            place = category(frames[1:])
            places[place] += int(count)
            if place.startswith("Python"):
                python[next((f for f in reversed(frames) if ".py:" in f), frames[-1])] += int(count)
    total = sum(places.values())
    if not total:
        print(f"no samples of a thread named {args.thread!r} in {args.profile}", file=sys.stderr)
        return 1
    print(f"{total} samples of the {args.thread!r} thread")
    for place, count in places.most_common():
        print(f"  {100 * count / total:5.1f} %  {place}")
    for frame, count in python.most_common(5):
        print(f"           {100 * count / total:5.1f} %  {frame}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
