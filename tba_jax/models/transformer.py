"""A Flax NNX decoder-only transformer for the llama, qwen2, gpt_neox and gpt2 families.

One module with switches (see `ModelConfig`): RMSNorm or LayerNorm, rotary
(full or partial, optionally Llama-3 scaled) or learned position embeddings,
grouped-query attention with optional biases, a gated (SwiGLU) or dense MLP,
sequential or parallel residuals, tied or separate output embeddings, and a
language-model or score head. Every parameter carries `logical_axes` metadata
(`embed`, `mlp`, `heads`, `kv_heads`, `head_dim`, `vocab`, `norm`, `labels`)
that `tba_jax.mesh` maps onto mesh axes. The learned position table's rows use
the `vocab` name (it is a lookup table like the token embedding).

Sequences live in *slots*: slot s of a row is column s of the token array (a
left-padded prompt followed by the response). `positions` give each slot's
position (the count of real tokens before it; rotary angle or row of the
learned table), and `key_valid` marks which slots hold real tokens, so left
padding is invisible to attention.

The KV cache is a plain pytree (a tuple of per-layer dicts of arrays, or one dict of
stacked arrays with `scan_decode`) passed in and returned, so jitted decode loops can
carry and donate it.

With `cfg.scan_layers` the decoder holds one `Block` whose params carry every layer's on
a leading `layers` axis; the cache-free pass (`features`, what the learner and scoring
run) scans it with `jax.lax.scan`. A pass with a cache runs the layers one by one on
static slices of it (the cache keeps its per-layer layout), or with `cfg.scan_decode`
scans them too, over a stacked cache {"k", "v"}: [L, B, S_kv, KV, hd] whose layer slice
each step reads and whose new keys it writes in place (`cache_batch_axis` says where a
cache's rows are). `cfg.remat` wraps each block of the cache-free pass in
`jax.checkpoint`, and `cfg.attention` picks that pass's attention kernel (and, unless
`cfg.decode_attention="pallas"` gives them `models.decode_attention`'s kernel, every pass
with a cache's); `cfg.decode_mlp="pallas"` gives a decode step's gated MLP
`models.gated_mlp`'s kernel, and `cfg.decode_projection="pallas"` its output projections
(attention's W_o, the MLP's W_down) `models.decode_projection`'s.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tba_jax.models import splash_attention
from tba_jax.models.config import MIN_MLP_BLOCK, REMAT_POLICIES, ModelConfig
from tba_jax.models.decode_attention import decode_attention
from tba_jax.models.decode_projection import project
from tba_jax.models.decode_qkv import project_qkv
from tba_jax.models.gated_mlp import gated_hidden

# per layer {"k", "v"}, or with scan_decode one {"k", "v"} of stacked [L, ...] arrays
KVCache = tuple[dict[str, jax.Array], ...] | dict[str, jax.Array]
LAYERS_AXIS = "layers"  # logical name of the stacked blocks' leading axis (scan_layers)

CHECKPOINT_POLICIES = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
assert set(CHECKPOINT_POLICIES) == set(REMAT_POLICIES) - {"none"}
# jax.nn.dot_product_attention's `implementation` for each fused `cfg.attention` (splash's:
# in passes with a KV cache; a cache-free pass runs `splash_attention`).
FUSED_ATTENTION_IMPLEMENTATIONS = {"dot_product": None, "cudnn": "cudnn", "splash": None}
# The cache-free pass pads its sequence to a multiple of this before a fused kernel: cuDNN's
# flash attention refuses to train with a mask on an odd length (JAX's
# check_is_flash_attention; TL;DR's 512 + 53 tokens, found on an H100); splash attention
# works in blocks of 128 slots.
FUSED_SEQ_MULTIPLE = {"dot_product": 1, "cudnn": 2, "splash": splash_attention.BLOCK}

ACTIVATION_FNS = {
    "silu": jax.nn.silu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),  # erf form (torch "gelu")
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),  # tanh form (GPT-2)
}


# The params the model casts to the compute dtype at their every use and uses no other way:
# the blocks' matrices (`.astype(dt)` before a matmul) and biases (added to a matmul's
# output in its dtype), the LM head, and the token embedding where no learned position
# table is added to it in the storage dtype first. Norms stay in theirs (they compute in
# float32). `params_in_compute_dtype` casts them.
COMPUTE_DTYPE_PARAMS = frozenset(
    {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head"}
    | {"bq", "bk", "bv", "bo", "b_gate", "b_up", "b_down"}
)


def _casts_to_compute_dtype(cfg: ModelConfig, path: tuple, leaf, for_gradients: bool) -> bool:
    """Whether `params_in_compute_dtype` casts the leaf at `path` (a key path)."""
    names = COMPUTE_DTYPE_PARAMS
    if cfg.position_embedding != "learned" and not for_gradients:
        names = names | {"embedding"}
    if for_gradients and cfg.logprob_chunk > 0:
        names = names - {"lm_head"}  # used by every log-prob chunk: params_in_compute_dtype
    return getattr(path[-1], "key", None) in names and leaf.dtype != cfg.compute_dtype


def has_params_to_cast(cfg: ModelConfig, params: dict, *, for_gradients: bool = False) -> bool:
    """Whether `params_in_compute_dtype` would cast any leaf of `params`."""
    items = jax.tree_util.tree_leaves_with_path(params)
    return any(_casts_to_compute_dtype(cfg, *item, for_gradients) for item in items)


def params_in_compute_dtype(cfg: ModelConfig, params: dict, *, for_gradients: bool = False) -> dict:
    """`params` with the leaves the model only uses in the compute dtype cast to it
    (`COMPUTE_DTYPE_PARAMS`; the token embedding too without learned positions): the
    model computes the same values from them, reading half the bytes of float32 params
    with bfloat16 compute. A decode loop casts once before it (`Model.for_decoding`), where
    XLA would otherwise convert every weight again at every step. `params` itself (not a
    copy) when nothing is to be cast.

    `for_gradients`: params to differentiate through (the learner casts once before its
    micro-batches). A leaf used more than once in a pass has its gradients summed in its
    own dtype, so the leaves used more than once stay: the token embedding (the gradient
    of its row lookup sums repeated tokens' rows) and, with `logprob_chunk`, the LM head
    (each chunk of the log-probs uses it). The others are used once, and their gradients,
    taken at the cast leaves and added to a float32 sum, are the float32 params' exactly."""
    if not has_params_to_cast(cfg, params, for_gradients=for_gradients):
        return params

    def cast(path, leaf):
        if _casts_to_compute_dtype(cfg, path, leaf, for_gradients):
            return leaf.astype(cfg.compute_dtype)
        return leaf

    return jax.tree_util.tree_map_with_path(cast, params)


@functools.cache
def compute_dtype_cast(cfg: ModelConfig):
    """`params_in_compute_dtype` of `cfg` as one function per config: a stable key for
    the compiled copies that publish params to the searchers (`mesh.publish`'s `cast`)."""
    return functools.partial(params_in_compute_dtype, cfg)


def _param(rngs: nnx.Rngs, cfg: ModelConfig, shape, axes, *, std: float | None = None):
    """A normal-initialised parameter tagged with its logical axis names."""
    std = cfg.init_std if std is None else std
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value.astype(cfg.storage_dtype), logical_axes=axes)


def _constant_param(cfg: ModelConfig, shape, axes, fill: float):
    return nnx.Param(jnp.full(shape, fill, cfg.storage_dtype), logical_axes=axes)


def dense(x: jax.Array, weight: jax.Array, in_dims: int = 1) -> jax.Array:
    """Contracts the last `in_dims` axes of x with the first `in_dims` axes of weight.

    Done as one 2-D matmul ([tokens, in] @ [in, out]): XLA's CPU backend is about
    twice as fast on that as on the equivalent batched einsum, forward and backward.
    """
    in_shape, out_shape = weight.shape[:in_dims], weight.shape[in_dims:]
    lead = x.shape[: x.ndim - in_dims]
    flat = x.reshape(-1, math.prod(in_shape)) @ weight.reshape(math.prod(in_shape), -1)
    return flat.reshape(*lead, *out_shape)


def output_projection(
    x: jax.Array,
    weight: jax.Array,
    cfg: ModelConfig,
    *,
    decode_step: bool,
    split: int,
    in_dims: int = 1,
    residual: jax.Array | None = None,
) -> jax.Array:
    """`dense(x, weight, in_dims)`, plus `residual` (the block's residual stream, of the
    output's shape) if given; in a decode step with `cfg.decode_projection="pallas"`
    through `models.decode_projection`'s kernel (`split`: how many equal parts a mesh's
    tensor axis may cut the contraction into), which adds the residual itself where it
    computes the whole contraction in one part."""
    if not (decode_step and cfg.decode_projection == "pallas"):
        out = dense(x, weight, in_dims)
        return out if residual is None else residual + out.astype(residual.dtype)
    width = math.prod(weight.shape[:in_dims])
    out_shape = (*x.shape[: x.ndim - in_dims], *weight.shape[in_dims:])
    flat = project(
        x.reshape(-1, width),
        weight.reshape(width, -1),
        split=split,
        residual=None if residual is None else residual.reshape(-1, out_shape[-1]),
        settings=cfg.decode_projection_kernel_settings,
    )
    return flat.reshape(out_shape)


def _add_bias(x: jax.Array, bias: nnx.Param | None) -> jax.Array:
    return x if bias is None else x + bias[...].astype(x.dtype)


class Norm(nnx.Module):
    """RMSNorm (`cfg.norm="rms"`) or LayerNorm (`"layer"`, bias if `cfg.norm_bias`), in float32."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.scale = _constant_param(cfg, (cfg.d_model,), ("norm",), 1.0)
        if cfg.norm_bias:
            self.bias = _constant_param(cfg, (cfg.d_model,), ("norm",), 0.0)

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        bias = self.bias[...] if cfg.norm_bias else None
        return normalise(x, self.scale[...], cfg.norm_eps, center=cfg.norm == "layer", bias=bias)


def normalise(
    x: jax.Array,
    scale: jax.Array,
    eps: float,
    *,
    center: bool = False,
    bias: jax.Array | None = None,
) -> jax.Array:
    """x [..., D] normalised over its last axis in float32 (RMSNorm; LayerNorm's centring
    first if `center`), times `scale` [D], plus `bias` [D]; in x's dtype. `Norm`'s
    arithmetic, and the benchmarks' baseline for the decode kernels that fold it in."""
    x32 = x.astype(jnp.float32)
    if center:
        x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    normed = x32 * jax.lax.rsqrt(variance + eps) * scale.astype(jnp.float32)
    if bias is not None:
        normed = normed + bias.astype(jnp.float32)
    return normed.astype(x.dtype)


def llama3_scaled_inv_freq(inv_freq: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Llama 3.x frequency remapping, as transformers' `_compute_llama3_parameters`.

    Wavelengths longer than original_max_len / low_freq_factor are slowed down by
    `rope_scaling_factor`, those shorter than original_max_len / high_freq_factor are
    kept, and the ones between are interpolated smoothly. inv_freq: [D/2] float32.
    """
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    context = cfg.rope_original_max_len
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < context / high) & ~(wavelen > context / low)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rotary_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies of the rotated dims: [rotary_dim / 2] float32 (a trace-time constant)."""
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    inv_freq = inv_freq.astype(np.float32)
    if cfg.rope_scaling == "llama3":
        inv_freq = llama3_scaled_inv_freq(inv_freq, cfg)
    return inv_freq


def rotary_embedding(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates the first 2 * len(inv_freq) dims of each head (`rotate_half` convention).

    x: [B, S, N, D]; positions: [B, S] int; inv_freq: [R/2] with R <= D. The other
    D - R dims pass through (GPT-NeoX's partial rotary). Returns x's shape and dtype.
    """
    rotary_dim = 2 * inv_freq.shape[0]
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, S, R/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, S, 1, R]
    x32 = x.astype(jnp.float32)
    rotary, passthrough = x32[..., :rotary_dim], x32[..., rotary_dim:]
    first, second = jnp.split(rotary, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    rotary = rotary * jnp.cos(angles) + rotated * jnp.sin(angles)
    return jnp.concatenate([rotary, passthrough], axis=-1).astype(x.dtype)


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
        if cfg.attn_out_bias:
            self.bo = _constant_param(cfg, (d,), ("embed",), 0.0)

    def _project(self, x, weight, bias_name):
        dt = self.cfg.compute_dtype
        out = dense(x, weight[...].astype(dt))
        return _add_bias(out, getattr(self, bias_name) if self.cfg.qkv_bias else None)

    def _rotate(self, x, positions):
        if self.cfg.position_embedding != "rope":
            return x
        return rotary_embedding(x, positions, rotary_inv_freq(self.cfg))

    def _project_into_cache(self, x, norm, positions, cache_layer, cache_offset):
        """(q [B, 1, H, hd], the layer's cache with the new keys and values written) of a
        decode step through `models.decode_qkv`'s kernel: `x` [B, 1, D] is the block's
        input before `norm` (its RMSNorm), which the kernel applies."""
        cfg = self.cfg
        dt = cfg.compute_dtype
        batch = x.shape[0]
        weights = [getattr(self, name)[...].astype(dt) for name in ("wq", "wk", "wv")]
        if cfg.qkv_bias:
            biases = tuple(getattr(self, name)[...].astype(dt) for name in ("bq", "bk", "bv"))
        else:
            biases = tuple(jnp.zeros(w.shape[1:], dt) for w in weights)
        cos = sin = None
        if cfg.position_embedding == "rope":
            angles = positions[:, 0].astype(jnp.float32)[:, None] * rotary_inv_freq(cfg)
            cos, sin = jnp.cos(angles), jnp.sin(angles)
        slots = jnp.broadcast_to(jnp.asarray(cache_offset, jnp.int32), (batch,))
        q, cache_k, cache_v = project_qkv(
            x[:, 0].astype(dt),
            norm.scale[...],
            *weights,
            biases,
            cos,
            sin,
            cache_layer["k"],
            cache_layer["v"],
            slots,
            eps=cfg.norm_eps,
            settings=cfg.decode_qkv_kernel_settings,
        )
        return q[:, None], {"k": cache_k, "v": cache_v}

    def __call__(
        self, x, positions, key_valid, cache_layer, cache_offset, layer=None, norm=None,
        residual=None,
    ):  # fmt: skip
        """x: [B, S, D]; positions: [B, S]; key_valid: [B, S_kv] bool.

        Without a cache S_kv == S and the queries sit in slots 0..S-1. With a
        cache (`cache_layer` = {"k","v"}: [B, S_kv, KV, hd]) the new keys and
        values are written at slots cache_offset..cache_offset+S-1: `cache_offset` is
        one offset for every row (a scalar) or one per row ([B], the slot engine's).
        With `layer` (an index, traced inside a scan) `cache_layer` is every layer's
        stacked cache ([L, B, S_kv, KV, hd]): this layer's new keys are written into it
        and its slice `layer` is attended over. A `key_valid` shorter than the cache
        ([B, S_att], S_att <= S_kv, the new slots inside it) attends over the cache's
        first S_att slots only: a decode step whose later slots are all still empty need
        not read them (with a fused `cfg.attention` kernel they are masked instead: the
        kernel reads the whole cache). With `norm` (the block's RMSNorm, a decode step with
        `cfg.decode_qkv="pallas"`) x is the block's input before it, and one kernel
        normalises it, projects, rotates and writes the cache (`_project_into_cache`).
        With `residual` (the block's input, [B, S, D]) the output is residual + attention's
        output, added by the output projection (`output_projection`).
        """
        cfg = self.cfg
        decode_step = cache_layer is not None and x.shape[1] == 1
        # a decode step (one query slot over a cache) through the Pallas kernel reads the
        # whole cache as the fused kernels do (its loop stops at the last visible slot)
        pallas_step = decode_step and cfg.decode_attention == "pallas"
        fused = cfg.attention in FUSED_ATTENTION_IMPLEMENTATIONS or pallas_step
        if norm is not None:
            q, cache_layer = self._project_into_cache(x, norm, positions, cache_layer, cache_offset)
            k, v = cache_layer["k"], cache_layer["v"]
        else:
            q = self._rotate(self._project(x, self.wq, "bq"), positions)
            k = self._rotate(self._project(x, self.wk, "bk"), positions)
            v = self._project(x, self.wv, "bv")
        if cache_layer is None and fused:
            out = fused_attention(q, k, v, key_valid, cfg)
        else:
            query_slots = jnp.arange(x.shape[1])[None]  # [1, S]
            if cache_layer is not None:
                offsets = jnp.asarray(cache_offset)
                if norm is not None:  # the kernel wrote the new keys and values
                    pass
                elif layer is None:
                    k = write_cache(cache_layer["k"], k, offsets)
                    v = write_cache(cache_layer["v"], v, offsets)
                    cache_layer = {"k": k, "v": v}
                else:
                    cache_layer = {
                        "k": write_layer_cache(cache_layer["k"], k, layer, offsets),
                        "v": write_layer_cache(cache_layer["v"], v, layer, offsets),
                    }
                    k, v = (
                        jax.lax.dynamic_index_in_dim(cache_layer[name], layer, keepdims=False)
                        for name in ("k", "v")
                    )
                # [1, S] with one offset for every row, [B, S] with one per row
                query_slots = offsets.reshape(-1, 1) + query_slots
                attended = key_valid.shape[1]
                if fused:
                    # A kernel reads whole buffers: a slice of the cache would be copied
                    # first, so it attends over all of it, the unattended slots masked.
                    key_valid = jnp.pad(key_valid, ((0, 0), (0, k.shape[1] - attended)))
                else:
                    k, v = k[:, :attended], v[:, :attended]
            key_slots = jnp.arange(k.shape[1])
            causal = key_slots[None, None, :] <= query_slots[:, :, None]  # [1 or B, S, S_kv]
            visible = causal & key_valid[:, None, :]
            if pallas_step:
                settings = cfg.decode_kernel_settings
                out = decode_attention(q[:, 0], k, v, visible[:, 0], settings=settings)[:, None]
            elif fused:  # with a cache: the cache-free pass took the branch above
                out = fused_cached_attention(q, k, v, visible, cfg)
            else:
                out = einsum_attention(q, k, v, visible, cfg)
        out = output_projection(
            out,
            self.wo[...].astype(cfg.compute_dtype),
            cfg,
            decode_step=decode_step,
            # whole heads, in parts that are whole blocks of the kernel's least tile
            split=math.gcd(cfg.num_heads, cfg.num_heads * cfg.resolved_head_dim // MIN_MLP_BLOCK),
            in_dims=2,
            residual=residual,
        )
        return _add_bias(out, self.bo if cfg.attn_out_bias else None), cache_layer


def einsum_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, cfg: ModelConfig
) -> jax.Array:
    """Grouped-query attention written out: q [B, S, H, hd]; k, v [B, S_kv, KV, hd]; mask
    [B, S, S_kv] bool (True: the query may see the key). Scores and softmax in float32.
    A query that sees no key (a padding slot) averages every value. Returns [B, S, H, hd]."""
    batch, seq_len = q.shape[:2]
    groups = cfg.num_heads // cfg.num_kv_heads
    q = q.reshape(batch, seq_len, cfg.num_kv_heads, groups, cfg.resolved_head_dim)
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k.astype(q.dtype)).astype(jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(cfg.resolved_head_dim))
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(cfg.compute_dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", weights, v.astype(cfg.compute_dtype))
    return out.reshape(batch, seq_len, cfg.num_heads, cfg.resolved_head_dim)


def fused_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, key_valid: jax.Array, cfg: ModelConfig
) -> jax.Array:
    """Causal attention of a cache-free pass (queries in slots 0..S-1) through
    `jax.nn.dot_product_attention` (or `splash_attention` for `cfg.attention="splash"`):
    q [B, S, H, hd]; k, v [B, S, KV, hd]; key_valid [B, S]
    bool, broadcast to a [B, 1, S, S] mask (cuDNN takes a mask as a bias, which must span
    both sequence axes; left padding is not a sequence length it could take instead).
    Returns [B, S, H, hd] in the compute dtype, zero at padding slots: a query that sees no
    key is left to the kernel (a flash kernel may give NaN there), and a NaN value at a
    padding slot would reach every query through its zero attention weight. S is padded
    to a multiple of `FUSED_SEQ_MULTIPLE` for the kernel."""
    batch, seq_len = key_valid.shape
    pad = -seq_len % FUSED_SEQ_MULTIPLE[cfg.attention]
    if pad:  # trailing slots no query sees (causal, and masked); their outputs dropped
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        key_valid = jnp.pad(key_valid, ((0, 0), (0, pad)))
    if cfg.attention == "splash":
        dt = cfg.compute_dtype
        out = splash_attention.causal_attention(q.astype(dt), k.astype(dt), v.astype(dt), key_valid)
        return jnp.where(key_valid[:, :, None, None], out, jnp.zeros((), dt))[:, :seq_len]
    padded_len = seq_len + pad
    mask = jnp.broadcast_to(key_valid[:, None, None, :], (batch, 1, padded_len, padded_len))
    return _fused_kernel(q, k, v, mask, key_valid, cfg, is_causal=True)[:, :seq_len]


def fused_cached_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, cfg: ModelConfig
) -> jax.Array:
    """Attention of a pass with a KV cache (prefill, a decode step) through
    `jax.nn.dot_product_attention`: q [B, S, H, hd]; k, v [B, S_kv, KV, hd] (the cache's
    attended slots); visible [B, S, S_kv] bool (causal by slot and not padding), passed as
    a [B, 1, S, S_kv] mask, which cuDNN takes as a bias. A decode step's query row is one
    slot, so the kernel reads the cache once instead of writing and re-reading the scores.
    Returns [B, S, H, hd] in the compute dtype, zero at a query that sees no key (a padded
    prompt slot: its keys and values are written to the cache, its output is not used)."""
    return _fused_kernel(q, k, v, visible[:, None], visible.any(axis=-1), cfg, is_causal=False)


def _fused_kernel(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    query_kept: jax.Array,
    cfg: ModelConfig,
    *,
    is_causal: bool,
) -> jax.Array:
    """`jax.nn.dot_product_attention` with `cfg.attention`'s implementation, in the compute
    dtype, under `mask` [B, 1, S, S_kv]; zero at queries where `query_kept` [B, S] is
    False."""
    dt = cfg.compute_dtype
    out = jax.nn.dot_product_attention(
        q.astype(dt),
        k.astype(dt),
        v.astype(dt),
        mask=mask,
        is_causal=is_causal,
        implementation=FUSED_ATTENTION_IMPLEMENTATIONS[cfg.attention],
    )
    return jnp.where(query_kept[:, :, None, None], out, jnp.zeros((), dt))


def write_cache(cache: jax.Array, new: jax.Array, offsets: jax.Array) -> jax.Array:
    """`new` [B, S, KV, hd] written into `cache` [B, S_kv, KV, hd] from slot `offsets`
    (a scalar, or [B]: one per row)."""
    new = new.astype(cache.dtype)
    if offsets.ndim == 0:
        return jax.lax.dynamic_update_slice(cache, new, (0, offsets, 0, 0))

    def one_row(row: jax.Array, update: jax.Array, start: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice(row, update, (start, 0, 0))

    return jax.vmap(one_row)(cache, new, offsets)


def write_layer_cache(
    cache: jax.Array, new: jax.Array, layer: jax.Array, offsets: jax.Array
) -> jax.Array:
    """`new` [B, S, KV, hd] written into layer `layer` of a stacked cache [L, B, S_kv, KV,
    hd] from slot `offsets` (a scalar, or [B]: one per row); only those slots are
    written, so inside a jitted loop the cache is updated in place (one offset: a
    dynamic_update_slice; one per row: a scatter). XLA's CPU backend writes into a
    bfloat16 cache by converting all of it to float32 and back, every layer of every step:
    on a CPU, decode a stacked cache in float32."""
    new = new.astype(cache.dtype)
    if offsets.ndim == 0:
        return jax.lax.dynamic_update_slice(cache, new[None], (layer, 0, offsets, 0, 0))
    batch, length = new.shape[:2]
    slots = offsets[:, None] + jnp.arange(length)[None, :]
    return cache.at[layer, jnp.arange(batch)[:, None], slots].set(new)


class MLP(nnx.Module):
    """`cfg.mlp="gated"`: act(x W_gate) * (x W_up) W_down (SwiGLU with silu);
    `"dense"`: act(x W_up) W_down. Biases on every matrix if `cfg.mlp_bias`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        gated = cfg.mlp == "gated"
        if gated:
            self.w_gate = _param(rngs, cfg, (cfg.d_model, cfg.d_ff), ("embed", "mlp"))
        self.w_up = _param(rngs, cfg, (cfg.d_model, cfg.d_ff), ("embed", "mlp"))
        self.w_down = _param(rngs, cfg, (cfg.d_ff, cfg.d_model), ("mlp", "embed"))
        if cfg.mlp_bias:
            if gated:
                self.b_gate = _constant_param(cfg, (cfg.d_ff,), ("mlp",), 0.0)
            self.b_up = _constant_param(cfg, (cfg.d_ff,), ("mlp",), 0.0)
            self.b_down = _constant_param(cfg, (cfg.d_model,), ("embed",), 0.0)

    def _linear(self, x, name):
        dt = self.cfg.compute_dtype
        out = dense(x, getattr(self, f"w_{name}")[...].astype(dt))
        return _add_bias(out, getattr(self, f"b_{name}") if self.cfg.mlp_bias else None)

    def __call__(self, x, decode_step: bool = False, norm=None, residual=None):
        """x [B, S, D] -> [B, S, D]. `decode_step` (one query slot over a KV cache) with
        `cfg.decode_mlp="pallas"` computes the gated hidden layer with
        `models.gated_mlp`'s kernel, and with `cfg.decode_projection="pallas"` the down
        projection with `models.decode_projection`'s. With `norm` (the block's RMSNorm,
        there) x is the block's stream before it, and the MLP kernel applies it; with
        `residual` ([B, S, D]) the output is residual + the MLP's, added by the down
        projection."""
        cfg = self.cfg
        activation = ACTIVATION_FNS[cfg.activation]
        if decode_step and cfg.decode_mlp == "pallas":
            dt = cfg.compute_dtype
            rows = x.reshape(-1, x.shape[-1]).astype(dt)
            weights = (self.w_gate[...].astype(dt), self.w_up[...].astype(dt))
            settings = cfg.decode_mlp_kernel_settings
            folded = None if norm is None else (norm.scale[...], cfg.norm_eps)
            hidden = gated_hidden(rows, *weights, activation, norm=folded, settings=settings)
            hidden = hidden.reshape(*x.shape[:-1], cfg.d_ff)
        elif cfg.mlp == "gated":
            hidden = activation(self._linear(x, "gate")) * self._linear(x, "up")
        else:
            hidden = activation(self._linear(x, "up"))
        down = output_projection(
            hidden,
            self.w_down[...].astype(cfg.compute_dtype),
            cfg,
            decode_step=decode_step,
            split=cfg.d_ff // MIN_MLP_BLOCK,
            residual=residual,
        )
        return _add_bias(down, self.b_down if cfg.mlp_bias else None)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.parallel_residual = cfg.parallel_residual
        self.attn_norm = Norm(cfg)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = Norm(cfg)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, positions, key_valid, cache_layer, cache_offset, layer=None):
        decode_step = cache_layer is not None and x.shape[1] == 1
        # the norms and additions a decode step's kernels take over from XLA
        fused = decode_fusions(self.attn.cfg, decode_step)
        residual = x if fused.residual else None
        attn_out, cache_layer = self.attn(
            x if fused.attn_norm else self.attn_norm(x), positions, key_valid, cache_layer,
            cache_offset, layer, norm=self.attn_norm if fused.attn_norm else None,
            residual=residual,
        )  # fmt: skip
        if self.parallel_residual:  # GPT-NeoX: both branches read the block's input.
            return x + attn_out + self.mlp(self.mlp_norm(x), decode_step), cache_layer
        x = attn_out if fused.residual else x + attn_out
        out = self.mlp(
            x if fused.mlp_norm else self.mlp_norm(x),
            decode_step,
            norm=self.mlp_norm if fused.mlp_norm else None,
            residual=x if fused.residual else None,
        )
        return (out if fused.residual else x + out), cache_layer


class DecodeFusions(NamedTuple):
    """What a decode step's Pallas kernels take over from XLA's in a block (`decode_fusions`)."""

    attn_norm: bool  # the attention-input kernel applies the first norm (`decode_qkv`)
    mlp_norm: bool  # the MLP kernel applies the second norm
    residual: bool  # the output projections add the residual stream


def decode_fusions(cfg: ModelConfig, decode_step: bool) -> DecodeFusions:
    """Which norms and additions a decode step's kernels take over: the first norm with
    `decode_qkv="pallas"` (which the config takes only for an RMSNorm without a bias and
    an unscanned decode); the second with `decode_mlp="pallas"` and an RMSNorm without a
    bias; the residual additions with `decode_projection="pallas"`, no bias after either
    projection and a sequential block (a parallel-residual block, GPT-NeoX's, adds its
    branches itself). The projection kernel adds the residual where it computes the whole
    contraction in one part (`decode_projection.fuses_residual`), XLA with the parts
    otherwise."""
    rms = cfg.norm == "rms" and not cfg.norm_bias
    return DecodeFusions(
        attn_norm=decode_step and cfg.decode_qkv == "pallas",
        mlp_norm=decode_step and cfg.decode_mlp == "pallas" and rms,
        residual=decode_step
        and cfg.decode_projection == "pallas"
        and not (cfg.attn_out_bias or cfg.mlp_bias or cfg.parallel_residual),
    )


def stack_blocks(blocks: list[Block]) -> Block:
    """One Block whose params hold those of `blocks` (exact copies) on a leading
    `layers` axis: each leaf [num_layers, ...], its logical axes led by "layers"."""
    graphdef, _ = nnx.split(blocks[0])
    states = [nnx.split(block)[1] for block in blocks]
    stacked = jax.tree.map(lambda *layers: jnp.stack(layers), *states)
    for _, variable in nnx.to_flat_state(stacked):
        variable.set_metadata(logical_axes=(LAYERS_AXIS, *variable.get_metadata("logical_axes")))
    return nnx.merge(graphdef, stacked)


def layer_of(stacked: Block, index: int) -> Block:
    """Layer `index` of a stacked Block (`stack_blocks`) as a Block of its own (static slices)."""
    graphdef, state = nnx.split(stacked)
    return nnx.merge(graphdef, jax.tree.map(lambda leaf: leaf[index], state))


def remat_policy(fn, remat: str, *, prevent_cse: bool = True):
    """`fn` wrapped in `jax.checkpoint` with the `jax.checkpoint_policies` named `remat`
    ("none": `fn` itself). `prevent_cse=False` inside a scan (JAX's advice)."""
    if remat == "none":
        return fn
    return jax.checkpoint(fn, policy=CHECKPOINT_POLICIES[remat], prevent_cse=prevent_cse)


def cache_free_block(graphdef: nnx.GraphDef, cfg: ModelConfig):
    """`(block state, x, positions, key_valid) -> x`: one block of a cache-free pass (x [B,
    S, D]), rematerialised as `cfg.remat` says."""

    def run(state, x, positions, key_valid):
        x, _ = nnx.merge(graphdef, state)(x, positions, key_valid, None, 0)
        return x

    return remat_policy(run, cfg.remat, prevent_cse=not cfg.scan_layers)


class Decoder(nnx.Module):
    """Decoder-only model. Call it on tokens; it returns float32 vocabulary logits
    (`cfg.head="lm"`) or per-slot scores (`cfg.head="score"`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = _param(rngs, cfg, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))
        if cfg.position_embedding == "learned":
            self.position_embedding = _param(
                rngs, cfg, (cfg.max_seq_len, cfg.d_model), ("vocab", "embed")
            )
        # The layers draw their initial values in the same order in both layouts, so a
        # seed gives the same model either way.
        blocks = [Block(cfg, rngs) for _ in range(cfg.num_layers)]
        self.blocks = stack_blocks(blocks) if cfg.scan_layers else nnx.List(blocks)
        self.final_norm = Norm(cfg)
        if cfg.head == "score":
            self.score = _param(rngs, cfg, (cfg.d_model, cfg.num_labels), ("embed", "labels"))
        elif cfg.has_lm_head:
            self.lm_head = _param(rngs, cfg, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))

    def _embed(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        x = jnp.take(self.embedding[...], tokens, axis=0)
        if self.cfg.position_embedding == "learned":
            x = x + jnp.take(self.position_embedding[...], positions, axis=0)
        return x.astype(self.cfg.compute_dtype)

    def head(self, features: jax.Array, *, out_dtype=jnp.float32) -> jax.Array:
        """The output head on final hidden states [..., d_model]: [..., V] logits (or
        [..., num_labels] scores) in `out_dtype` (computed in the compute dtype; None
        leaves them in it)."""
        out = dense(features, self.head_weight().astype(self.cfg.compute_dtype))
        return out if out_dtype is None else out.astype(out_dtype)

    def head_weight(self) -> jax.Array:
        """The output head's matrix [d_model, V or num_labels], as stored (the tied token
        embedding transposed)."""
        if self.cfg.head == "score":
            return self.score[...]
        if self.cfg.tie_embeddings:
            return self.embedding[...].T
        return self.lm_head[...]

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        key_valid: jax.Array,
        cache: KVCache | None = None,
        cache_offset: jax.Array | int = 0,
        *,
        logits_dtype=jnp.float32,
    ) -> tuple[jax.Array, KVCache | None]:
        """tokens, positions: [B, S] int32; key_valid: [B, S_kv] bool.

        Returns logits [B, S, V] (or scores [B, S, num_labels]) in `logits_dtype` (None:
        the compute dtype, as the head computes them) and the updated cache (None without
        one).
        """
        if cache is None:
            features = self.features(tokens, positions, key_valid)
            return self.head(features, out_dtype=logits_dtype), None
        x, new_cache = self._cached_trunk(tokens, positions, key_valid, cache, cache_offset)
        return self.head(x, out_dtype=logits_dtype), new_cache

    def features(self, tokens: jax.Array, positions: jax.Array, key_valid: jax.Array) -> jax.Array:
        """The cache-free pass up to the head: final-normed hidden states [B, S, d_model]
        (compute dtype). tokens, positions, key_valid: [B, S]. The blocks run in one scan
        with `cfg.scan_layers`, each rematerialised as `cfg.remat` says."""
        x = self._embed(tokens, positions)
        if self.cfg.scan_layers:
            graphdef, stacked = nnx.split(self.blocks)
            block = cache_free_block(graphdef, self.cfg)

            def step(x, layer_state):
                return block(layer_state, x, positions, key_valid), None

            x, _ = jax.lax.scan(step, x, stacked)
        else:
            for layer in self.blocks:
                graphdef, state = nnx.split(layer)
                x = cache_free_block(graphdef, self.cfg)(state, x, positions, key_valid)
        return self.final_norm(x)

    def _layers(self) -> list[Block]:
        """The blocks one by one (static slices of the stacked params with scan_layers)."""
        if self.cfg.scan_layers:
            return [layer_of(self.blocks, index) for index in range(self.cfg.num_layers)]
        return list(self.blocks)

    def _cached_trunk(self, tokens, positions, key_valid, cache, cache_offset):
        """Embedding, blocks and final norm with a KV cache: hidden states [B, S, d_model]
        and the updated cache. The blocks run layer by layer, or in one scan over the
        stacked params and cache with `cfg.scan_decode`."""
        x = self._embed(tokens, positions)
        if self.cfg.scan_decode:
            graphdef, stacked = nnx.split(self.blocks)

            def step(carry, layer_input):
                x, cache = carry
                layer_state, layer = layer_input
                block = nnx.merge(graphdef, layer_state)
                return block(x, positions, key_valid, cache, cache_offset, layer), None

            layers = jnp.arange(self.cfg.num_layers)
            (x, cache), _ = jax.lax.scan(step, (x, cache), (stacked, layers))
            return self.final_norm(x), cache
        new_cache = []
        for layer, layer_cache in zip(self._layers(), cache, strict=True):
            x, layer_cache = layer(x, positions, key_valid, layer_cache, cache_offset)
            new_cache.append(layer_cache)
        return self.final_norm(x), tuple(new_cache)


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None) -> KVCache:
    """Zeroed KV cache: per layer k, v of shape [B, length, KV, head_dim], or with
    `cfg.scan_decode` one {"k", "v"} of [L, B, length, KV, head_dim]."""
    dtype = cfg.compute_dtype if dtype is None else dtype
    shape = (batch, length, cfg.num_kv_heads, cfg.resolved_head_dim)
    if cfg.scan_decode:
        stacked = (cfg.num_layers, *shape)
        return {"k": jnp.zeros(stacked, dtype), "v": jnp.zeros(stacked, dtype)}
    return tuple(
        {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(cfg.num_layers)
    )


def cache_batch_axis(cfg: ModelConfig) -> int:
    """The axis of a KV cache's leaves (`init_cache`) that holds its rows."""
    return 1 if cfg.scan_decode else 0


def positions_from_mask(valid: jax.Array) -> jax.Array:
    """Position of each slot: number of real tokens before it. valid: [B, S]."""
    return jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1, 0)


def last_valid_index(valid: jax.Array) -> jax.Array:
    """Slot of the last real token of each row (left or right padding). valid: [B, S] -> [B]."""
    width = valid.shape[-1]
    return (width - 1 - jnp.argmax(valid[:, ::-1].astype(bool), axis=-1)).astype(jnp.int32)
