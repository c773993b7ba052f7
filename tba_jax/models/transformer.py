"""A Flax NNX decoder-only transformer of the Llama family.

RMSNorm, rotary position embeddings, grouped-query attention, SwiGLU, optional
tied embeddings and qkv bias. Every parameter carries `logical_axes` metadata
(`embed`, `mlp`, `heads`, `kv_heads`, `head_dim`, `vocab`, `norm`) that
`tba_jax.mesh` maps onto mesh axes.

Sequences live in *slots*: slot s of a row is column s of the token array (a
left-padded prompt followed by the response). `positions` give each slot's
rotary position (the count of real tokens before it), and `key_valid` marks
which slots hold real tokens, so left padding is invisible to attention.

The KV cache is a plain pytree (a tuple of per-layer dicts of arrays) passed in
and returned, so jitted decode loops can carry and donate it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from tba_jax.models.config import ModelConfig

KVCache = tuple[dict[str, jax.Array], ...]


def _param(rngs: nnx.Rngs, cfg: ModelConfig, shape, axes, *, std: float | None = None):
    """A normal-initialised parameter tagged with its logical axis names."""
    std = cfg.init_std if std is None else std
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value.astype(cfg.storage_dtype), logical_axes=axes)


def dense(x: jax.Array, weight: jax.Array, in_dims: int = 1) -> jax.Array:
    """Contracts the last `in_dims` axes of x with the first `in_dims` axes of weight.

    Done as one 2-D matmul ([tokens, in] @ [in, out]): XLA's CPU backend is about
    twice as fast on that as on the equivalent batched einsum, forward and backward.
    """
    in_shape, out_shape = weight.shape[:in_dims], weight.shape[in_dims:]
    lead = x.shape[: x.ndim - in_dims]
    flat = x.reshape(-1, math.prod(in_shape)) @ weight.reshape(math.prod(in_shape), -1)
    return flat.reshape(*lead, *out_shape)


def _constant_param(cfg: ModelConfig, shape, axes, fill: float):
    return nnx.Param(jnp.full(shape, fill, cfg.storage_dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig):
        self.scale = _constant_param(cfg, (cfg.d_model,), ("norm",), 1.0)
        self.eps = cfg.norm_eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normed = x32 * jax.lax.rsqrt(variance + self.eps)
        return (normed * self.scale.value.astype(jnp.float32)).astype(x.dtype)


def rotary_embedding(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Applies rotary embeddings (the `rotate_half` convention of Llama checkpoints).

    x: [B, S, N, D]; positions: [B, S] int. Returns x rotated, same dtype.
    """
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, S, 1, D]
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, kv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        self.cfg = cfg
        self.wq = _param(rngs, cfg, (d, h, hd), ("embed", "heads", "head_dim"))
        self.wk = _param(rngs, cfg, (d, kv, hd), ("embed", "kv_heads", "head_dim"))
        self.wv = _param(rngs, cfg, (d, kv, hd), ("embed", "kv_heads", "head_dim"))
        self.wo = _param(rngs, cfg, (h, hd, d), ("heads", "head_dim", "embed"))
        if cfg.qkv_bias:
            self.bq = _constant_param(cfg, (h, hd), ("heads", "head_dim"), 0.0)
            self.bk = _constant_param(cfg, (kv, hd), ("kv_heads", "head_dim"), 0.0)
            self.bv = _constant_param(cfg, (kv, hd), ("kv_heads", "head_dim"), 0.0)

    def _project(self, x, weight, bias_name):
        dt = self.cfg.compute_dtype
        out = dense(x, weight.value.astype(dt))
        if self.cfg.qkv_bias:
            out = out + getattr(self, bias_name).value.astype(dt)
        return out

    def __call__(self, x, positions, key_valid, cache_layer, cache_offset):
        """x: [B, S, D]; positions: [B, S]; key_valid: [B, S_kv] bool.

        Without a cache S_kv == S and the queries sit in slots 0..S-1. With a
        cache (`cache_layer` = {"k","v"}: [B, S_kv, KV, hd]) the new keys and
        values are written at slots cache_offset..cache_offset+S-1.
        """
        cfg = self.cfg
        batch, seq_len, _ = x.shape
        q = rotary_embedding(self._project(x, self.wq, "bq"), positions, cfg.rope_theta)
        k = rotary_embedding(self._project(x, self.wk, "bk"), positions, cfg.rope_theta)
        v = self._project(x, self.wv, "bv")
        if cache_layer is not None:
            start = (0, cache_offset, 0, 0)
            k = jax.lax.dynamic_update_slice(
                cache_layer["k"], k.astype(cache_layer["k"].dtype), start
            )
            v = jax.lax.dynamic_update_slice(
                cache_layer["v"], v.astype(cache_layer["v"].dtype), start
            )
            cache_layer = {"k": k, "v": v}
            query_slots = cache_offset + jnp.arange(seq_len)
        else:
            query_slots = jnp.arange(seq_len)
        key_slots = jnp.arange(k.shape[1])
        causal = key_slots[None, :] <= query_slots[:, None]  # [S, S_kv]
        mask = causal[None, :, :] & key_valid[:, None, :]  # [B, S, S_kv]

        groups = cfg.num_heads // cfg.num_kv_heads
        q = q.reshape(batch, seq_len, cfg.num_kv_heads, groups, cfg.resolved_head_dim)
        scores = jnp.einsum("bskgd,btkd->bkgst", q, k.astype(q.dtype)).astype(jnp.float32)
        scores = scores / jnp.sqrt(jnp.float32(cfg.resolved_head_dim))
        scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(cfg.compute_dtype)
        out = jnp.einsum("bkgst,btkd->bskgd", weights, v.astype(cfg.compute_dtype))
        out = out.reshape(batch, seq_len, cfg.num_heads, cfg.resolved_head_dim)
        out = dense(out, self.wo.value.astype(cfg.compute_dtype), in_dims=2)
        return out, cache_layer


class SwiGLU(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.w_gate = _param(rngs, cfg, (cfg.d_model, cfg.d_ff), ("embed", "mlp"))
        self.w_up = _param(rngs, cfg, (cfg.d_model, cfg.d_ff), ("embed", "mlp"))
        self.w_down = _param(rngs, cfg, (cfg.d_ff, cfg.d_model), ("mlp", "embed"))

    def __call__(self, x):
        dt = self.cfg.compute_dtype
        gate = jax.nn.silu(dense(x, self.w_gate.value.astype(dt)))
        return dense(gate * dense(x, self.w_up.value.astype(dt)), self.w_down.value.astype(dt))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg)
        self.mlp = SwiGLU(cfg, rngs)

    def __call__(self, x, positions, key_valid, cache_layer, cache_offset):
        attn_out, cache_layer = self.attn(
            self.attn_norm(x), positions, key_valid, cache_layer, cache_offset
        )
        x = x + attn_out
        x = x + self.mlp(self.mlp_norm(x))
        return x, cache_layer


class Decoder(nnx.Module):
    """Decoder-only language model. Call it on tokens; it returns float32 logits."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = _param(rngs, cfg, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, cfg, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        key_valid: jax.Array,
        cache: KVCache | None = None,
        cache_offset: jax.Array | int = 0,
    ) -> tuple[jax.Array, KVCache | None]:
        """tokens, positions: [B, S] int32; key_valid: [B, S_kv] bool.

        Returns logits [B, S, V] float32 and the updated cache (None without one).
        """
        dt = self.cfg.compute_dtype
        x = jnp.take(self.embedding.value, tokens, axis=0).astype(dt)
        new_cache = []
        for index, block in enumerate(self.blocks):
            layer_cache = None if cache is None else cache[index]
            x, layer_cache = block(x, positions, key_valid, layer_cache, cache_offset)
            new_cache.append(layer_cache)
        x = self.final_norm(x)
        if self.cfg.tie_embeddings:
            logits = dense(x, self.embedding.value.astype(dt).T)
        else:
            logits = dense(x, self.lm_head.value.astype(dt))
        return logits.astype(jnp.float32), (None if cache is None else tuple(new_cache))


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None) -> KVCache:
    """Zeroed KV cache: per layer k, v of shape [B, length, KV, head_dim]."""
    dtype = cfg.compute_dtype if dtype is None else dtype
    shape = (batch, length, cfg.num_kv_heads, cfg.resolved_head_dim)
    return tuple(
        {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(cfg.num_layers)
    )


def positions_from_mask(valid: jax.Array) -> jax.Array:
    """Rotary positions of each slot: number of real tokens before it. valid: [B, S]."""
    return jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1, 0)
