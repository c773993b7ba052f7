"""The Llama-family decoder against an independent NumPy forward pass, the KV cache,
padding invariance, parameter counts, logical axes and config validation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tba_jax.models import PRESETS, ModelConfig, abstract_model, init_model, positions_from_mask
from tba_jax.models import preset as make_preset

TOL = 1e-4
PAD_TOKEN = 0

BASE = ModelConfig(
    vocab_size=29,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    d_ff=48,
    max_seq_len=32,
    init_std=0.2,
)

VARIANTS = {
    "gqa": BASE,
    "mha": dataclasses.replace(BASE, num_kv_heads=4),
    "qkv_bias": dataclasses.replace(BASE, qkv_bias=True),
    "tied": dataclasses.replace(BASE, tie_embeddings=True),
    # head_dim != d_model / num_heads (= 8), one kv head for four query heads, and a
    # non-default rotary base.
    "head_dim": dataclasses.replace(BASE, head_dim=12, num_kv_heads=1, rope_theta=500.0),
}


# ----------------------------------------------------------------------------------------
# Independent NumPy reference (float64), written from the math.
# ----------------------------------------------------------------------------------------


def np_rms_norm(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def np_rope(x, positions, theta):
    """x: [B, S, N, D]; positions: [B, S]. rotate_half convention."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    freqs = positions[..., None].astype(np.float64) * inv_freq  # [B, S, D/2]
    emb = np.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, S, 1, D]
    half = head_dim // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(emb) + rotated * np.sin(emb)


def np_silu(x):
    return x / (1.0 + np.exp(-x))


def np_attention(cfg, p, h, positions, key_valid):
    """h: [B, S, D] (already normed)."""
    batch, seq, _ = h.shape
    hd = cfg.resolved_head_dim
    q = np.einsum("bsd,dnh->bsnh", h, p["wq"])
    k = np.einsum("bsd,dnh->bsnh", h, p["wk"])
    v = np.einsum("bsd,dnh->bsnh", h, p["wv"])
    if cfg.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    q = np_rope(q, positions, cfg.rope_theta)
    k = np_rope(k, positions, cfg.rope_theta)
    group = cfg.num_heads // cfg.num_kv_heads
    causal = np.tril(np.ones((seq, seq), bool))
    allowed = causal[None] & key_valid[:, None, :]  # [B, Sq, Sk]
    out = np.zeros((batch, seq, cfg.num_heads, hd))
    for head in range(cfg.num_heads):
        kv_head = head // group  # kv head j serves query heads j*group .. (j+1)*group-1
        scores = np.einsum("bsd,btd->bst", q[:, :, head], k[:, :, kv_head]) / np.sqrt(hd)
        scores = np.where(allowed, scores, -np.inf)
        row_max = np.max(np.where(allowed, scores, -1e300), axis=-1, keepdims=True)
        weights = np.where(allowed, np.exp(scores - row_max), 0.0)
        total = weights.sum(-1, keepdims=True)
        # Queries with no visible key (padding slots) get zero weights, not NaN.
        weights = np.divide(weights, total, out=np.zeros_like(weights), where=total > 0)
        out[:, :, head] = np.einsum("bst,btd->bsd", weights, v[:, :, kv_head])
    return np.einsum("bsnh,nhd->bsd", out, p["wo"])


def np_forward(cfg, params, tokens, positions, key_valid):
    """Logits [B, S, V] float64."""
    params = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = params["embedding"][np.asarray(tokens)]
    for i in range(cfg.num_layers):
        blk = params["blocks"][i]
        h = np_rms_norm(x, blk["attn_norm"]["scale"], cfg.norm_eps)
        x = x + np_attention(cfg, blk["attn"], h, np.asarray(positions), np.asarray(key_valid))
        h = np_rms_norm(x, blk["mlp_norm"]["scale"], cfg.norm_eps)
        mlp = blk["mlp"]
        x = x + (np_silu(h @ mlp["w_gate"]) * (h @ mlp["w_up"])) @ mlp["w_down"]
    x = np_rms_norm(x, params["final_norm"]["scale"], cfg.norm_eps)
    head = params["embedding"].T if cfg.tie_embeddings else params["lm_head"]
    return x @ head


def np_positions(valid):
    """Count of real tokens strictly before each slot."""
    valid = np.asarray(valid, np.int64)
    return np.cumsum(valid, axis=-1) - valid


# ----------------------------------------------------------------------------------------
# Helpers.
# ----------------------------------------------------------------------------------------


def random_params(cfg, seed, std=0.2):
    """Params of the right layout (from `abstract_model`) with random values everywhere:
    weights N(0, std), norm scales U(0.5, 1.5), qkv biases N(0, 0.5)."""
    model, abstract = abstract_model(cfg)
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        name = path[-1].key
        if name == "scale":
            value = rng.uniform(0.5, 1.5, leaf.shape)
        elif name in ("bq", "bk", "bv"):
            value = rng.normal(0.0, 0.5, leaf.shape)
        else:
            value = rng.normal(0.0, std, leaf.shape)
        return jnp.asarray(value, jnp.float32)

    return model, jax.tree_util.tree_map_with_path(fill, abstract)


_SETUPS = {}


def setup_for(variant):
    """(cfg, model, params, jitted apply) per variant, built once per module."""
    if variant not in _SETUPS:
        cfg = VARIANTS[variant]
        model, params = random_params(cfg, seed=len(_SETUPS) + 1)
        _SETUPS[variant] = (cfg, model, params, jax.jit(model.apply))
    return _SETUPS[variant]


def left_padded(rng, cfg, lengths, width):
    """Random real tokens right-aligned in `width` slots; padding slots hold PAD_TOKEN."""
    tokens = rng.integers(1, cfg.vocab_size, size=(len(lengths), width)).astype(np.int32)
    valid = np.arange(width)[None, :] >= width - np.asarray(lengths)[:, None]
    return np.where(valid, tokens, PAD_TOKEN).astype(np.int32), valid


def assert_close_on_valid(actual, expected, valid, tol=TOL):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert valid.any()
    np.testing.assert_allclose(actual[valid], expected[valid], rtol=tol, atol=tol)


# ----------------------------------------------------------------------------------------
# 1. Forward pass against the NumPy reference.
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_forward_matches_numpy_reference(variant):
    cfg, _, params, apply = setup_for(variant)
    assert ("lm_head" in params) == (not cfg.tie_embeddings)
    assert ("bq" in params["blocks"][0]["attn"]) == cfg.qkv_bias

    tokens, valid = left_padded(np.random.default_rng(5), cfg, lengths=[9, 6, 2, 4], width=9)
    positions = positions_from_mask(jnp.asarray(valid))
    np.testing.assert_array_equal(np.asarray(positions)[valid], np_positions(valid)[valid])

    logits, cache = apply(params, tokens, positions, valid)
    assert cache is None
    assert logits.shape == (4, 9, cfg.vocab_size)
    assert logits.dtype == jnp.float32

    expected = np_forward(cfg, params, tokens, np_positions(valid), valid)
    # The reference is not trivially flat: logits vary by far more than the tolerance.
    assert expected[valid].std() > 0.5
    assert_close_on_valid(logits, expected, valid)

    # The harness has teeth: a reference without the rotary embedding, or without the
    # key padding mask, would disagree.
    no_rope = np_forward(cfg, params, tokens, np.zeros_like(np_positions(valid)), valid)
    no_pad_mask = np_forward(cfg, params, tokens, np_positions(valid), np.ones_like(valid))
    for wrong in (no_rope, no_pad_mask):
        assert np.abs(np.asarray(logits)[valid] - wrong[valid]).max() > 100 * TOL


def test_init_model_layout_and_forward():
    """`init_model`'s params have the abstract layout, unit norm scales, zero biases,
    weights of std init_std, and run through the same forward pass."""
    cfg = dataclasses.replace(VARIANTS["qkv_bias"], init_std=0.3)
    model, params = init_model(cfg, seed=0)
    _, abstract = abstract_model(cfg)
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype), params)
    assert shapes == jax.tree.map(lambda a: (a.shape, a.dtype), abstract)
    blk = params["blocks"][1]
    np.testing.assert_array_equal(blk["attn_norm"]["scale"], np.ones(cfg.d_model))
    np.testing.assert_array_equal(blk["attn"]["bk"], np.zeros_like(blk["attn"]["bk"]))
    assert abs(float(np.std(params["lm_head"])) - 0.3) < 0.03
    assert not np.allclose(blk["mlp"]["w_gate"], params["blocks"][0]["mlp"]["w_gate"])

    tokens, valid = left_padded(np.random.default_rng(6), cfg, lengths=[5, 3], width=5)
    logits, _ = jax.jit(model.apply)(params, tokens, positions_from_mask(valid), valid)
    expected = np_forward(cfg, params, tokens, np_positions(valid), valid)
    assert_close_on_valid(logits, expected, valid)


# ----------------------------------------------------------------------------------------
# 2. KV-cache decoding equals the full-sequence forward.
# ----------------------------------------------------------------------------------------

P, T = 6, 5


@pytest.fixture(scope="module")
def cached_setup():
    cfg, model, params, apply = setup_for("qkv_bias")
    rng = np.random.default_rng(13)
    prompt, prompt_mask = left_padded(rng, cfg, lengths=[6, 3, 1], width=P)
    response = rng.integers(1, cfg.vocab_size, size=(3, T)).astype(np.int32)
    tokens = np.concatenate([prompt, response], axis=1)
    key_valid = np.concatenate([prompt_mask, np.ones((3, T), bool)], axis=1)
    positions = np.asarray(positions_from_mask(jnp.asarray(key_valid)))
    full_logits, _ = apply(params, tokens, positions, key_valid)
    # The full forward itself is right (so agreement below is with the truth).
    expected = np_forward(cfg, params, tokens, np_positions(key_valid), key_valid)
    assert_close_on_valid(full_logits, expected, key_valid)
    return dict(
        model=model,
        params=params,
        apply=apply,
        tokens=tokens,
        key_valid=key_valid,
        positions=positions,
        full_logits=np.asarray(full_logits),
    )


def decode_slots(s, cache, slots):
    """Feeds `slots` one at a time through the cached forward; returns [B, len, V]."""
    out = []
    for slot in slots:
        logits, cache = s["apply"](
            s["params"],
            s["tokens"][:, slot : slot + 1],
            s["positions"][:, slot : slot + 1],
            s["key_valid"],
            cache,
            jnp.int32(slot),
        )
        assert logits.shape == (s["tokens"].shape[0], 1, s["model"].config.vocab_size)
        out.append(np.asarray(logits[:, 0]))
    return np.stack(out, axis=1), cache


def test_token_by_token_decoding_matches_full_forward(cached_setup):
    s = cached_setup
    batch, length = s["tokens"].shape
    cache = s["model"].init_cache(batch, length)
    cfg = s["model"].config
    assert len(cache) == cfg.num_layers
    assert cache[0]["k"].shape == (batch, length, cfg.num_kv_heads, cfg.resolved_head_dim)
    step_logits, _ = decode_slots(s, cache, range(length))
    assert_close_on_valid(step_logits, s["full_logits"], s["key_valid"])


def test_prefill_then_decode_matches_full_forward(cached_setup):
    s = cached_setup
    batch, length = s["tokens"].shape
    valid = s["key_valid"]
    cache = s["model"].init_cache(batch, length)
    prefill_logits, cache = s["apply"](
        s["params"], s["tokens"][:, :P], s["positions"][:, :P], valid, cache, jnp.int32(0)
    )
    assert_close_on_valid(prefill_logits, s["full_logits"][:, :P], valid[:, :P])
    step_logits, _ = decode_slots(s, cache, range(P, length))
    # Every response slot is real: compare all of them.
    np.testing.assert_allclose(step_logits, s["full_logits"][:, P:], rtol=TOL, atol=TOL)


# ----------------------------------------------------------------------------------------
# 3. Padding invariance.
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["gqa", "head_dim"])
def test_logits_do_not_depend_on_left_padding(variant):
    cfg, _, params, apply = setup_for(variant)
    rng = np.random.default_rng(23)
    prompt_len, width, pads = 5, 9, (0, 1, 3, 4)
    prompt = rng.integers(1, cfg.vocab_size, size=prompt_len)
    # Row r: `pads[r]` padding slots holding arbitrary token ids (they must be invisible),
    # the prompt, then arbitrary real tokens (causality hides them from the prompt).
    tokens = rng.integers(0, cfg.vocab_size, size=(len(pads), width)).astype(np.int32)
    valid = np.ones((len(pads), width), bool)
    for row, pad in enumerate(pads):
        tokens[row, pad : pad + prompt_len] = prompt
        valid[row, :pad] = False
    logits, _ = apply(params, tokens, positions_from_mask(jnp.asarray(valid)), valid)
    logits = np.asarray(logits)
    # Reference: the prompt alone, unpadded, in a batch of its own shape.
    alone = np.asarray(prompt, np.int32)[None]
    alone_valid = np.ones_like(alone, bool)
    reference, _ = apply(params, alone, positions_from_mask(alone_valid), alone_valid)
    reference = np.asarray(reference)[0]
    expected = np_forward(cfg, params, alone, np.arange(prompt_len)[None], alone_valid)[0]
    np.testing.assert_allclose(reference, expected, rtol=TOL, atol=TOL)
    for row, pad in enumerate(pads):
        np.testing.assert_allclose(
            logits[row, pad : pad + prompt_len], reference, rtol=TOL, atol=TOL
        )


# ----------------------------------------------------------------------------------------
# 4. Parameter counts and logical axes.
# ----------------------------------------------------------------------------------------

AXIS_NAMES = {"embed", "mlp", "heads", "kv_heads", "head_dim", "vocab", "norm"}


def preset_config(name, **overrides):
    vocab = None if "vocab_size" in PRESETS[name] else 97
    return make_preset(name, vocab_size=vocab, **overrides)


def check_counts_and_axes(cfg):
    model, abstract = abstract_model(cfg)
    leaves = jax.tree.leaves(abstract)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
    assert all(leaf.dtype == cfg.storage_dtype for leaf in leaves)
    assert cfg.num_params() == sum(int(np.prod(leaf.shape)) for leaf in leaves)

    params_flat = dict(jax.tree_util.tree_flatten_with_path(abstract)[0])
    axes_flat = dict(
        jax.tree_util.tree_flatten_with_path(
            model.logical_axes, is_leaf=lambda x: isinstance(x, tuple)
        )[0]
    )
    assert params_flat.keys() == axes_flat.keys()
    for path, leaf in params_flat.items():
        axes = axes_flat[path]
        assert isinstance(axes, tuple), path
        assert len(axes) == leaf.ndim, (path, axes, leaf.shape)
        assert set(axes) <= AXIS_NAMES, (path, axes)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_num_params_matches_abstract_model_for_presets(name):
    check_counts_and_axes(preset_config(name))


@pytest.mark.parametrize(
    "overrides",
    [
        dict(qkv_bias=True),
        dict(tie_embeddings=True),
        dict(head_dim=24, num_heads=4, num_kv_heads=2),
        dict(qkv_bias=True, tie_embeddings=True, num_kv_heads=4, param_dtype="bfloat16"),
    ],
)
def test_num_params_matches_abstract_model_for_variants(overrides):
    check_counts_and_axes(preset_config("tiny", **overrides))


def test_num_params_known_value():
    # micro, vocab 10: embed 320 + head 320 + final norm 32 + one block:
    # attn 32*16*(2*2 + 2*1) = 3072, mlp 3*32*64 = 6144, norms 64.
    assert make_preset("micro", vocab_size=10).num_params() == 320 + 320 + 32 + 3072 + 6144 + 64


# ----------------------------------------------------------------------------------------
# 5. Config validation.
# ----------------------------------------------------------------------------------------


def test_heads_must_be_multiple_of_kv_heads():
    with pytest.raises(ValueError, match="multiple"):
        dataclasses.replace(BASE, num_heads=4, num_kv_heads=3)


@pytest.mark.parametrize("field", ["dtype", "param_dtype"])
def test_unknown_dtype_rejected(field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(BASE, **{field: "float8"})


def test_unknown_preset_rejected():
    with pytest.raises(ValueError, match="Unknown model preset"):
        make_preset("llama-7t", vocab_size=10)


def test_other_config_errors():
    with pytest.raises(ValueError, match="family"):
        dataclasses.replace(BASE, family="mamba")
    with pytest.raises(ValueError, match="head_dim"):
        dataclasses.replace(BASE, d_model=30, num_heads=4)
    # An explicit head_dim lifts the divisibility requirement.
    assert dataclasses.replace(BASE, d_model=30, num_heads=4, head_dim=8).resolved_head_dim == 8
