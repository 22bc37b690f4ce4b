"""Decode steps and prefills for Llama-architecture decoders on CPU, without the overhead of the
full transformers forward.

A decoded token of SmolLM2-135M reads 0.54 GB of fp32 weights: about 17 ms at this machine's
measured ~32 GB/s. The transformers forward took about 52 ms a token (scripts/bench_latency.py with
MEDVQA_DECODER__CPU_FAST_DECODE=false): Python and dispatch around many small operations a layer
(module calls, mask and position bookkeeping, seven separate products), a cache rewritten by
torch.cat every token, and one-core matrix-vector products. Here a layer is a few tensor calls:
one product for q, k and v together, one for gate and up together, rotary positions, the same
DynamicCache (appended in place, see _append), scaled-dot-product attention.

The fused weights are the only copies: the model's own q/k/v and gate/up weights become views into
them, so memory does not grow and the transformers forward (prefill, training, export) reads the
same numbers. Results equal the transformers forward up to summation order (tests/test_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "mistral")


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # (d, (heads + 2 kv_heads) * head_dim), contiguous
    o: torch.Tensor  # (heads * head_dim, d)
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # (d, 2 * intermediate), contiguous
    down: torch.Tensor  # (intermediate, d)


class LlamaDecodeStep:
    """Logits for one more token after a DynamicCache, on the weights of a loaded Llama-family model."""

    def __init__(self, model: nn.Module):
        config = model.config
        inner = model.model
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.hidden = config.hidden_size
        self.eps = config.rms_norm_eps
        self.scaling = self.head_dim ** -0.5
        self.rotary = inner.rotary_emb
        self.final_norm = inner.norm.weight
        self.head = model.lm_head.weight.t()  # (d, V): contiguous when the weights are column-major
        self.layers = []
        for layer in inner.layers:
            attention, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                input_norm=layer.input_layernorm.weight,
                qkv=_fuse([attention.q_proj, attention.k_proj, attention.v_proj]),
                o=attention.o_proj.weight.t(),
                post_norm=layer.post_attention_layernorm.weight,
                gate_up=_fuse([mlp.gate_proj, mlp.up_proj]),
                down=mlp.down_proj.weight.t()))
        self.intermediate = self.layers[0].gate_up.shape[1] // 2 if self.layers else 0

    @classmethod
    def build(cls, model: nn.Module, any_device: bool = False) -> "LlamaDecodeStep | None":
        """The fast step for `model`, or None where it does not apply (another architecture, biases,
        a device other than the CPU, quantised weights): the caller then uses the full forward.
        `any_device` allows any device and floating dtype (the batched step, `batch`, on CUDA)."""
        config = model.config
        if getattr(config, "model_type", "") not in SUPPORTED_MODEL_TYPES:
            return None
        if getattr(config, "sliding_window", None) or getattr(config, "pretraining_tp", 1) != 1:
            return None
        if getattr(config, "hidden_act", "silu") != "silu":
            return None
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            return None
        parameters = list(model.parameters())
        if not parameters:
            return None
        if any_device:
            if any(not p.dtype.is_floating_point for p in parameters):
                return None
        elif any(p.device.type != "cpu" or p.dtype != torch.float32 for p in parameters):
            return None
        if getattr(model, "hf_quantizer", None) is not None:
            return None
        return cls(model)

    @torch.inference_mode()
    def __call__(self, embeddings: torch.Tensor, cache, position: int) -> torch.Tensor:
        """Logits (1, V) after the tokens whose input embeddings are `embeddings` ((T, d), (1, T, d)
        or (1, d)), the first at `position`; `cache` (a DynamicCache over the positions before
        them) is extended by them. One token is a decode step; several are a prefill (a conversation's
        next question after its cached start)."""
        x = embeddings.reshape(-1, self.hidden)
        count = x.shape[0]
        positions = torch.arange(position, position + count, device=x.device).unsqueeze(0)
        cos, sin = self.rotary(x.unsqueeze(0), positions)  # (1, T, head_dim) each
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads: (1, 1, T, head_dim)
        # Causal: new token i (at position + i) sees the cache and new tokens 0..i.
        mask = None
        if count > 1:
            mask = (torch.arange(position + count, device=x.device).unsqueeze(0)
                    <= positions.transpose(0, 1))  # (T, position + T)
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        parts = torch.get_num_threads() if count == 1 else 1
        for index, layer in enumerate(self.layers):
            h = F.rms_norm(x, (self.hidden,), layer.input_norm, self.eps)
            qkv = _gemv(h, layer.qkv, parts)
            q = qkv[:, :q_width].view(count, self.heads, self.head_dim).transpose(0, 1).unsqueeze(0)
            k = qkv[:, q_width:q_width + kv_width].view(count, self.kv_heads, self.head_dim).transpose(0, 1).unsqueeze(0)
            v = qkv[:, q_width + kv_width:].view(count, self.kv_heads, self.head_dim).transpose(0, 1).unsqueeze(0)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys, values = _append(cache.layers[index], k, v)
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling,
                                                      enable_gqa=self.kv_heads != self.heads)  # (1, H, T, hd)
            x = x + _gemv(attended[0].transpose(0, 1).reshape(count, q_width), layer.o, parts)
            h = F.rms_norm(x, (self.hidden,), layer.post_norm, self.eps)
            gate_up = _gemv(h, layer.gate_up, parts)
            x = x + _gemv(F.silu(gate_up[:, :self.intermediate]) * gate_up[:, self.intermediate:], layer.down, parts)
        x = F.rms_norm(x[-1:], (self.hidden,), self.final_norm, self.eps)  # logits of the last token only
        return _gemv(x, self.head, torch.get_num_threads()).float()

    @torch.inference_mode()
    def batch(self, embeddings: torch.Tensor, caches: list, positions: list[int]) -> torch.Tensor:
        """Logits (N, V) for one more token in each of N conversations: row i of `embeddings` (N, d)
        is the next token of the conversation whose DynamicCache is `caches[i]`, at `positions[i]`.

        The products run once for all N rows (one read of the weights for N tokens: where batching
        pays); attention runs per conversation over its own cache, whatever its length, so each
        cache stays the conversation's own and nothing is padded. Row i equals the one-token step on
        its own up to summation order (tests/test_engines_transformers.py)."""
        count = len(caches)
        x = embeddings.reshape(count, self.hidden)
        position_ids = torch.tensor([positions], device=x.device)  # (1, N): one position per row
        cos, sin = self.rotary(x.unsqueeze(0), position_ids)  # (1, N, head_dim)
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # (N, 1, head_dim): broadcast over heads
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for index, layer in enumerate(self.layers):
            h = F.rms_norm(x, (self.hidden,), layer.input_norm, self.eps)
            qkv = torch.mm(h, layer.qkv)
            q = qkv[:, :q_width].view(count, self.heads, self.head_dim)
            k = qkv[:, q_width:q_width + kv_width].view(count, self.kv_heads, self.head_dim)
            v = qkv[:, q_width + kv_width:].view(count, self.kv_heads, self.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            rows = []
            for row, cache in enumerate(caches):  # (1, heads, 1, head_dim) per conversation
                keys, values = _append(cache.layers[index], k[row].unsqueeze(0).unsqueeze(2),
                                       v[row].unsqueeze(0).unsqueeze(2))
                rows.append(F.scaled_dot_product_attention(
                    q[row].unsqueeze(0).unsqueeze(2), keys, values, scale=self.scaling,
                    enable_gqa=self.kv_heads != self.heads).reshape(1, q_width))
            x = x + torch.mm(torch.cat(rows), layer.o)
            h = F.rms_norm(x, (self.hidden,), layer.post_norm, self.eps)
            gate_up = torch.mm(h, layer.gate_up)
            x = x + torch.mm(F.silu(gate_up[:, :self.intermediate]) * gate_up[:, self.intermediate:], layer.down)
        x = F.rms_norm(x, (self.hidden,), self.final_norm, self.eps)
        return torch.mm(x, self.head).float()


def _gemv(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """x (T, in) @ weight (in, out); for one row, with the rows of `weight` split into `parts` blocks
    multiplied side by side (one batched product) and summed.

    MKL runs a single-row product of a few-MB matrix on one core. Two cores, each taking half the
    rows (a contiguous block, so the split is a view), read faster: scripts/bench_gemv.py on this
    2-core AVX2 CPU, over 30 layers of SmolLM2's matrices, 26.8 ms (15.8 GB/s) with torch.mm and
    18.6 ms (22.9 GB/s) split in two; the 576 x 49152 head 4.5 -> 3.3 ms."""
    rows = weight.shape[0]
    if parts < 2 or x.shape[0] != 1 or rows % parts or not weight.is_contiguous():
        return torch.mm(x, weight)
    return torch.bmm(x.reshape(parts, 1, rows // parts), weight.view(parts, rows // parts, -1)).sum(0)


def _append(layer, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DynamicLayer.update without copying the whole cache each time.

    DynamicLayer appends with torch.cat, which rewrites a layer's keys and values every token: about
    25 MB a token for SmolLM2 at 500 tokens of context, 7 of the step's 38 ms here. This keeps them
    in buffers with room to grow and sets the layer's keys/values to views of the filled part, so the
    cache stays a plain DynamicCache for the transformers forward, crop() and copies. A layer whose
    keys are not a view of its buffer (a forward appended since) is moved into a new buffer first."""
    if not getattr(layer, "is_initialized", True) or getattr(layer, "keys", None) is None:
        return layer.update(key, value)
    keys, values = layer.keys, layer.values
    length = keys.shape[-2]
    buffers = getattr(layer, "_growable", None)
    if (buffers is None or buffers[0].data_ptr() != keys.data_ptr() or buffers[1].data_ptr() != values.data_ptr()
            or length + key.shape[-2] > buffers[0].shape[-2]):
        capacity = max(256, 2 * (length + key.shape[-2]))
        buffers = (keys.new_empty(*keys.shape[:-2], capacity, keys.shape[-1]),
                   values.new_empty(*values.shape[:-2], capacity, values.shape[-1]))
        buffers[0][..., :length, :] = keys
        buffers[1][..., :length, :] = values
        layer._growable = buffers
    end = length + key.shape[-2]
    buffers[0][..., length:end, :] = key
    buffers[1][..., length:end, :] = value
    layer.keys, layer.values = buffers[0][..., :end, :], buffers[1][..., :end, :]
    return layer.keys, layer.values


def _fuse(linears: list[nn.Linear]) -> torch.Tensor:
    """One (in, sum of outs) contiguous matrix for several bias-free linears that read the same
    input; each linear's weight becomes a view into it (values unchanged, no second copy)."""
    fused = torch.cat([linear.weight.detach().t() for linear in linears], dim=1).contiguous()
    start = 0
    for linear in linears:
        width = linear.weight.shape[0]
        linear.weight.data = fused[:, start:start + width].t()
        start += width
    return fused


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
