"""Device and dtype choice: cuda → mps → cpu, in one place."""

from __future__ import annotations

import torch


def pick_device(preference: str = "auto") -> torch.device:
    """Return the device named by `preference`, or the best available when it is "auto"."""
    if preference != "auto":
        return torch.device(preference)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(device: torch.device, preference: str = "auto") -> torch.dtype:
    """Inference dtype for `device`.

    On a GPU half precision is the norm (bf16 where supported, fp16 otherwise). On CPU we use fp32:
    measured on the 2-core AVX2 reference machine (no native bf16), bf16 matmuls are emulated and
    training under bf16 autocast is several times slower (see scripts/bench_latency.py --dtype).
    """
    if preference == "float16_on_gpu":
        return torch.float32 if device.type == "cpu" else torch.float16
    if preference != "auto":
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[preference]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.float32
