"""The log-prob of the picked token (`scoring.picked_logprobs`, and a head's chunk at a
time, `scoring.chunked_picked_logprobs`): values, written-out gradients, and what the
backward pass keeps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tba_jax.models.transformer import dense
from tba_jax.sampling.scoring import chunked_picked_logprobs, picked_logprobs

TEMPERATURE = 0.7
VOCAB = 50


def logits_and_tokens(dtype):
    """[3, 5, VOCAB] logits of a wide range (some rows peaked) and [3, 5] tokens."""
    logits_key, tokens_key = jax.random.split(jax.random.PRNGKey(0))
    scales = jnp.array([1.0, 4.0, 30.0])[:, None, None]
    logits = jax.random.normal(logits_key, (3, 5, VOCAB)) * scales
    tokens = jax.random.randint(tokens_key, (3, 5), 0, VOCAB)
    return logits.astype(dtype), tokens


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_picked_logprobs_are_log_softmax_then_a_gather_to_the_bit(dtype):
    """Both compiled, as the learner and scoring run them (XLA's compiled log_softmax
    itself differs from the eager one in the last bit)."""
    logits, tokens = logits_and_tokens(dtype)

    @jax.jit
    def through_log_softmax(logits, tokens):
        logp_all = jax.nn.log_softmax(logits.astype(jnp.float32) / TEMPERATURE, axis=-1)
        return jnp.take_along_axis(logp_all, tokens[..., None], axis=-1)[..., 0]

    expected = through_log_softmax(logits, tokens)
    got = jax.jit(picked_logprobs)(logits, tokens, TEMPERATURE)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_the_gradient_is_onehot_minus_softmax_over_the_temperature(dtype, tolerance):
    """Against the NumPy formula in float64, with a cotangent per token; the logits'
    cotangent comes back in their dtype."""
    logits, tokens = logits_and_tokens(dtype)
    cotangent = jax.random.normal(jax.random.PRNGKey(1), tokens.shape)
    _, backward = jax.vjp(lambda x: picked_logprobs(x, tokens, TEMPERATURE), logits)
    (got,) = backward(cotangent)
    assert got.dtype == dtype

    scaled = np.asarray(logits.astype(jnp.float32), np.float64) / TEMPERATURE
    probs = np.exp(scaled - scaled.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    onehot = np.arange(VOCAB) == np.asarray(tokens)[..., None]
    expected = (onehot - probs) * np.asarray(cotangent, np.float64)[..., None] / TEMPERATURE
    np.testing.assert_allclose(np.asarray(got, np.float64), expected, atol=tolerance)


def test_the_backward_pass_keeps_no_float32_vocabulary_array():
    """What the backward pass holds (the vjp's residuals): the bfloat16 logits and two
    numbers per token, no [..., V] float32 array, which differentiating log_softmax on
    float32 logits keeps (the control)."""
    logits, tokens = logits_and_tokens(jnp.bfloat16)

    def float32_vocabulary_arrays(fn):
        _, backward = jax.vjp(fn, logits)
        return [
            leaf.shape
            for leaf in jax.tree_util.tree_leaves(backward)
            if leaf.dtype == jnp.float32 and leaf.shape[-1:] == (VOCAB,)
        ]

    def through_log_softmax(x):
        logp_all = jax.nn.log_softmax(x.astype(jnp.float32) / TEMPERATURE, axis=-1)
        return jnp.take_along_axis(logp_all, tokens[..., None], axis=-1)[..., 0]

    assert float32_vocabulary_arrays(through_log_softmax)
    assert not float32_vocabulary_arrays(lambda x: picked_logprobs(x, tokens, TEMPERATURE))


def chunked_inputs(dtype):
    """A [16, VOCAB] float32 head weight, [3, 2, 4, 16] features in `dtype` (3 chunks of
    4 slots, 2 rows) and [3, 2, 4] tokens."""
    keys = jax.random.split(jax.random.PRNGKey(2), 3)
    weight = jax.random.normal(keys[0], (16, VOCAB))
    features = jax.random.normal(keys[1], (3, 2, 4, 16)).astype(dtype)
    tokens = jax.random.randint(keys[2], (3, 2, 4), 0, VOCAB)
    return weight, features, tokens


def chunks_through_autodiff(dtype, weight, features, tokens):
    """The head then `picked_logprobs` on each chunk, in a lax.map left to autodiff."""

    def one_chunk(chunk):
        chunk_features, chunk_tokens = chunk
        logits = dense(chunk_features, weight.astype(dtype))
        return picked_logprobs(logits, chunk_tokens, TEMPERATURE)

    return jax.lax.map(one_chunk, (features, tokens))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chunked_logprobs_are_the_head_then_picked_logprobs(dtype):
    """The same logits; the log-softmax on them to float32 rounding (XLA compiles the two
    programs' exponentials and logarithms apart)."""
    weight, features, tokens = chunked_inputs(dtype)
    got = jax.jit(chunked_picked_logprobs, static_argnums=0)(
        dtype, weight, features, tokens, TEMPERATURE
    )
    expected = jax.jit(chunks_through_autodiff, static_argnums=0)(dtype, weight, features, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_chunked_logprobs_give_autodiffs_gradients(dtype, tolerance):
    """The weight's and the features' gradients against autodiff of the chunk map; the
    weight's comes back float32 (its chunks summed in float32)."""
    weight, features, tokens = chunked_inputs(dtype)
    cotangent = jax.random.normal(jax.random.PRNGKey(3), tokens.shape)

    def gradients(fn):
        _, backward = jax.vjp(fn, weight, features)
        return backward(cotangent)

    got = gradients(lambda w, f: chunked_picked_logprobs(dtype, w, f, tokens, TEMPERATURE))
    expected = gradients(lambda w, f: chunks_through_autodiff(dtype, w, f, tokens))
    assert got[0].dtype == jnp.float32 and got[1].dtype == dtype
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tolerance
        )
