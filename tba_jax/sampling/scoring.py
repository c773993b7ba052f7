"""Teacher-forced log-probs of given responses under any parameters.

Used for the reference policy when a sample is made (searchers), for the
current policy inside the learner's loss, and by tests to check the sampler.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from tba_jax.mesh import jit_on_mesh
from tba_jax.models import Model, Params, params_in_compute_dtype, positions_from_mask
from tba_jax.models.transformer import dense


def token_logprobs(
    model: Model,
    params: Params,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    response_tokens: jax.Array,
    response_mask: jax.Array,
    *,
    temperature: float,
) -> jax.Array:
    """Per-token log π(y_t | x, y_<t) at `temperature`, 0 where `response_mask` is 0.

    prompt_tokens, prompt_mask: [N, P] (left-padded); response_tokens,
    response_mask: [N, T] (right-padded; mask 1 up to and including EOS).
    Returns [N, T] float32. The output head runs on the T slots that predict response
    tokens only, `model.config.logprob_chunk` of them at a time (`features_logprobs`).
    """
    tokens, positions, valid = joined_inputs(
        prompt_tokens, prompt_mask, response_tokens, response_mask
    )
    features = model.features(params, tokens, positions, valid)
    predicting = response_slots(features, prompt_tokens.shape[1], response_tokens.shape[1])
    return features_logprobs(
        model,
        params,
        predicting,
        response_tokens,
        response_mask,
        temperature,
        chunk=model.config.logprob_chunk,
    )


def features_logprobs(
    model: Model,
    params: Params,
    features: jax.Array,
    response_tokens: jax.Array,
    response_mask: jax.Array,
    temperature,
    *,
    chunk: int = 0,
) -> jax.Array:
    """log π(y_t) from the hidden states [N, T, d_model] of the slots predicting each
    response token, through the output head. `chunk` > 0 runs the head, log-softmax and
    gather on `chunk` slots of every row at a time (`chunked_picked_logprobs`; T is
    padded up to a multiple), each chunk recomputed in the backward pass, so at most
    [N, chunk, V] logits exist at once; 0: all T at once. Returns [N, T] float32, 0 where
    `response_mask` is 0."""
    length = response_tokens.shape[1]
    if chunk <= 0 or chunk >= length:
        logits = model.head(params, features, out_dtype=None)
        return picked_logprobs(logits, response_tokens, temperature) * response_mask
    chunks = -(-length // chunk)
    logp = chunked_picked_logprobs(
        model.config.compute_dtype,
        model.head_weight(params),
        time_chunks(features, chunk, chunks),
        time_chunks(response_tokens, chunk, chunks),
        temperature,
    )  # [chunks, N, chunk]
    return jnp.moveaxis(logp, 0, 1).reshape(logp.shape[1], -1)[:, :length] * response_mask


def time_chunks(x: jax.Array, chunk: int, chunks: int) -> jax.Array:
    """[N, T, ...] zero-padded to [N, chunks * chunk, ...] and split into
    [chunks, N, chunk, ...] along time."""
    pad = chunks * chunk - x.shape[1]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(x.shape[0], chunks, chunk, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def joined_inputs(
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    response_tokens: jax.Array,
    response_mask: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Prompt and response side by side as one model input: tokens, positions and
    validity, each [N, P + T]."""
    tokens = jnp.concatenate([prompt_tokens, response_tokens], axis=1)
    valid = jnp.concatenate([prompt_mask.astype(bool), response_mask > 0], axis=1)
    return tokens, positions_from_mask(valid), valid


def response_slots(outputs: jax.Array, prompt_len: int, response_len: int) -> jax.Array:
    """The outputs [N, P + T, ...] of the slots that predict response tokens 0..T−1: the
    output at slot s predicts the token in slot s + 1 (for a value head: V of the state
    before each response token). Returns [N, T, ...]."""
    return outputs[:, prompt_len - 1 : prompt_len - 1 + response_len]


@jax.custom_vjp
def picked_logprobs(logits: jax.Array, tokens: jax.Array, temperature) -> jax.Array:
    """log softmax(logits / temperature)[token], from logits [..., V] in any dtype (the
    head's compute dtype) and tokens [...]; returns [...] float32.

    The values are `jax.nn.log_softmax` then a gather (to the bit, each compiled alone;
    inside other programs XLA may round exp and log apart). The gradient is written out,
    (onehot − softmax) · g / temperature, so the backward pass keeps only the logits, in
    their dtype, and two float32 numbers per token, and gives the logits' cotangent in
    their dtype in one pass over them. Differentiating float32
    logits through `log_softmax` kept a float32 [..., V] array for the backward pass
    (README, "Accelerator throughput": the learner step's bytes and memory before and
    after)."""
    return _picked_logprobs_forward(logits, tokens, temperature)[0]


def _picked_logprobs_forward(logits, tokens, temperature):
    scaled = logits.astype(jnp.float32) / temperature
    shift = jnp.max(scaled, axis=-1, keepdims=True)
    shifted = scaled - shift
    log_normaliser = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
    picked = jnp.take_along_axis(shifted, tokens[..., None], axis=-1) - log_normaliser
    return picked[..., 0], (logits, tokens, temperature, shift, log_normaliser)


def _picked_logprobs_backward(residuals, cotangent):
    logits, tokens, temperature, shift, log_normaliser = residuals
    shifted = logits.astype(jnp.float32) / temperature - shift
    probs = jnp.exp(shifted - log_normaliser)
    onehot = jnp.arange(logits.shape[-1]) == tokens[..., None]
    d_scaled = (onehot.astype(jnp.float32) - probs) * cotangent[..., None]
    return (d_scaled / temperature).astype(logits.dtype), None, None


picked_logprobs.defvjp(_picked_logprobs_forward, _picked_logprobs_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunked_picked_logprobs(
    compute_dtype, weight: jax.Array, features: jax.Array, tokens: jax.Array, temperature
) -> jax.Array:
    """`picked_logprobs` of the head `features @ weight` (in `compute_dtype`), a time
    chunk at a time: features [C, N, c, d_model], tokens [C, N, c], weight [d_model, V]
    as stored; returns [C, N, c] float32: the head then `picked_logprobs` on each chunk,
    the same logits and log-probs to float32 rounding.

    The weight is cast to the compute dtype once, not in every chunk, and the backward
    pass recomputes each chunk's logits, adds its weight gradient to a float32 sum
    (each chunk's matmul gives float32), and keeps no logits between chunks. Left to
    autodiff, a lax.map over chunks converted the weight in every chunk, forward and
    again in the backward pass, and summed the chunks' weight gradients in the dtype the
    weight had inside the map."""
    return _chunked_forward(compute_dtype, weight, features, tokens, temperature)[0]


def _chunked_forward(compute_dtype, weight, features, tokens, temperature):
    head = weight.astype(compute_dtype)

    def one_chunk(chunk):
        chunk_features, chunk_tokens = chunk
        logits = dense(chunk_features, head)
        logp, (*_, shift, log_normaliser) = _picked_logprobs_forward(
            logits, chunk_tokens, temperature
        )
        return logp, shift[..., 0], log_normaliser[..., 0]

    logp, shift, log_normaliser = jax.lax.map(one_chunk, (features, tokens))
    return logp, (weight, features, tokens, temperature, shift, log_normaliser)


def _chunked_backward(compute_dtype, residuals, cotangent):
    weight, features, tokens, temperature, shift, log_normaliser = residuals
    head = weight.astype(compute_dtype)

    def one_chunk(d_weight, chunk):
        chunk_features, chunk_tokens, chunk_shift, chunk_normaliser, chunk_cotangent = chunk
        logits = dense(chunk_features, head)
        chunk_residuals = (
            logits,
            chunk_tokens,
            temperature,
            chunk_shift[..., None],
            chunk_normaliser[..., None],
        )
        d_logits = _picked_logprobs_backward(chunk_residuals, chunk_cotangent)[0]
        d_features = dense(d_logits, head.T)
        flat_features = chunk_features.reshape(-1, chunk_features.shape[-1])
        d_weight += jnp.matmul(
            flat_features.T,
            d_logits.reshape(-1, d_logits.shape[-1]),
            preferred_element_type=jnp.float32,
        )
        return d_weight, d_features

    d_weight, d_features = jax.lax.scan(
        one_chunk,
        jnp.zeros(weight.shape, jnp.float32),
        (features, tokens, shift, log_normaliser, cotangent),
    )
    return d_weight.astype(weight.dtype), d_features, None, None


chunked_picked_logprobs.defvjp(_chunked_forward, _chunked_backward)


def batch_token_logprobs(
    model: Model, params: Params, batch: Mapping[str, jax.Array], *, temperature: float
) -> jax.Array:
    """`token_logprobs` of a batch dict with prompt/response tokens and masks. Returns [N, T]."""
    return token_logprobs(
        model,
        params,
        batch["prompt_tokens"],
        batch["prompt_mask"],
        batch["response_tokens"],
        batch["response_mask"],
        temperature=temperature,
    )


def chunked_token_logprobs(
    model: Model,
    params: Params,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    response_tokens: jax.Array,
    response_mask: jax.Array,
    *,
    temperature: float,
    rows_per_chunk: int,
) -> jax.Array:
    """`token_logprobs` over `rows_per_chunk` rows at a time (a `lax.map`), so the
    [rows, P + T, vocab] logits never exist for the whole batch at once. N must be a
    multiple of `rows_per_chunk`. The weights are cast to the compute dtype once, before
    the map (`params_in_compute_dtype`), not in every chunk. Returns [N, T] float32."""
    params = params_in_compute_dtype(model.config, params)
    n = prompt_tokens.shape[0]
    if n % rows_per_chunk:
        raise ValueError(
            f"{n} rows do not split into chunks of rows_per_chunk={rows_per_chunk}; use a "
            "divisor of the batch."
        )
    inputs = (prompt_tokens, prompt_mask, response_tokens, response_mask)
    chunks = jax.tree.map(lambda x: x.reshape(n // rows_per_chunk, rows_per_chunk, -1), inputs)

    def score_chunk(chunk):
        return token_logprobs(model, params, *chunk, temperature=temperature)

    return jax.lax.map(score_chunk, chunks).reshape(n, -1)


def make_score_fn(model: Model, *, temperature: float, rows_per_chunk: int = 0):
    """A jitted `(params, prompt_tokens, prompt_mask, response_tokens, response_mask) -> [N, T]`.

    `rows_per_chunk` > 0 scores that many rows at a time (bounded logits memory: a large
    vocabulary's [N, P + T, V] logits can outgrow the device); 0: the whole batch at once.
    """
    if rows_per_chunk > 0:
        return jit_on_mesh(
            functools.partial(
                chunked_token_logprobs,
                model,
                temperature=temperature,
                rows_per_chunk=rows_per_chunk,
            )
        )
    return jit_on_mesh(functools.partial(token_logprobs, model, temperature=temperature))
