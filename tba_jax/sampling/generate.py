"""Prefill + on-device decode loop with a KV cache.

The whole generation is one jitted program: a prefill over the left-padded
prompts, then a `lax.while_loop` that samples one token per step for every
row, stops a row at its first EOS and stops the loop when every row is done or
`max_new_tokens` is reached. No host round trip per token.

Behaviour log-probs are `log_softmax(logits / temperature)` at the sampled
token, the same quantity `scoring.token_logprobs` computes; top-k / top-p
truncation changes which tokens can be drawn but not this log-prob (TB's
target is the tempered policy, DESIGN.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tba_jax.batching import fixed_batches
from tba_jax.mesh import jit_on_mesh, split_rows_like
from tba_jax.models import Model, Params, positions_from_mask
from tba_jax.models.tokenizers import Tokenizer


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How responses are drawn. `greedy` ignores temperature, top_k and top_p."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    greedy: bool = False
    # Ids >= vocab_limit are never drawn (models whose embedding is padded past the
    # tokenizer's vocabulary, e.g. Pythia); 0: no limit.
    vocab_limit: int = 0
    # The batch generator's decode loop runs in this many segments of max_new_tokens / N
    # steps, each attending over only the cache slots its steps can have filled (the
    # prompt and the segment's end): fewer cache reads on long responses, one more
    # compiled loop body per segment. The slot engine (rows at different positions)
    # ignores it.
    decode_segments: int = 1

    def __post_init__(self):
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be positive.")
        if not self.greedy and self.temperature <= 0:
            raise ValueError(
                f"temperature={self.temperature} must be > 0 (use greedy=True for argmax)."
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1].")
        if self.vocab_limit < 0:
            raise ValueError(f"vocab_limit={self.vocab_limit} must be >= 0 (0: no limit).")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 turns it off).")
        if not 1 <= self.decode_segments <= self.max_new_tokens:
            raise ValueError(
                f"decode_segments={self.decode_segments} must be in [1, max_new_tokens="
                f"{self.max_new_tokens}]."
            )

    def segment_ends(self) -> list[int]:
        """The step each decode segment ends at: max_new_tokens × i / decode_segments."""
        segments, steps = self.decode_segments, self.max_new_tokens
        return sorted({-(-steps * i // segments) for i in range(1, segments + 1)})


class Generation(NamedTuple):
    """Sampled responses. tokens: [B, T] (pad after EOS); mask: [B, T] float32 (1 up
    to and including the first EOS); lengths: [B] int32; token_logp: [B, T] float32
    behaviour log-probs at the sampling temperature (0 on padding)."""

    tokens: jax.Array
    mask: jax.Array
    lengths: jax.Array
    token_logp: jax.Array


# Bits of the order-preserving keys of float32 logits (`order_keys`).
KEY_BITS = 32


def mask_padded_vocab(logits: jax.Array, vocab_limit: int) -> jax.Array:
    """Sets the logits of ids >= vocab_limit to -inf (no-op for 0). logits: [B, V]."""
    if vocab_limit <= 0 or vocab_limit >= logits.shape[-1]:
        return logits
    ids = jnp.arange(logits.shape[-1])
    return jnp.where(ids < vocab_limit, logits, jnp.finfo(logits.dtype).min)


def order_keys(values: jax.Array) -> jax.Array:
    """uint32 keys in the order of float32 `values`: a < b exactly when key(a) < key(b),
    and a == b when key(a) == key(b) (-0.0 is read as +0.0). The sign bit is flipped for
    positives, every bit for negatives."""
    values = values.astype(jnp.float32)
    values = jnp.where(values == 0, jnp.float32(0), values)
    bits = jax.lax.bitcast_convert_type(values, jnp.int32)
    ordered = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
    return jax.lax.bitcast_convert_type(ordered, jnp.uint32) ^ jnp.uint32(0x80000000)


def largest_key_where(keys: jax.Array, enough: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Per row of `keys` [B, V] uint32, the largest t for which `enough(keys >= t)` ([B, V]
    bool -> [B] bool) holds: decided bit by bit from the most significant, 32 passes over
    the row and no sort. `enough` must hold at t = 0 and whenever it holds at a larger t."""

    def decide_bit(index, found):
        candidate = found | (jnp.uint32(1) << (KEY_BITS - 1 - index).astype(jnp.uint32))
        return jnp.where(enough(keys >= candidate[:, None]), candidate, found)

    return jax.lax.fori_loop(0, KEY_BITS, decide_bit, jnp.zeros(keys.shape[0], jnp.uint32))


def truncate_logits(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Sets logits outside the top-k, then outside the nucleus of what is left, to the
    float's min. logits: [B, V] float32. Ties at a threshold are all kept. Both thresholds
    are found without sorting the vocabulary (`largest_key_where`): top-k keeps the keys
    >= the largest key that k of them reach, the nucleus those >= the largest key whose
    tokens hold top_p of the mass — the smallest prefix of the sorted vocabulary that
    reaches top_p, ties at its last logit included."""
    neg_inf = jnp.finfo(logits.dtype).min
    if top_k > 0:
        keys = order_keys(logits)
        kth_largest = largest_key_where(keys, lambda kept: jnp.sum(kept, axis=-1) >= top_k)
        logits = jnp.where(keys >= kth_largest[:, None], logits, neg_inf)
    if top_p < 1.0:
        keys, probs = order_keys(logits), jax.nn.softmax(logits, axis=-1)
        threshold = largest_key_where(
            keys, lambda kept: jnp.sum(jnp.where(kept, probs, 0.0), axis=-1) >= top_p
        )
        logits = jnp.where(keys >= threshold[:, None], logits, neg_inf)
    return logits


def _combine_masses(left: tuple, right: tuple) -> tuple:
    """Merges two partial masses (max score, sum of exp(score - max)): the online
    log-sum-exp, associative so XLA can reduce in any order."""
    left_max, left_sum = left
    right_max, right_sum = right
    top = jnp.maximum(left_max, right_max)
    smaller = jnp.exp(jnp.minimum(left_max, right_max) - top)  # one exp: the other is 1
    left_tops = left_max >= right_max
    return top, jnp.where(left_tops, left_sum + right_sum * smaller, left_sum * smaller + right_sum)


def _combine_draws(left: tuple, right: tuple) -> tuple:
    """Merges two partial draws (max logit, sum of exp(logit - max), best score, its id):
    the online log-sum-exp and the first argmax, associative so XLA can reduce in any
    order."""
    top, total = _combine_masses(left[:2], right[:2])
    left_best, left_id = left[2:]
    right_best, right_id = right[2:]
    right_wins = (right_best > left_best) | ((right_best == left_best) & (right_id < left_id))
    return (
        top,
        total,
        jnp.where(right_wins, right_best, left_best),
        jnp.where(right_wins, right_id, left_id),
    )


def draw_with_logp_one_pass(logits: jax.Array, scores: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`draw_with_logp` in one pass over the vocabulary: a variadic reduce of the online
    log-sum-exp and the first argmax. Reads the logits once instead of three times (the
    max, the sum of exponentials, the argmax), which counts where a step is memory-bound:
    156 MB a pass at 256 rows × 151,936 ids. On a CPU, where XLA runs such a reduce as
    scalar code, it is slower."""
    lowest = jnp.finfo(jnp.float32).min
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    top, total, _, token = jax.lax.reduce(
        (logits, jnp.ones_like(logits), scores, ids),
        (jnp.float32(lowest), jnp.float32(0), jnp.float32(lowest), jnp.int32(logits.shape[1])),
        _combine_draws,
        (1,),
    )
    chosen = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0]
    return token, chosen - top - jnp.log(total)


def draw_with_logp_passes(logits: jax.Array, scores: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`draw_with_logp` as a softmax and an argmax written apart (vectorised reduces)."""
    token = jnp.argmax(scores, axis=-1).astype(jnp.int32)
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    return token, jnp.take_along_axis(logp_all, token[:, None], axis=-1)[:, 0]


def draw_with_logp(logits: jax.Array, scores: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The id of each row's largest score (the first, at ties) and `log_softmax(logits)`
    there. logits, scores: [B, V] float32. Returns [B] int32, [B]. One pass over the
    vocabulary on accelerators, separate vectorised passes on a CPU (the platform the
    program is compiled for decides)."""
    logits, scores = logits.astype(jnp.float32), scores.astype(jnp.float32)
    return jax.lax.platform_dependent(
        logits, scores, cpu=draw_with_logp_passes, default=draw_with_logp_one_pass
    )


def block_masses_one_pass(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each block's max score and sum of exp(score − that max), blocks: [B, N, size] →
    [B, N] twice, in one pass over the scores (a variadic reduce)."""
    lowest = jnp.finfo(jnp.float32).min
    return jax.lax.reduce(
        (blocks, jnp.ones_like(blocks)),
        (jnp.float32(lowest), jnp.float32(0)),
        _combine_masses,
        (2,),
    )


def block_masses_passes(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`block_masses_one_pass` as a max and a sum written apart (vectorised reduces)."""
    block_max = jnp.max(blocks, axis=-1)
    return block_max, jnp.sum(jnp.exp(blocks - block_max[..., None]), axis=-1)


def draw_by_inverse_cdf(
    scores: jax.Array, rng: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One id per row of `scores` [B, V] (float32) drawn from softmax(scores) by inverse
    transform sampling: one uniform per row where a Gumbel-max draw needs a random variate
    per id, most of such a draw's time (`benchmarks/sampling_step.py`). The ids fall in
    blocks of ⌈√V⌉; one pass over the row gives each block's mass (as a max and a sum of
    exponentials: one variadic reduce on accelerators, two vectorised ones on a CPU), the
    uniform picks a block by their running sum, then an id inside it by the running sum of
    that block's masses. Exact but for float rounding, which can move a draw at most to a
    neighbouring id of positive mass: an id of zero mass (a truncated or padded one) is
    never drawn. Returns the ids [B] int32, each row's max [B] and its total mass [B] (so
    log_softmax(scores) at the id is score − max − log(total))."""
    rows, vocab = scores.shape
    size = math.isqrt(vocab - 1) + 1  # ⌈√V⌉: both running sums are about √V long
    blocks = -(-vocab // size)
    lowest = jnp.finfo(jnp.float32).min
    # -inf (a masked id divided by a temperature below 1) as the float's min: a block of
    # them then has a max to subtract (exp(-inf - -inf) is NaN) and still no mass
    scores = jnp.maximum(scores, lowest)
    padded = jnp.pad(scores, ((0, 0), (0, blocks * size - vocab)), constant_values=lowest)
    block_max, block_sum = jax.lax.platform_dependent(
        padded.reshape(rows, blocks, size), cpu=block_masses_passes, default=block_masses_one_pass
    )
    top = jnp.max(block_max, axis=-1)
    mass_through = jnp.cumsum(block_sum * jnp.exp(block_max - top[:, None]), axis=-1)
    total = mass_through[:, -1]
    target = jax.random.uniform(rng, (rows,), jnp.float32) * total  # in [0, total)
    chosen = jnp.minimum(jnp.sum(mass_through <= target[:, None], axis=-1), blocks - 1)
    mass_before = jnp.where(
        chosen > 0,
        jnp.take_along_axis(mass_through, jnp.maximum(chosen - 1, 0)[:, None], axis=-1)[:, 0],
        0.0,
    )
    ids = chosen[:, None] * size + jnp.arange(size)  # the chosen block's ids: [B, size]
    inside = jnp.take_along_axis(scores, jnp.minimum(ids, vocab - 1), axis=-1)
    masses = jnp.where(ids < vocab, jnp.exp(inside - top[:, None]), 0.0)
    reached = (mass_before[:, None] + jnp.cumsum(masses, axis=-1) > target[:, None]) & (masses > 0)
    first_reached = jnp.min(jnp.where(reached, ids, vocab), axis=-1)
    last_positive = jnp.max(jnp.where(masses > 0, ids, -1), axis=-1)  # rounding's fallback
    token = jnp.where(first_reached < vocab, first_reached, last_positive)
    return token.astype(jnp.int32), top, total


def sample_token(
    logits: jax.Array, rng: jax.Array, sampling: SamplingConfig
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row. logits: [B, V]. Returns token [B] int32, logp [B]: a draw
    from the softmax of the (truncated) tempered logits (`draw_by_inverse_cdf`), and the
    full tempered log-softmax at it."""
    logits = mask_padded_vocab(logits.astype(jnp.float32), sampling.vocab_limit)
    if sampling.greedy:
        return draw_with_logp(logits, logits)
    tempered = logits / sampling.temperature
    truncated = sampling.top_k > 0 or sampling.top_p < 1.0
    drawable = truncate_logits(tempered, sampling.top_k, sampling.top_p)
    token, top, total = draw_by_inverse_cdf(drawable, rng)
    chosen = jnp.take_along_axis(tempered, token[:, None], axis=-1)[:, 0]
    if truncated:  # the draw's normaliser is the nucleus's, not the full softmax's
        return token, chosen - jax.nn.logsumexp(tempered, axis=-1)
    return token, chosen - top - jnp.log(total)


def response_mask(tokens: jax.Array, eos_id: int) -> jax.Array:
    """1.0 on tokens up to and including the first EOS, 0.0 after. tokens: [B, T]."""
    is_eos = (tokens == eos_id).astype(jnp.int32)
    eos_before = jnp.cumsum(is_eos, axis=-1) - is_eos
    return (eos_before == 0).astype(jnp.float32)


def generate(
    model: Model,
    params: Params,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    rng: jax.Array,
    *,
    sampling: SamplingConfig,
    eos_id: int,
    pad_id: int,
) -> Generation:
    """Samples one response per prompt row. prompt_tokens, prompt_mask: [B, P] (left-padded)."""
    model, params = model.for_decoding(params)  # scan_layers: unstacked once, not per step
    batch, prompt_len = prompt_tokens.shape
    max_new = sampling.max_new_tokens
    prompt_mask = prompt_mask.astype(bool)
    key_valid = jnp.concatenate([prompt_mask, jnp.ones((batch, max_new), bool)], axis=1)
    prompt_positions = positions_from_mask(prompt_mask)
    cache = model.init_cache(batch, prompt_len + max_new)
    logits, cache = model.apply(
        params, prompt_tokens, prompt_positions, key_valid, cache, 0, logits_dtype=None
    )

    class Carry(NamedTuple):
        step: jax.Array
        cache: tuple
        next_logits: jax.Array
        position: jax.Array
        tokens: jax.Array
        token_logp: jax.Array
        done: jax.Array
        rng: jax.Array

    def decode_step(carry: Carry, attended: int) -> Carry:
        rng, step_rng = jax.random.split(carry.rng)
        token, logp = sample_token(carry.next_logits, step_rng, sampling)
        token = jnp.where(carry.done, pad_id, token)
        logp = jnp.where(carry.done, 0.0, logp)
        tokens = jax.lax.dynamic_update_slice(carry.tokens, token[:, None], (0, carry.step))
        token_logp = jax.lax.dynamic_update_slice(carry.token_logp, logp[:, None], (0, carry.step))
        done = carry.done | (token == eos_id)
        step_logits, cache = model.apply(
            params,
            token[:, None],
            carry.position[:, None],
            key_valid[:, :attended],  # the cache slots this segment's steps can see
            carry.cache,
            prompt_len + carry.step,
            logits_dtype=None,  # carried in the compute dtype; sample_token casts
        )
        return Carry(
            carry.step + 1,
            cache,
            step_logits[:, 0],
            carry.position + 1,
            tokens,
            token_logp,
            done,
            rng,
        )

    initial = Carry(
        step=jnp.int32(0),
        cache=cache,
        next_logits=logits[:, -1],
        position=prompt_positions[:, -1] + 1,
        tokens=jnp.full((batch, max_new), pad_id, jnp.int32),
        token_logp=jnp.zeros((batch, max_new), jnp.float32),
        done=jnp.zeros((batch,), bool),
        rng=rng,
    )
    final = initial
    for end in sampling.segment_ends():  # one loop per segment, up to step `end`

        def keep_going(carry: Carry, end=end):
            return (carry.step < end) & ~jnp.all(carry.done)

        step = functools.partial(decode_step, attended=prompt_len + end)
        final = jax.lax.while_loop(keep_going, step, final)
    mask = response_mask(final.tokens, eos_id)
    return Generation(
        tokens=final.tokens,
        mask=mask,
        lengths=mask.sum(axis=-1).astype(jnp.int32),
        token_logp=final.token_logp * mask,
    )


def make_generate_fn(model: Model, sampling: SamplingConfig, *, eos_id: int, pad_id: int):
    """A jitted `(params, prompt_tokens, prompt_mask, rng) -> Generation`."""
    return jit_on_mesh(
        functools.partial(generate, model, sampling=sampling, eos_id=eos_id, pad_id=pad_id)
    )


def generated_batches(
    generate_fn,
    params,
    examples: Sequence[dict],
    tokenizer: Tokenizer,
    *,
    max_prompt_len: int,
    batch_size: int,
    rng: jax.Array,
) -> Iterator[tuple[list[dict], np.ndarray, np.ndarray, Generation]]:
    """One response per example, generated `batch_size` rows at a time (batch i drawn with
    `fold_in(rng, i)`). Yields, per batch, (the batch's real examples, prompt tokens
    [batch_size, P], prompt mask [batch_size, P], Generation): the arrays hold
    `batch_size` rows, of which the first len(real examples) are real.

    A generate function that `streams_any_rows` (`engine.SlotGenerator`) gets every
    example in one call, drawn with `rng`; its output is sliced into the same batches."""
    if getattr(generate_fn, "streams_any_rows", False) and examples:
        all_prompts, all_mask = tokenizer.encode_prompts(
            [example["prompt"] for example in examples], max_prompt_len
        )
        everything = generate_fn(params, all_prompts, all_mask, rng)
        for rows, real in fixed_batches(len(examples), batch_size):
            out = Generation(*(np.asarray(field)[rows] for field in everything))
            yield [examples[i] for i in rows[:real]], all_prompts[rows], all_mask[rows], out
        return
    for index, (rows, real) in enumerate(fixed_batches(len(examples), batch_size)):
        prompts, prompt_mask = tokenizer.encode_prompts(
            [examples[i]["prompt"] for i in rows], max_prompt_len
        )
        # on a mesh, each device decodes its share of the rows (padded to a multiple)
        placed = split_rows_like(params, prompts, prompt_mask)
        out = generate_fn(params, *placed, jax.random.fold_in(rng, index))
        if len(placed[0]) != batch_size:
            out = Generation(*(np.asarray(field)[:batch_size] for field in out))
        yield [examples[i] for i in rows[:real]], prompts, prompt_mask, out
