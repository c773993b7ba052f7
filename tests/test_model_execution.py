"""`ModelConfig`'s execution knobs compute the same model: scanned layers (and the exact
conversion between the params layouts), rematerialisation, the fused attention kernel and
time-chunked log-probs give the outputs and gradients of the plain decoder, decode works
on scanned params, a decode loop's weights cast once to the compute dtype give the same
outputs, and the knobs stay out of a run's checkpoint identity.

Tiny shapes (2 layers of width 16) and one compile per case: CI has two CPU cores.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from configs.arithmetic import get_config
from tba_jax import config_lib
from tba_jax import mesh as mesh_lib
from tba_jax.models import (
    ModelConfig,
    abstract_model,
    decode_projection,
    init_model,
    params_in_compute_dtype,
    positions_from_mask,
    preset,
    stack_layers,
    transformer,
    unstack_layers,
)
from tba_jax.models.config import (
    ATTENTIONS,
    EXECUTION_FIELDS,
    KernelSettings,
    MlpKernelSettings,
    ProjectionKernelSettings,
    QkvKernelSettings,
)
from tba_jax.sampling import engine, scoring
from tba_jax.sampling.generate import SamplingConfig, make_generate_fn

TOL = 1e-5
GRAD_TOL = 1e-4
TEMPERATURE = 0.7
SEED = 0
PLAIN = ModelConfig(
    vocab_size=29,
    d_model=16,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    d_ff=24,
    max_seq_len=32,
    qkv_bias=True,
    init_std=0.3,
)
SCANNED = dataclasses.replace(PLAIN, scan_layers=True)
PROMPT_LEN, RESPONSE_LEN = 5, 7


def execution(**fields) -> ModelConfig:
    return dataclasses.replace(PLAIN, **fields)


def scoring_batch() -> tuple[jax.Array, ...]:
    """prompt_tokens, prompt_mask [3, 5] (left-padded), response_tokens, response_mask
    [3, 7] (right-padded, one row cut short)."""
    rng = np.random.default_rng(SEED)
    prompt = rng.integers(1, PLAIN.vocab_size, (3, PROMPT_LEN))
    prompt_mask = np.ones((3, PROMPT_LEN), np.float32)
    prompt_mask[0, :2] = prompt_mask[2, :4] = 0
    response = rng.integers(1, PLAIN.vocab_size, (3, RESPONSE_LEN))
    response_mask = np.ones((3, RESPONSE_LEN), np.float32)
    response_mask[1, 4:] = 0
    prompt = np.where(prompt_mask > 0, prompt, 0).astype(np.int32)
    return tuple(jnp.asarray(x) for x in (prompt, prompt_mask, response, response_mask))


def logprobs_and_grads(cfg: ModelConfig, params):
    """Per-token log-probs [3, 7] and the gradient of their sum under `cfg`."""
    model, _ = abstract_model(cfg)
    batch = scoring_batch()

    def total(params):
        logp = scoring.token_logprobs(model, params, *batch, temperature=TEMPERATURE)
        return logp.sum(), logp

    (_, logp), grads = jax.jit(jax.value_and_grad(total, has_aux=True))(params)
    return np.asarray(logp), grads


def assert_trees_close(actual, expected, atol):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=atol)


@pytest.fixture(scope="module")
def plain():
    """Log-probs, gradients and params of the plain decoder (the reference)."""
    _, params = init_model(PLAIN, SEED)
    logp, grads = logprobs_and_grads(PLAIN, params)
    return logp, grads, params


def test_layout_conversion_is_exact_both_ways():
    model, params = init_model(PLAIN, SEED)
    scanned_model, scanned = init_model(SCANNED, SEED)  # a seed gives one model either way
    assert jax.tree.structure(stack_layers(params)) == jax.tree.structure(scanned)
    for a, b in zip(jax.tree.leaves(stack_layers(params)), jax.tree.leaves(scanned), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(unstack_layers(scanned)), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    assert scanned["blocks"]["attn"]["wq"].shape == (2, 16, 4, 4)
    assert scanned_model.logical_axes["blocks"]["attn"]["wq"] == (
        "layers",
        *model.logical_axes["blocks"][0]["attn"]["wq"],
    )
    assert scanned_model.logical_axes["embedding"] == model.logical_axes["embedding"]


def test_the_layers_axis_is_not_sharded_by_default():
    model, params = init_model(SCANNED, SEED)
    mesh = mesh_lib.make_mesh(jax.devices()[:1], {"fsdp": -1})
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    shardings = mesh_lib.param_shardings(
        model.logical_axes, abstract, mesh, get_config().mesh.learner_rules
    )
    assert shardings["blocks"]["mlp"]["w_up"].spec == PartitionSpec(None, "fsdp", "tensor")


@pytest.mark.parametrize("remat", ["none", "nothing_saveable"])
def test_scanned_layers_give_the_plain_outputs_and_gradients(plain, remat):
    logp, grads, params = plain
    scanned_logp, scanned_grads = logprobs_and_grads(
        execution(scan_layers=True, remat=remat), stack_layers(params)
    )
    np.testing.assert_allclose(scanned_logp, logp, atol=TOL)
    assert_trees_close(unstack_layers(scanned_grads), grads, GRAD_TOL)


@pytest.mark.parametrize("remat", ["dots_with_no_batch_dims_saveable"])
def test_remat_keeps_the_values_and_gradients(plain, remat):
    logp, grads, params = plain
    remat_logp, remat_grads = logprobs_and_grads(execution(remat=remat), params)
    np.testing.assert_allclose(remat_logp, logp, atol=TOL)
    assert_trees_close(remat_grads, grads, GRAD_TOL)


def test_fused_attention_matches_the_einsum_one_with_padding(plain):
    """jax.nn.dot_product_attention (XLA's kernel on CPU) under the causal-and-padding mask:
    the batch has left-padded prompts and a right-padded response."""
    logp, grads, params = plain
    fused_logp, fused_grads = logprobs_and_grads(execution(attention="dot_product"), params)
    np.testing.assert_allclose(fused_logp, logp, atol=TOL)
    assert_trees_close(fused_grads, grads, GRAD_TOL)


def test_splash_attention_matches_the_einsum_one_and_decodes_through_dot_product(plain):
    """`attention=splash` (Pallas' TPU kernel, its interpreter here): the cache-free pass's
    12 slots padded to the kernel's 128, grouped query heads as multi-query attention, the
    padding as segment ids: log-probs and gradients are the einsum model's; passes with a
    KV cache go through jax.nn.dot_product_attention and decode the einsum model's tokens."""
    logp, grads, params = plain
    splash_logp, splash_grads = logprobs_and_grads(execution(attention="splash"), params)
    np.testing.assert_allclose(splash_logp, logp, atol=TOL)
    assert_trees_close(splash_grads, grads, GRAD_TOL)
    prompt = jnp.asarray([[0, 0, 3, 4], [5, 6, 7, 8]], jnp.int32)
    sampling = SamplingConfig(max_new_tokens=4, greedy=True)
    einsum, splash = (
        make_generate_fn(abstract_model(cfg)[0], sampling, eos_id=1, pad_id=0)(
            params, prompt, prompt > 0, jax.random.key(SEED)
        )
        for cfg in (PLAIN, execution(attention="splash"))
    )
    np.testing.assert_array_equal(np.asarray(splash.tokens), np.asarray(einsum.tokens))


def test_fused_attention_padded_to_the_kernels_length_multiple_gives_the_same(plain, monkeypatch):
    """The cache-free pass pads its 12 slots to the kernel's length multiple (cuDNN: even
    lengths; forced to 8 here, so 4 padded slots) and drops their outputs: log-probs and
    gradients are the einsum model's."""
    monkeypatch.setitem(transformer.FUSED_SEQ_MULTIPLE, "dot_product", 8)
    logp, grads, params = plain
    fused_logp, fused_grads = logprobs_and_grads(execution(attention="dot_product"), params)
    np.testing.assert_allclose(fused_logp, logp, atol=TOL)
    assert_trees_close(fused_grads, grads, GRAD_TOL)


def test_fused_attention_in_passes_with_a_cache_decodes_as_the_einsum_one(plain):
    """With `attention=dot_product` prefill and decode steps (one offset for every row, or
    one per row as the slot engine writes) attend through jax.nn.dot_product_attention:
    greedy tokens equal the einsum model's, log-probs to float rounding, across a
    left-padded prompt whose padding slots see no key, with decode segments too."""
    *_, params = plain
    models = {name: abstract_model(execution(attention=name))[0] for name in ATTENTIONS[:2]}
    prompt = jnp.asarray([[0, 0, 3, 4], [5, 6, 7, 8]], jnp.int32)
    sampling = SamplingConfig(max_new_tokens=4, greedy=True)
    generated = {
        name: make_generate_fn(model, sampling, eos_id=1, pad_id=0)(
            params, prompt, prompt > 0, jax.random.key(SEED)
        )
        for name, model in models.items()
    }
    segmented = dataclasses.replace(sampling, decode_segments=2)  # a masked, unread tail
    generated["segments"] = make_generate_fn(models["dot_product"], segmented, eos_id=1, pad_id=0)(
        params, prompt, prompt > 0, jax.random.key(SEED)
    )
    einsum, fused = generated["einsum"], generated["dot_product"]
    np.testing.assert_array_equal(np.asarray(fused.tokens), np.asarray(einsum.tokens))
    np.testing.assert_array_equal(
        np.asarray(generated["segments"].tokens), np.asarray(einsum.tokens)
    )
    np.testing.assert_allclose(
        np.asarray(fused.token_logp), np.asarray(einsum.token_logp), atol=TOL
    )
    tokens = jnp.concatenate([prompt, einsum.tokens], axis=1)
    valid = jnp.concatenate([prompt > 0, einsum.mask > 0], axis=1)
    positions = positions_from_mask(valid)
    logits = {}
    for name, offsets in (("einsum", 0), ("dot_product", 0), ("per_row", jnp.zeros(2, jnp.int32))):
        model = models["einsum" if name == "einsum" else "dot_product"]
        cache = model.init_cache(*tokens.shape)
        logits[name], _ = jax.jit(model.apply)(params, tokens, positions, valid, cache, offsets)
    valid = np.asarray(valid)
    for name in ("dot_product", "per_row"):
        np.testing.assert_allclose(
            np.asarray(logits[name])[valid], np.asarray(logits["einsum"])[valid], atol=TOL
        )


def test_the_pallas_decode_step_runs_with_the_configs_kernel_settings(plain, monkeypatch):
    """`model.decode_kernel` reaches the kernel: each decode step's call gets its settings
    (the default ones without it)."""
    *_, params = plain
    seen = []

    def recording(*args, settings):
        seen.append(settings)
        return real(*args, settings=settings)

    real = transformer.decode_attention
    monkeypatch.setattr(transformer, "decode_attention", recording)
    prompt = jnp.asarray([[0, 3, 4], [5, 6, 7]], jnp.int32)
    sampling = SamplingConfig(max_new_tokens=2, greedy=True)
    for spec in ("4:64:2:3", ""):
        seen.clear()
        model = abstract_model(execution(decode_attention="pallas", decode_kernel=spec))[0]
        make_generate_fn(model, sampling, eos_id=1, pad_id=0)(
            params, prompt, prompt > 0, jax.random.key(SEED)
        )
        want = KernelSettings(4, 64, 2, 3) if spec else KernelSettings()
        assert seen and set(seen) == {want}


def assert_decodes_alike(reference, kernel, params):
    """`kernel` (a model with a decode-step kernel) decodes as `reference`: greedy tokens
    equal across a left-padded prompt, log-probs to float rounding, and one step with an
    offset per row (the slot engine's: rows at different lengths, the next token of each
    written at its own offset) gives `reference`'s logits."""
    prompt = jnp.asarray([[0, 0, 3, 4], [5, 6, 7, 8]], jnp.int32)
    sampling = SamplingConfig(max_new_tokens=4, greedy=True)
    generated = [
        make_generate_fn(model, sampling, eos_id=1, pad_id=0)(
            params, prompt, prompt > 0, jax.random.key(SEED)
        )
        for model in (reference, kernel)
    ]
    np.testing.assert_array_equal(np.asarray(generated[1].tokens), np.asarray(generated[0].tokens))
    np.testing.assert_allclose(
        np.asarray(generated[1].token_logp), np.asarray(generated[0].token_logp), atol=TOL
    )
    valid = jnp.asarray([[0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]], bool)
    cache = reference.init_cache(2, 6)
    _, cache = jax.jit(reference.apply)(
        params, prompt, positions_from_mask(valid[:, :4]), valid[:, :4], cache, 0
    )
    offsets = jnp.asarray([3, 4], jnp.int32)
    step_valid = valid.at[jnp.arange(2), offsets].set(True)
    step = (jnp.asarray([[9], [10]], jnp.int32), jnp.asarray([[2], [4]], jnp.int32), step_valid)
    logits = [jax.jit(m.apply)(params, *step, cache, offsets)[0] for m in (reference, kernel)]
    np.testing.assert_allclose(np.asarray(logits[1]), np.asarray(logits[0]), atol=TOL)


def test_pallas_decode_attention_decodes_as_the_einsum_one(plain):
    """With `decode_attention=pallas` every decode step attends through the Pallas kernel
    (its interpreter here), and decodes as the einsum model (`assert_decodes_alike`)."""
    *_, params = plain
    einsum = abstract_model(PLAIN)[0]
    assert_decodes_alike(einsum, abstract_model(execution(decode_attention="pallas"))[0], params)


def test_pallas_decode_mlp_decodes_as_the_xla_one(monkeypatch):
    """With `decode_mlp=pallas` every decode step's gated hidden layer comes from the Pallas
    kernel (its interpreter here), with `decode_mlp_kernel`'s settings and the block's
    RMSNorm folded in (the kernel applies it), and prefill's does not; the model decodes
    as the plain one (`assert_decodes_alike`). (d_ff 32: the kernel tiles widths in blocks
    of 16.)"""
    plain_cfg = execution(d_ff=32)
    _, params = init_model(plain_cfg, SEED)
    pallas_cfg = dataclasses.replace(
        plain_cfg, decode_mlp="pallas", decode_mlp_kernel="16:16:16:2:2"
    )
    row_counts = []

    def recording(x, *args, norm, settings):
        row_counts.append(x.shape[0])
        assert settings == MlpKernelSettings(16, 16, 16, 2, 2)
        assert norm[0].shape == (plain_cfg.d_model,) and norm[1] == plain_cfg.norm_eps
        return real(x, *args, norm=norm, settings=settings)

    real = transformer.gated_hidden
    monkeypatch.setattr(transformer, "gated_hidden", recording)
    assert_decodes_alike(abstract_model(plain_cfg)[0], abstract_model(pallas_cfg)[0], params)
    # the decode loop's and the one step's 2 rows, never a prefill's 2 × 4
    assert row_counts and set(row_counts) == {2}


@pytest.mark.parametrize("biases", [False, True], ids=["qwen2", "with_output_biases"])
def test_pallas_decode_projections_decode_as_the_xla_ones(monkeypatch, biases):
    """With `decode_projection=pallas` every decode step's attention output and MLP down
    projections come from the Pallas kernel (its interpreter here), with
    `decode_projection_kernel`'s settings, the down projection's contraction in 2 parts,
    and prefill's do not; the model decodes as the plain one (`assert_decodes_alike`),
    biases added after the kernel. Without biases the projections take the residual
    stream and return it with their output added (the parts' sums and the residual added
    together after the kernel, at 2 parts); with them XLA adds it after the bias. (d_ff
    32: the kernel tiles widths in blocks of 16.)"""
    plain_cfg = execution(d_ff=32, mlp_bias=biases, attn_out_bias=biases)
    _, params = init_model(plain_cfg, SEED)
    if biases:  # nonzero, so a bias the kernel path dropped would show
        params = jax.tree.map_with_path(
            lambda path, x: x + 0.5 if "b_down" in str(path) or "bo" in str(path) else x, params
        )
    pallas_cfg = dataclasses.replace(
        plain_cfg, decode_projection="pallas", decode_projection_kernel="16:16:16:2:2:2"
    )
    calls = []

    def recording(x, w, *, split, residual, settings):
        calls.append((x.shape, w.shape, split))
        assert settings == ProjectionKernelSettings(16, 16, 16, 2, 2, 2)
        assert (residual is None) == biases
        assert residual is None or residual.shape == (x.shape[0], w.shape[1])
        return real(x, w, split=split, residual=residual, settings=settings)

    real = transformer.project
    monkeypatch.setattr(transformer, "project", recording)
    assert_decodes_alike(abstract_model(plain_cfg)[0], abstract_model(pallas_cfg)[0], params)
    # 2 rows each: the decode loop's and the one step's, never a prefill's 2 × 4; attention's
    # output [2, 4 heads × 4] (a mesh may not split its 16: one block of 16), the MLP's
    # [2, 32] (in whole blocks of 16: 2 parts)
    assert calls and set(calls) == {((2, 16), (16, 16), 1), ((2, 32), (32, 16), 2)}


@pytest.mark.parametrize("biases", [False, True], ids=["llama", "qwen2"])
def test_pallas_decode_qkv_decodes_as_the_xla_one(monkeypatch, biases):
    """With `decode_qkv=pallas` every decode step's attention input (the block's RMSNorm,
    the Q, K and V projections, the rotary embedding and the cache write) comes from the
    Pallas kernel (its interpreter here), with `decode_qkv_kernel`'s settings, and
    prefill's does not; the model decodes as the plain one (`assert_decodes_alike`: a
    left-padded prompt, and a step with an offset per row), biases included. (Heads of
    32: the kernel's least.)"""
    plain_cfg = execution(head_dim=32, qkv_bias=biases)
    _, params = init_model(plain_cfg, SEED)
    if biases:  # nonzero, so a bias the kernel dropped would show
        params = jax.tree.map_with_path(
            lambda path, x: x + 0.5 if any(f"'b{n}'" in str(path) for n in "qkv") else x, params
        )
    pallas_cfg = dataclasses.replace(plain_cfg, decode_qkv="pallas", decode_qkv_kernel="16:16:2:2")
    calls = []

    def recording(x, *args, eps, settings):
        calls.append(x.shape)
        assert settings == QkvKernelSettings(16, 16, 2, 2) and eps == plain_cfg.norm_eps
        return real(x, *args, eps=eps, settings=settings)

    real = transformer.project_qkv
    monkeypatch.setattr(transformer, "project_qkv", recording)
    assert_decodes_alike(abstract_model(plain_cfg)[0], abstract_model(pallas_cfg)[0], params)
    # 2 rows of d_model 16: the decode loop's and the one step's, never a prefill's 2 × 4
    assert calls and set(calls) == {(2, 16)}


def test_all_four_decode_kernels_with_one_part_projections_decode_as_xla(monkeypatch):
    """With every decode kernel and the projections in one part, a layer's decode step is
    five kernels: the attention input (norm, Q/K/V, rotary, cache write), attention, W_o
    adding the residual, the gated MLP applying the second norm, and W_down adding the
    residual; the model decodes as the plain one (`assert_decodes_alike`)."""
    plain_cfg = execution(head_dim=32, d_ff=32)
    _, params = init_model(plain_cfg, SEED)
    pallas_cfg = dataclasses.replace(
        plain_cfg,
        decode_attention="pallas",
        decode_mlp="pallas",
        decode_mlp_kernel="16:16:16:2:2",
        decode_projection="pallas",
        decode_projection_kernel="16:16:16:1:2:2",
        decode_qkv="pallas",
        decode_qkv_kernel="16:16:2:2",
    )
    fused = []
    real = decode_projection._with_residual

    def recording(x, w, residual, **kwargs):
        fused.append((x.shape, w.shape))
        return real(x, w, residual, **kwargs)

    monkeypatch.setattr(decode_projection, "_with_residual", recording)
    assert_decodes_alike(abstract_model(plain_cfg)[0], abstract_model(pallas_cfg)[0], params)
    # both projections of 2 rows added their residual in the kernel: W_o [4 heads × 32, 16]
    # and W_down [32, 16]
    assert set(fused) == {((2, 128), (128, 16)), ((2, 32), (32, 16))}


@pytest.mark.parametrize("chunk", [3])  # three chunks, the last one padded
def test_chunked_logprobs_and_their_gradient_match(plain, chunk):
    logp, grads, params = plain
    chunked_logp, chunked_grads = logprobs_and_grads(execution(logprob_chunk=chunk), params)
    np.testing.assert_allclose(chunked_logp, logp, atol=TOL)
    assert_trees_close(chunked_grads, grads, GRAD_TOL)
    assert (chunked_logp[np.asarray(scoring_batch()[3]) == 0] == 0).all()


def test_the_features_path_matches_the_full_logits(plain):
    """The head on the response slots only gives the log-probs of the full forward pass."""
    logp, _, params = plain
    model, _ = abstract_model(PLAIN)
    prompt, prompt_mask, response, response_mask = scoring_batch()
    tokens, positions, valid = scoring.joined_inputs(prompt, prompt_mask, response, response_mask)
    logits, _ = jax.jit(model.apply)(params, tokens, positions, valid)
    predicting = scoring.response_slots(logits, PROMPT_LEN, RESPONSE_LEN)
    logp_all = jax.nn.log_softmax(predicting / TEMPERATURE, axis=-1)
    expected = np.take_along_axis(np.asarray(logp_all), np.asarray(response)[..., None], -1)
    expected = expected[..., 0] * np.asarray(response_mask)
    np.testing.assert_allclose(logp, expected, atol=TOL)


@pytest.mark.parametrize("scan_decode", [False, True], ids=["unstacked_once", "scanned"])
def test_decode_on_scanned_params_matches(plain, scan_decode):
    """generate() on scanned params samples greedily what the plain model's full forward
    pass predicts, whether it unstacks them once (`Model.for_decoding`) or scans the
    stacked blocks over a stacked cache (`scan_decode`); a cached pass straight on the
    stacked params (static slices, or the scan) gives that pass's logits too."""
    *_, params = plain
    scanned_model, _ = abstract_model(dataclasses.replace(SCANNED, scan_decode=scan_decode))
    scanned = stack_layers(params)
    decoding_model, decoding = scanned_model.for_decoding(scanned)
    if scan_decode:  # the stacked weights themselves, no per-layer copy
        assert decoding_model is scanned_model and decoding is scanned
        assert scanned_model.init_cache(2, 3)["k"].shape == (PLAIN.num_layers, 2, 3, 2, 4)
    else:
        assert decoding_model.config == PLAIN
        assert_trees_close(decoding, params, atol=0)
    per_layer_model, _ = abstract_model(PLAIN)
    prompt = jnp.asarray([[0, 0, 3, 4], [5, 6, 7, 8]], jnp.int32)
    sampling = SamplingConfig(max_new_tokens=4, greedy=True)
    generated = make_generate_fn(scanned_model, sampling, eos_id=1, pad_id=0)(
        scanned, prompt, prompt > 0, jax.random.key(SEED)
    )
    tokens = jnp.concatenate([prompt, generated.tokens], axis=1)
    valid = jnp.concatenate([prompt > 0, generated.mask > 0], axis=1)
    positions = positions_from_mask(valid)
    full, _ = jax.jit(per_layer_model.apply)(params, tokens, positions, valid)
    predicting = np.asarray(full[:, prompt.shape[1] - 1 : -1])  # the slots before each token
    mask = np.asarray(generated.mask) > 0
    np.testing.assert_array_equal(predicting.argmax(-1)[mask], np.asarray(generated.tokens)[mask])
    expected_logp = np.asarray(jax.nn.log_softmax(predicting, axis=-1))
    chosen = np.take_along_axis(expected_logp, np.asarray(generated.tokens)[..., None], -1)
    np.testing.assert_allclose(
        np.asarray(generated.token_logp)[mask], chosen[..., 0][mask], atol=TOL
    )
    cache = scanned_model.init_cache(*tokens.shape)
    cached, _ = jax.jit(scanned_model.apply)(scanned, tokens, positions, valid, cache, 0)
    valid = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(cached)[valid], np.asarray(full)[valid], atol=TOL)


@pytest.mark.parametrize(
    "family, tied", [("llama", False), ("llama", True), ("gpt_neox", False), ("gpt2", True)]
)
def test_weights_cast_to_the_compute_dtype_give_the_same_outputs(family, tied):
    """float32 params under bfloat16 compute: the weights a decode loop casts once
    (`params_in_compute_dtype`) give the model's outputs bit for bit, whatever the family
    (biases, LayerNorm, a tied head, GPT-2's learned positions, added to the token
    embedding in float32, which stays uncast). Random values everywhere, norm scales
    included, so casting a leaf the model uses in float32 would show."""
    sizes = dict(vocab_size=29, d_model=16, num_layers=2, num_heads=2, num_kv_heads=2, d_ff=24)
    cfg = ModelConfig(**sizes, max_seq_len=32, family=family, tie_embeddings=tied, dtype="bfloat16")
    assert (cfg.position_embedding == "learned") == (family == "gpt2")
    model, abstract = abstract_model(cfg)
    leaves, treedef = jax.tree.flatten(abstract)
    rng = np.random.default_rng(SEED)
    params = treedef.unflatten([jnp.asarray(rng.normal(0, 0.5, x.shape), x.dtype) for x in leaves])
    cast = params_in_compute_dtype(cfg, params)
    kept = {
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(cast)
        if leaf.dtype == jnp.float32
    }
    assert any("norm" in name for name in kept) and not any("wq" in name for name in kept)
    assert ("['embedding']" in kept) == (family == "gpt2")
    tokens, mask, *_ = scoring_batch()
    positions = positions_from_mask(mask > 0)
    apply = jax.jit(model.apply)
    expected, _ = apply(params, tokens, positions, mask > 0)
    actual, _ = apply(cast, tokens, positions, mask > 0)
    np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected))
    assert params_in_compute_dtype(cfg, cast) is cast  # nothing left to cast


def called_jaxprs(eqn):
    """The jaxprs an equation calls (a loop's body and condition, a branch, a pjit's)."""
    for value in eqn.params.values():
        for sub in value if isinstance(value, tuple | list) else (value,):
            if isinstance(sub, jax.extend.core.ClosedJaxpr):
                yield sub.jaxpr
            elif isinstance(sub, jax.extend.core.Jaxpr):
                yield sub


def converted_weights_in_loops(jaxpr, weight_shapes: set, in_loop: bool = False) -> list:
    """The float32 → compute-dtype conversions of weight-shaped arrays inside loops (while
    loops, scans and `lax.map`s) of `jaxpr` and the jaxprs it calls."""
    found = []
    for eqn in jaxpr.eqns:
        if in_loop and eqn.primitive.name == "convert_element_type":
            operand = eqn.invars[0].aval
            if operand.dtype == jnp.float32 and operand.shape in weight_shapes:
                found.append(operand.shape)
        inside = in_loop or eqn.primitive.name in ("while", "scan")
        for called in called_jaxprs(eqn):
            found += converted_weights_in_loops(called, weight_shapes, inside)
    return found


BFLOAT16_COMPUTE = dataclasses.replace(PLAIN, dtype="bfloat16")  # float32 params


def decode_loop_jaxprs(model, abstract_params) -> tuple:
    """The jaxprs of the batch generator and of the slot engine's decode chunk (3 rows,
    4 new tokens)."""
    sampling = SamplingConfig(max_new_tokens=4, temperature=TEMPERATURE)
    prompt = jax.ShapeDtypeStruct((3, PROMPT_LEN), jnp.int32)
    generate = make_generate_fn(model, sampling, eos_id=1, pad_id=0)
    generate_jaxpr = jax.make_jaxpr(generate)(
        abstract_params, prompt, jax.ShapeDtypeStruct(prompt.shape, bool), jax.random.key(SEED)
    )
    slots = jax.eval_shape(lambda: engine.init_slots(model, 3, PROMPT_LEN, 4))
    count = np.int32(4)
    chunk_jaxpr = jax.make_jaxpr(engine.decode_program(model, sampling, eos_id=1, pad_id=0))(
        abstract_params, slots, jax.random.key(SEED), count, count, count, count
    )
    return generate_jaxpr, chunk_jaxpr


def test_a_decode_step_does_not_convert_the_weights_again():
    """With float32 params and bfloat16 compute, neither the batch generator's decode loop
    nor the slot engine's, nor π_ref scoring a few rows at a time, converts a weight in
    each step: they were cast once before it (on an H100,
    converting them at every step moved 7.48 GB a step against 4.52 GB for
    qwen2.5-0.5b at batch 256, `benchmarks/static_profile.py --param_dtype=float32`)."""
    model, abstract = abstract_model(BFLOAT16_COMPUTE)
    weight_shapes = {leaf.shape for leaf in jax.tree.leaves(abstract) if leaf.ndim >= 2}
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(abstract))
    prompt = jax.ShapeDtypeStruct((3, PROMPT_LEN), jnp.int32)
    responses = jax.ShapeDtypeStruct((3, 4), jnp.int32)
    score_jaxpr = jax.make_jaxpr(
        scoring.make_score_fn(model, temperature=TEMPERATURE, rows_per_chunk=1)
    )(abstract, prompt, prompt, responses, jax.ShapeDtypeStruct(responses.shape, jnp.float32))
    for closed in (*decode_loop_jaxprs(model, abstract), score_jaxpr):
        assert converted_weights_in_loops(closed.jaxpr, weight_shapes) == []

    # the walk finds conversions where they are: the model's pass in a loop converts them
    def passes_in_a_loop(params):
        tokens = jnp.ones(prompt.shape, jnp.int32)

        def one_pass(carry):
            logits, _ = model.apply(params, tokens, jnp.zeros_like(tokens), tokens > 0)
            return carry[0] + 1, carry[1] + logits.sum()

        return jax.lax.while_loop(lambda carry: carry[0] < 2, one_pass, (0, 0.0))

    converted = converted_weights_in_loops(
        jax.make_jaxpr(passes_in_a_loop)(abstract).jaxpr, weight_shapes
    )
    embedding = abstract["embedding"].shape  # (untied) gathered first, then its rows converted
    assert set(converted) == weight_shapes - {embedding}


def test_chunked_logprobs_convert_the_head_once_forward_and_backward():
    """With `logprob_chunk`, the learner's gradient converts the float32 LM head to the
    compute dtype outside the loop over chunks, forward and backward (a lax.map left to
    autodiff converted it in every chunk, twice)."""
    model, abstract = abstract_model(dataclasses.replace(BFLOAT16_COMPUTE, logprob_chunk=3))
    prompt, prompt_mask, response, response_mask = scoring_batch()

    def loss(params):
        logp = scoring.token_logprobs(
            model, params, prompt, prompt_mask, response, response_mask, temperature=TEMPERATURE
        )
        return logp.sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss))(abstract).jaxpr
    assert converted_weights_in_loops(jaxpr, {abstract["lm_head"].shape}) == []


def loop_carried_logits(jaxpr, vocab: int) -> list:
    """The dtypes of the [rows, vocab] arrays that the while loops of `jaxpr` (and of the
    jaxprs it calls) carry from one step to the next."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "while":
            carried = eqn.params["body_jaxpr"].jaxpr.invars
            found += [v.aval.dtype for v in carried if v.aval.shape[-1:] == (vocab,)]
        for called in called_jaxprs(eqn):
            found += loop_carried_logits(called, vocab)
    return found


def test_decode_loops_carry_the_logits_in_the_compute_dtype():
    """The logits a decode step leaves for the next step's draw stay in the compute dtype
    the head made them in (the draw casts them to float32 as it reads them: the same
    values); float32 ones were written and read again at every step, 156 MB of qwen2.5-
    0.5b's 4.52 GB a step at batch 256 on an H100."""
    model, abstract = abstract_model(BFLOAT16_COMPUTE)
    for closed in decode_loop_jaxprs(model, abstract):
        carried = loop_carried_logits(closed.jaxpr, PLAIN.vocab_size)
        assert carried and all(dtype == jnp.bfloat16 for dtype in carried)


def test_execution_fields_stay_out_of_the_checkpoint_identity():
    plain = PLAIN.to_dict()
    assert not set(EXECUTION_FIELDS) & set(plain) and "scan_layers" not in plain
    tuned = execution(
        remat="dots_saveable",
        attention="dot_product",
        decode_attention="pallas",
        decode_mlp_kernel="32:32:32:4:3",
        logprob_chunk=4,
    )
    assert tuned.to_dict() == plain  # a resumed run may change these
    # and the params' layout: each checkpoint records it, and a resume converts it
    assert SCANNED.to_dict() == plain
    assert ModelConfig(**SCANNED.to_dict()) == PLAIN


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(remat="full"), "model.remat"),
        (dict(attention="flash"), "model.attention"),
        (dict(attention="cudnn"), "half-precision"),
        (dict(decode_attention="flash"), "model.decode_attention"),
        (dict(logprob_chunk=-1), "model.logprob_chunk"),
        # pythia-2.8b's heads: Triton takes power-of-two sizes only
        (dict(decode_attention="pallas", head_dim=80), "power of two .*is 80"),
        (dict(decode_kernel="2:96:4:2"), "decode_kernel: .*block_k must be a power of two"),
        (dict(decode_kernel="fast"), "decode_kernel: 'fast' is not k_splits:block_k"),
        (dict(decode_attention="pallas", num_heads=34, num_kv_heads=2, head_dim=4), "up to 16"),
        (dict(decode_mlp="triton"), "model.decode_mlp"),
        (dict(decode_mlp="pallas"), "d_ff=24 is no multiple of it"),
        (dict(decode_mlp="pallas", d_ff=32, mlp="dense"), "gated MLPs without biases"),
        (dict(decode_mlp="pallas", d_ff=32, mlp_bias=True), "this model's is 'gated' with bias"),
        (dict(decode_mlp_kernel="64:64:64:4"), "decode_mlp_kernel: .*is not block_m:block_n"),
        (dict(decode_projection="triton"), "model.decode_projection"),
        (dict(decode_projection="pallas", d_ff=40), "d_ff is 40, no multiple of it"),
        (dict(decode_projection_kernel="64:64:64:3:4:3"), "k_splits must be a power of two"),
        (dict(decode_projection_kernel="64:64:64:4:3"), "is not block_m:block_n:block_k:k_sp"),
        (dict(decode_qkv="triton"), "model.decode_qkv"),
        (dict(decode_qkv="pallas"), "a power of two of at least 32 .*are 4 and 16"),
        (dict(decode_qkv="pallas", head_dim=96), "are 96 and 16"),  # 48 a half: no array
        (dict(decode_qkv="pallas", head_dim=32, norm="layer"), "this model's norm is 'layer'"),
        (dict(decode_qkv="pallas", head_dim=32, rotary_pct=0.5), "rotates 16 of 32 dims"),
        (
            dict(decode_qkv="pallas", head_dim=32, scan_layers=True, scan_decode=True),
            "decodes a stacked one",
        ),
        (dict(decode_qkv_kernel="64:64:4"), "decode_qkv_kernel: .*is not block_m:block_k"),
    ],
)
def test_bad_execution_fields_are_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        execution(**fields)
    assert preset("pythia-2.8b", vocab_size=16).resolved_head_dim == 80  # a real case


def test_the_config_checks_the_knobs():
    config = get_config()
    config.model.attention = "cudnn"
    with pytest.raises(config_lib.ConfigError, match="cudnn needs"):
        config_lib.check_attention(config)
    config.model.dtype = "bfloat16"
    config_lib.check_attention(config, backend="gpu")
    with pytest.raises(config_lib.ConfigError, match=r"attention=cudnn is a GPU kernel.*is cpu"):
        config_lib.check_attention(config, backend="cpu")
    config.model.attention = "splash"
    config_lib.check_attention(config, backend="tpu")
    with pytest.raises(config_lib.ConfigError, match=r"attention=splash is a TPU kernel.*is gpu"):
        config_lib.check_attention(config, backend="gpu")
    config.model.attention, config.model.decode_attention = "dot_product", "pallas"
    config_lib.check_attention(config, backend="gpu")
    for backend in ("cpu", "tpu"):
        refused = rf"decode_attention=pallas .*is {backend}"
        with pytest.raises(config_lib.ConfigError, match=refused):
            config_lib.check_attention(config, backend=backend)
    config.model.decode_attention, config.model.decode_mlp = "same", "pallas"
    config_lib.check_attention(config, backend="gpu")
    with pytest.raises(config_lib.ConfigError, match=r"decode_mlp=pallas is a GPU kernel.*is cpu"):
        config_lib.check_attention(config, backend="cpu")
    config.model.remat = "everything"
    with pytest.raises(config_lib.ConfigError, match="remat"):
        config_lib.check_ranges(config, config_lib.RANGES)


def test_layout_conversion_reaches_every_params_tree_of_a_train_state():
    from tba_jax import learner
    from tba_jax.runs import convert_layout

    _, params = init_model(PLAIN, jax.random.key(SEED))
    optimizer = learner.make_optimizer(learner.OptimConfig(learning_rate=1e-3, grad_clip_norm=1))
    opt_state = optimizer.init(params)
    opt_state = jax.tree.map(lambda x: x + 1 if x.dtype == jnp.float32 else x, opt_state)
    tree = {"train": {"params": params, "opt_state": opt_state}, "reference": params}
    stacked = convert_layout(tree, stacked=True)
    want_stacked = {
        "train": {
            "params": stack_layers(params),
            "opt_state": optimizer.init(stack_layers(params)),
        },
        "reference": stack_layers(params),
    }
    assert jax.tree.structure(stacked) == jax.tree.structure(want_stacked)
    adam_stacked, adam = stacked["train"]["opt_state"][1][0], opt_state[1][0]  # after clip
    layer_1 = jax.tree.leaves(adam.mu["blocks"][1])
    for got, want in zip(jax.tree.leaves(adam_stacked.mu["blocks"]), layer_1, strict=True):
        np.testing.assert_array_equal(got[1], want)  # layer 1's Adam moment
    back = convert_layout(stacked, stacked=False)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True):
        np.testing.assert_array_equal(got, want)
