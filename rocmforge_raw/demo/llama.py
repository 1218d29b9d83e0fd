"""A Llama in NumPy (float64), the math of Hugging Face transformers' LlamaForCausalLM
(RMSNorm, rotary embeddings, grouped-query attention, SwiGLU), run two ways: ``dense`` (the
model's own run: causal attention over the whole sequence at once) and ``step`` (the
attention of each layer through a ``KvCache`` step: its K/V written at the step's slots,
each query row attending to the cache as ``KvCache.attention`` computes it). Weights are
random (``random_weights``) or a transformers model's (``weights_of``).

The disaggregated demo (``demo.disagg``) serves it; the suite checks it against
transformers' own model where that is installed (``tests/test_real_client.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cache import KvCache
from ..memory.array import DeviceArray


@dataclass(frozen=True)
class LlamaShape:
    """The model's sizes: vocabulary, hidden width, layers, query and KV heads of
    ``head_dim``, the MLP's width, RoPE's base and RMSNorm's epsilon."""

    vocab: int = 128
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 192
    rope_theta: float = 10000.0
    eps: float = 1e-6


def random_weights(shape: LlamaShape, seed: int) -> dict[str, np.ndarray]:
    """Float64 weights drawn from ``seed``: the same in every process for one seed."""
    rng = np.random.default_rng(seed)

    def w(*dims: int, scale: float = 0.08) -> np.ndarray:
        return rng.standard_normal(dims) * scale

    s = shape
    weights = {"embed": w(s.vocab, s.hidden, scale=1.0), "norm": 1 + w(s.hidden),
               "lm_head": w(s.vocab, s.hidden)}
    for i in range(s.layers):
        weights.update({
            f"{i}.in_norm": 1 + w(s.hidden), f"{i}.post_norm": 1 + w(s.hidden),
            f"{i}.q": w(s.heads * s.head_dim, s.hidden), f"{i}.k": w(s.kv_heads * s.head_dim,
                                                                      s.hidden),
            f"{i}.v": w(s.kv_heads * s.head_dim, s.hidden), f"{i}.o": w(s.hidden,
                                                                        s.heads * s.head_dim),
            f"{i}.gate": w(s.intermediate, s.hidden), f"{i}.up": w(s.intermediate, s.hidden),
            f"{i}.down": w(s.hidden, s.intermediate)})
    return weights


def weights_of(model: Any) -> dict[str, np.ndarray]:
    """The float64 weights of a transformers ``LlamaForCausalLM``, under this module's names."""
    sd = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    weights = {"embed": sd["model.embed_tokens.weight"], "norm": sd["model.norm.weight"],
               "lm_head": sd["lm_head.weight"]}
    names = {"in_norm": "input_layernorm", "post_norm": "post_attention_layernorm",
             "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
             "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
             "down": "mlp.down_proj"}
    for i in range(model.config.num_hidden_layers):
        for ours, theirs in names.items():
            weights[f"{i}.{ours}"] = sd[f"model.layers.{i}.{theirs}.weight"]
    return weights


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    normed: np.ndarray = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight
    return normed


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotary embedding of ``x`` ``[tokens, heads, dim]`` at ``positions`` (transformers'
    rotate-half layout)."""
    dim = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    angles = positions[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(angles)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(angles)] * 2, -1)[:, None, :]
    half = dim // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    turned: np.ndarray = x * cos + rotated * sin
    return turned


class Llama:
    """The model of ``shape`` with ``weights`` (``random_weights`` or ``weights_of``)."""

    def __init__(self, shape: LlamaShape, weights: dict[str, np.ndarray]) -> None:
        self.shape, self.w = shape, weights

    def _qkv(self, i: int, x: np.ndarray, positions: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        s, w = self.shape, self.w
        h = rms_norm(x, w[f"{i}.in_norm"], s.eps)
        q = (h @ w[f"{i}.q"].T).reshape(len(x), s.heads, s.head_dim)
        k = (h @ w[f"{i}.k"].T).reshape(len(x), s.kv_heads, s.head_dim)
        v = (h @ w[f"{i}.v"].T).reshape(len(x), s.kv_heads, s.head_dim)
        return rope(q, positions, s.rope_theta), rope(k, positions, s.rope_theta), v

    def _rest(self, i: int, x: np.ndarray, attended: np.ndarray) -> np.ndarray:
        s, w = self.shape, self.w
        x = x + attended.reshape(len(x), -1) @ w[f"{i}.o"].T
        h = rms_norm(x, w[f"{i}.post_norm"], s.eps)
        gate, up = h @ w[f"{i}.gate"].T, h @ w[f"{i}.up"].T
        out: np.ndarray = x + (gate / (1 + np.exp(-gate)) * up) @ w[f"{i}.down"].T
        return out

    def _logits(self, x: np.ndarray) -> np.ndarray:
        logits: np.ndarray = rms_norm(x, self.w["norm"], self.shape.eps) @ self.w["lm_head"].T
        return logits

    def dense(self, tokens: np.ndarray) -> np.ndarray:
        """Logits ``[len(tokens), vocab]`` of one sequence, causal attention in float64."""
        s = self.shape
        n = len(tokens)
        x = self.w["embed"][tokens]
        positions = np.arange(n, dtype=np.float64)
        group = s.heads // s.kv_heads
        mask = np.tril(np.ones((n, n), bool))
        for i in range(s.layers):
            q, k, v = self._qkv(i, x, positions)
            k, v = np.repeat(k, group, 1), np.repeat(v, group, 1)
            scores = np.einsum("ihd,jhd->hij", q, k) / math.sqrt(s.head_dim)
            scores = np.where(mask[None], scores, -np.inf)
            scores -= scores.max(-1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(-1, keepdims=True)
            x = self._rest(i, x, np.einsum("hij,jhd->ihd", p, v))
        return self._logits(x)

    def step(self, cache: KvCache, meta: Any, tokens: np.ndarray, positions: np.ndarray
             ) -> np.ndarray:
        """Logits ``[rows, vocab]`` of a step's query rows: ``tokens`` and their
        ``positions`` in the order of the plan ``meta`` (``cache.batch``: each sequence's
        rows together); every layer writes the rows' K/V and attends through ``cache`` (its
        dtype, backend and device). Waits for each layer's attention (its result feeds the
        next layer on the host)."""
        s = self.shape
        dtype = cache.config.dtype
        backend, device = cache.slab.backend, cache.slab.device
        x = self.w["embed"][tokens]
        for i in range(s.layers):
            q, k, v = self._qkv(i, x, positions.astype(np.float64))
            key, value, query = (DeviceArray.from_numpy(a.astype(dtype), device, backend)
                                 for a in (k, v, q))
            out = DeviceArray.empty(q.shape, dtype, device, backend)
            cache.write(i, key, value, meta)
            cache.attention(i, out, query, meta)
            attended = out.to_numpy().astype(np.float64)
            for array in (key, value, query, out):
                array.buffer.close()
            x = self._rest(i, x, attended)
        return self._logits(x)
