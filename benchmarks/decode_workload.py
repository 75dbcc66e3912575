"""The decode workload of bench_memory.py: one greedy decode step of a small
decoder-only model with a static KV cache, written twice with the same math
and the same weights, in PyTorch (lazy or ``torch.compile``) and in JAX.

A step takes the weights, the previous token [B, 1], its position and the
cache (one ``(k, v)`` pair of f32[B * heads, positions, head_dim] per layer),
writes the token's keys and values at the position, attends over the cache up
to it and returns the next token, the next position and the new cache.  PyTorch writes
with ``index_copy`` (the form ``examples/decode_kv_cache.py`` explains), JAX
with ``jax.lax.dynamic_update_slice``.  Without donation a step holds the old
and the new cache; donated (``tdx.donating`` / ``jax.jit(donate_argnums=3)``),
the new cache is written over the old one.

    >>> SHAPES["layers"], cache_bytes()  # 4 layers, a 128 MiB cache
    (4, 134217728)
"""
import numpy as np

SHAPES = {"layers": 4, "batch": 4, "heads": 8, "head_dim": 64, "positions": 2048, "vocab": 512}
START = 100  # the first decoded position (the cache before it counts as a prompt)


def cache_bytes(s=SHAPES) -> int:
    return s["layers"] * 2 * s["batch"] * s["heads"] * s["positions"] * s["head_dim"] * 4


def weights(s=SHAPES, seed=0) -> dict:
    """numpy float32 weights; both frameworks load the same ones."""
    rng = np.random.default_rng(seed)
    width = s["heads"] * s["head_dim"]

    def normal(*shape, std=0.02):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w = {"tokens": normal(s["vocab"], width, std=1.0), "positions": normal(s["positions"], width),
         "head": normal(width, s["vocab"])}
    for layer in range(s["layers"]):
        w[f"{layer}.qkv"] = normal(width, 3 * width)
        w[f"{layer}.proj"] = normal(width, width)
        w[f"{layer}.up"] = normal(width, 4 * width)
        w[f"{layer}.down"] = normal(4 * width, width)
    return w


def initial_cache(s=SHAPES, seed=1):
    """The cache as numpy arrays: random entries, as if a prompt had filled it."""
    rng = np.random.default_rng(seed)
    shape = (s["batch"] * s["heads"], s["positions"], s["head_dim"])
    return [tuple(rng.standard_normal(shape).astype(np.float32) for _ in "kv")
            for _ in range(s["layers"])]


def torch_step(s=SHAPES):
    """decode(w, ids [B, 1] int64, pos [1] int64, cache) -> (ids, pos, cache)."""
    import torch
    import torch.nn.functional as F

    b, nh, hd, positions = s["batch"], s["heads"], s["head_dim"], s["positions"]
    width = nh * hd

    def heads(x):  # [B, 1, width] -> [B * heads, 1, head_dim]
        return x.view(b, 1, nh, hd).transpose(1, 2).reshape(b * nh, 1, hd)

    def decode(w, ids, pos, cache):
        h = w["tokens"][ids] + w["positions"][pos]
        seen = torch.arange(positions, device=ids.device) <= pos
        new_cache = []
        for layer, (k_cache, v_cache) in enumerate(cache):
            q, k, v = (F.layer_norm(h, (width,)) @ w[f"{layer}.qkv"]).split(width, -1)
            k_cache = k_cache.index_copy(1, pos, heads(k))
            v_cache = v_cache.index_copy(1, pos, heads(v))
            scores = (heads(q) * hd ** -0.5) @ k_cache.transpose(1, 2)
            a = scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v_cache
            h = h + a.view(b, nh, 1, hd).transpose(1, 2).reshape(b, 1, width) @ w[f"{layer}.proj"]
            h = h + F.gelu(F.layer_norm(h, (width,)) @ w[f"{layer}.up"]) @ w[f"{layer}.down"]
            new_cache.append((k_cache, v_cache))
        logits = F.layer_norm(h, (width,)) @ w["head"]
        return logits.argmax(-1), pos + 1, new_cache

    return decode


def jax_step(s=SHAPES):
    """decode(w, ids [B, 1] int32, pos [] int32, cache) -> (ids, pos, cache)."""
    import jax
    import jax.numpy as jnp

    b, nh, hd, positions = s["batch"], s["heads"], s["head_dim"], s["positions"]
    width = nh * hd

    def layer_norm(x, eps=1e-5):
        mean = x.mean(-1, keepdims=True)
        return (x - mean) / jnp.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)

    def heads(x):
        return x.reshape(b, 1, nh, hd).transpose(0, 2, 1, 3).reshape(b * nh, 1, hd)

    def decode(w, ids, pos, cache):
        h = w["tokens"][ids] + w["positions"][pos]
        seen = jnp.arange(positions) <= pos
        new_cache = []
        for layer, (k_cache, v_cache) in enumerate(cache):
            q, k, v = jnp.split(layer_norm(h) @ w[f"{layer}.qkv"], 3, -1)
            k_cache = jax.lax.dynamic_update_slice(k_cache, heads(k), (0, pos, 0))
            v_cache = jax.lax.dynamic_update_slice(v_cache, heads(v), (0, pos, 0))
            scores = (heads(q) * hd ** -0.5) @ k_cache.transpose(0, 2, 1)
            a = jax.nn.softmax(jnp.where(seen, scores, -jnp.inf), -1) @ v_cache
            h = h + a.reshape(b, nh, 1, hd).transpose(0, 2, 1, 3).reshape(b, 1, width) @ w[f"{layer}.proj"]
            h = h + jax.nn.gelu(layer_norm(h) @ w[f"{layer}.up"], approximate=False) @ w[f"{layer}.down"]
            new_cache.append((k_cache, v_cache))
        logits = layer_norm(h) @ w["head"]
        return logits.argmax(-1).astype(ids.dtype), pos + 1, new_cache

    return decode
