"""One-row products over a decoder's layer matrices: torch.mm against the two-way row split that
medvqa/fast_decode.py uses, on matrices too many to stay in cache (every token reads them once).

    python scripts/bench_gemv.py [--layers 30] [--repeats 10]

Shapes default to SmolLM2-135M's: q/k/v fused (576 x 960), o (576 x 576), gate/up fused (576 x 3072),
down (1536 x 576), and the 576 x 49152 output head. Prints milliseconds per pass and the read rate.
"""

from __future__ import annotations

import argparse
import time

import torch


def timed(function, repeats: int) -> float:
    function()
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--shapes", default="576x960,576x576,576x3072,1536x576", help="in x out per layer")
    parser.add_argument("--head", default="576x49152")
    args = parser.parse_args()

    torch.manual_seed(0)
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    layers = [[torch.randn(rows, cols) for rows, cols in shapes] for _ in range(args.layers)]
    inputs = {rows: torch.randn(1, rows) for rows, _ in shapes}
    head_rows, head_cols = (int(v) for v in args.head.split("x"))
    head, head_input = torch.randn(head_rows, head_cols), torch.randn(1, head_rows)
    parts = torch.get_num_threads()

    def plain():
        for layer in layers:
            for weight in layer:
                torch.mm(inputs[weight.shape[0]], weight)

    def split():
        for layer in layers:
            for weight in layer:
                rows = weight.shape[0]
                torch.bmm(inputs[rows].view(parts, 1, rows // parts), weight.view(parts, rows // parts, -1)).sum(0)

    layer_bytes = sum(weight.numel() * 4 for layer in layers for weight in layer)
    print(f"{torch.get_num_threads()} threads, {args.layers} layers of {args.shapes} ({layer_bytes / 1e6:.0f} MB), "
          f"head {args.head} ({head.numel() * 4 / 1e6:.0f} MB)")
    for name, function, size in (
            ("layers, torch.mm", plain, layer_bytes),
            (f"layers, split in {parts}", split, layer_bytes),
            ("head, torch.mm", lambda: torch.mm(head_input, head), head.numel() * 4),
            (f"head, split in {parts}", lambda: torch.bmm(head_input.view(parts, 1, -1),
                                                           head.view(parts, head_rows // parts, -1)).sum(0),
             head.numel() * 4)):
        seconds = timed(function, args.repeats)
        print(f"  {name:>20}: {1000 * seconds:7.2f} ms  {size / seconds / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
