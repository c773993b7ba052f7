"""Continuous batching: a generation engine with decode slots (RLHFuse's inter-stage fusion).

`generate.generate` decodes a fixed batch until its longest row ends, so on long-tailed
lengths most decode steps of a batch are spent on a handful of rows. The slot engine
keeps `width` decode slots, each holding one sample's KV cache:

- a **refill** prefills the waiting prompts that fit in the free slots in one call (at
  most `prefill_prompts`; one prefill per prompt) and copies each prompt's cache into the
  S free slots of its samples; it starts once `refill_free` of the slots (at least the
  next prompt's S) are free;
- a **decode chunk** runs up to `chunk_steps` steps for every slot in one jitted
  `lax.while_loop`, and returns early once enough slots are free for the next refill
  (or, with no prompt waiting, once the live samples are few enough to compact);
- once no prompt is waiting (the end of a sync batch or an evaluation), a chunk runs up
  to `tail_chunk_steps` steps, by default until the slots are empty or a compaction can
  start: nothing is left to refill, and every caller of a finite stream waits for all
  of it, so the tail's round trips would buy nothing;
- finished samples (EOS or `max_new_tokens`) are handed to the caller while the next
  chunk runs (JAX dispatch is asynchronous), so scoring them overlaps decoding
  (`fused.py` does that);
- a stream of requests may say that none can start yet (`NO_REQUEST_YET`, an async
  searcher bounded by what the learner draws): the live samples go on decoding, in chunks
  of `chunk_steps` steps, and the stream is asked again after each, so the next prompts
  start as soon as they may, beside the tail of the last ones; with no live sample left
  the run ends, and the caller starts another once requests can start;
- **tail compaction**: once no prompt is waiting and the live samples fill at most
  `compact_below` of the width, they move into the smallest narrower width that holds
  them (halving down to `min_width`), so the tail stops paying for the full width; only
  while the tail may still run `compact_min_steps` steps (`max_new_tokens` less the
  fewest tokens a live sample has), since each compaction costs a host round trip, a
  copy of the cache and, once, a compile.

Shapes are static: the slot width (and its halvings), the cache length
`max_prompt_len + max_new_tokens` and the prefill shapes `[R, L]` for `prefill_buckets`
lengths L (a refill is prefilled at the smallest L that holds its longest prompt, into
the last L prompt positions of its slots) and R = `prefill_prompts`, or with
`prefill_prompts=0` the smallest of `row_shapes(u, slots / S)` that holds the refill's
prompts (u: the fewest prompts a refill takes, `fewest_refill_prompts`); nothing
recompiles as prompts come and go.

Each slot's cache row is laid out as in `generate.generate`: the left-padded prompt in
slots 0..P-1, the response from slot P on. The decoder writes each slot's new key at
its own offset (`cache_offset` per row); keys past a slot's own offset are hidden by the
causal mask, so a refilled slot never sees its previous occupant.

Behaviour log-probs are the same quantity as `generate.generate`'s (log_softmax at the
sampling temperature); with `params_fn` returning newer params between chunks
(in-flight updates) a sample's tokens come from several policy versions, recorded as its
first and last.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tba_jax.mesh import jit_on_mesh, publish, replicated, row_axes, row_shards
from tba_jax.models import KVCache, Model, Params, positions_from_mask
from tba_jax.models.transformer import compute_dtype_cast, has_params_to_cast
from tba_jax.sampling.generate import Generation, SamplingConfig, make_generate_fn, sample_token

ENGINES = ("batch", "slots")


# Row counts that vary with traffic (prompts per prefill call, samples per scoring call)
# are unit × ROW_GROWTH^i below a cap, and the cap: a few static shapes, each call at most
# ROW_GROWTH× padded.
ROW_GROWTH = 4


def row_shapes(unit: int, cap: int) -> list[int]:
    """unit, unit × ROW_GROWTH, … below `cap`, then `cap` (just `unit` if cap <= unit)."""
    shapes = [unit]
    while shapes[-1] < cap:
        shapes.append(min(shapes[-1] * ROW_GROWTH, cap))
    return shapes


def rows_at_least(n: int, unit: int, cap: int) -> int:
    """The smallest of `row_shapes(unit, cap)` that holds n (the largest if none does)."""
    shapes = row_shapes(unit, cap)
    return next((rows for rows in shapes if rows >= n), shapes[-1])


def rows_at_most(n: int, unit: int, cap: int) -> int:
    """The largest of `row_shapes(unit, cap)` that n fills; `unit` when n fills none."""
    return max(rows for rows in row_shapes(unit, cap) if rows <= max(n, unit))


def bucket_length(length: int, limit: int, buckets: int, min_tokens: int = 1) -> int:
    """The smallest of at most `buckets` static lengths (multiples of ceil(limit / buckets),
    or of `min_tokens` when that is longer, capped at `limit`) that holds `length`; the
    first bucket at least, so nothing is 0 long. With `min_tokens` >= limit there is one
    length: `limit`."""
    bucket = max(-(-limit // buckets), min_tokens)
    return min(limit, max(1, -(-length // bucket)) * bucket)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The slot engine's shape and schedule (config.search.*; see the module docstring)."""

    slots: int  # decode width
    chunk_steps: int = 64  # decode steps per host round trip (at most)
    # ...once no prompt is waiting; 0: until the slots are empty or a compaction can start.
    tail_chunk_steps: int = 0
    # Prompts per prefill call (a fixed shape); 0: every waiting prompt the free slots
    # hold, in one call of 4^i rows (or as many rows as slots).
    prefill_prompts: int = 0
    # Tail compaction: with no prompt waiting, live samples at most this share of the width
    # move to the smallest halving of the width that holds them; 0 turns it off.
    compact_below: float = 0.5
    min_width: int = 8  # compaction never goes narrower
    # ...and only while the live samples may still run this many steps (max_new_tokens
    # less the fewest tokens any of them has): a short tail does not repay a compaction.
    compact_min_steps: int = 32
    # A decode chunk returns for a refill once this share of the slots is free (and the
    # next prompt's samples fit); 0: as soon as they fit. Fewer, larger refills cost fewer
    # host round trips and prefill calls; slots wait a little longer empty.
    refill_free: float = 0.0
    # Prompts are prefilled at the smallest of this many lengths (max_prompt_len × i / N)
    # that holds the longest prompt of a refill; 1: always at max_prompt_len.
    prefill_buckets: int = 4
    # ...none of them shorter than this many tokens apart (short prompts: fewer buckets,
    # since a prefill program's compile outweighs a few tokens of padding).
    bucket_min_tokens: int = 1

    def __post_init__(self):
        if self.slots < 1:
            raise ValueError(f"slots={self.slots} must be >= 1.")
        if self.chunk_steps < 1:
            raise ValueError(f"chunk_steps={self.chunk_steps} must be >= 1.")
        if self.tail_chunk_steps < 0:
            raise ValueError(f"tail_chunk_steps={self.tail_chunk_steps} must be >= 0.")
        if self.prefill_prompts < 0:
            raise ValueError(f"prefill_prompts={self.prefill_prompts} must be >= 0.")
        if not 0.0 <= self.compact_below < 1.0:
            raise ValueError(f"compact_below={self.compact_below} must be in [0, 1).")
        if not 0.0 <= self.refill_free <= 1.0:
            raise ValueError(f"refill_free={self.refill_free} must be in [0, 1].")
        if self.min_width < 1:
            raise ValueError(f"min_width={self.min_width} must be >= 1.")
        if self.compact_min_steps < 0:
            raise ValueError(f"compact_min_steps={self.compact_min_steps} must be >= 0.")
        if self.prefill_buckets < 1:
            raise ValueError(f"prefill_buckets={self.prefill_buckets} must be >= 1.")
        if self.bucket_min_tokens < 1:
            raise ValueError(f"bucket_min_tokens={self.bucket_min_tokens} must be >= 1.")

    def check_samples_per_prompt(self, samples_per_prompt: int) -> None:
        if samples_per_prompt > self.slots:
            raise ValueError(
                f"{samples_per_prompt} samples per prompt do not fit in {self.slots} decode "
                "slots (a prompt's samples are prefilled together); raise search.slots."
            )

    def prefill_length(self, longest_prompt: int, max_prompt_len: int) -> int:
        """The prefill length of a refill whose longest prompt has `longest_prompt` tokens."""
        return bucket_length(
            longest_prompt, max_prompt_len, self.prefill_buckets, self.bucket_min_tokens
        )

    def prefill_rows(self, prompts: int, samples: int) -> int:
        """The rows of the prefill call for a refill of `prompts` prompts of `samples`
        samples each: `prefill_prompts`, or the smallest of `row_shapes(unit, most)` that
        holds them, unit = the fewest prompts a refill takes while prompts are waiting
        (`fewest_refill_prompts`; only the stream's last refills take fewer, padded), most
        = the prompts the slots hold."""
        if self.prefill_prompts:
            return self.prefill_prompts
        unit = self.fewest_refill_prompts(samples)
        most = max(unit, self.slots // samples)
        return rows_at_least(prompts, unit, most)

    def fewest_refill_prompts(self, samples: int) -> int:
        """The fewest prompts of `samples` samples a refill takes while more are waiting:
        it waits for `stop_to_refill` free slots."""
        return max(1, self.stop_to_refill(samples) // samples)

    def most_prefill_prompts(self) -> int:
        """The most prompts one refill call takes."""
        return self.prefill_prompts or self.slots

    def stop_to_refill(self, samples: int) -> int:
        """Free slots at which a decode chunk returns for a refill whose next prompt has
        `samples` samples, and the fewest free slots a refill starts with."""
        return max(samples, math.ceil(self.refill_free * self.slots))

    def stop_to_compact(self, width: int) -> int:
        """Free slots (of `width`) from which the live samples can move to a narrower
        width (at most `compact_below` of the width, and few enough for a narrower one to
        hold them): where a decode chunk with no prompt waiting returns; `width + 1`: never
        (no narrower width, or compaction off)."""
        narrower = [w for w in self.widths() if w < width]
        if self.compact_below == 0 or not narrower:
            return width + 1
        live_at_most = min(int(self.compact_below * width), max(narrower))
        return width - live_at_most

    def widths(self) -> list[int]:
        """The compiled decode widths: `slots`, then its halvings down to `min_width`."""
        widths = [self.slots]
        while self.compact_below > 0 and widths[-1] // 2 >= self.min_width:
            widths.append(widths[-1] // 2)
        return widths


class SlotState(NamedTuple):
    """The device state of `W` decode slots; C = P + T (prompt + new tokens).

    cache: per layer {"k", "v"}: [W, C, KV, hd] (one stacked [L, W, C, KV, hd] with
    scan_decode); key_valid: [W, C] bool; next_logits: [W, V] in the compute dtype (the
    logits the slot samples from next); position: [W] int32 (the position id of the next
    token); step: [W] int32 (tokens generated so far); live: [W] bool (still generating);
    tokens: [W, T] int32 (pad after the end); token_logp: [W, T] float32 (0 after the end)."""

    cache: KVCache
    key_valid: jax.Array
    next_logits: jax.Array
    position: jax.Array
    step: jax.Array
    live: jax.Array
    tokens: jax.Array
    token_logp: jax.Array


# An item of `SlotEngine.run`'s requests: no request can start now, more may later.
NO_REQUEST_YET = object()


class Request(NamedTuple):
    """A prompt to sample `samples` responses for. prompt_tokens, prompt_mask: [P]
    (left-padded to the engine's max_prompt_len); key: the caller's tag."""

    key: Any
    prompt_tokens: np.ndarray
    prompt_mask: np.ndarray
    samples: int


class Finished(NamedTuple):
    """One finished sample: tokens [L] (EOS included when emitted), token_logp [L], and
    the policy versions of the params it was generated with (first and last)."""

    key: Any
    sample: int
    tokens: np.ndarray
    token_logp: np.ndarray
    version_first: int
    version_last: int


def init_slots(model: Model, width: int, prompt_len: int, max_new: int) -> SlotState:
    """`width` empty slots (nothing live)."""
    cache = model.init_cache(width, prompt_len + max_new)
    return SlotState(
        cache=cache,
        key_valid=jnp.zeros((width, prompt_len + max_new), bool),
        next_logits=jnp.zeros((width, model.config.vocab_size), model.config.compute_dtype),
        position=jnp.zeros((width,), jnp.int32),
        step=jnp.zeros((width,), jnp.int32),
        live=jnp.zeros((width,), bool),
        tokens=jnp.zeros((width, max_new), jnp.int32),
        token_logp=jnp.zeros((width, max_new), jnp.float32),
    )


def prefill_slots(
    model: Model,
    params: Params,
    state: SlotState,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    slot_ids: jax.Array,
    *,
    pad_id: int,
) -> SlotState:
    """Prefills R prompts once each and puts prompt r into slots `slot_ids[r]` (ids >= W
    are dropped: unused rows of the fixed prefill shape). prompt_tokens, prompt_mask: [R, L]
    (left-padded, L <= the slots' prompt length P: the last L of the P prompt positions;
    the first P - L are masked off); slot_ids: [R, S] int32."""
    max_new = state.tokens.shape[1]
    rows, length = prompt_tokens.shape
    prompt_len = state.key_valid.shape[1] - max_new
    start = prompt_len - length
    copies = slot_ids.shape[1]
    prompt_mask = prompt_mask.astype(bool)
    positions = positions_from_mask(prompt_mask)
    cache = model.init_cache(rows, length)
    logits, cache = model.apply(
        params, prompt_tokens, positions, prompt_mask, cache, 0, logits_dtype=None
    )
    ids = slot_ids.reshape(-1)
    rows_axis = model.cache_batch_axis  # of the cache's leaves ([L, R, ...] with scan_decode)

    def spread(x: jax.Array, axis: int = 0) -> jax.Array:  # R rows -> R * S, prompt-major
        return jnp.repeat(x, copies, axis=axis)

    def put_prompt_cache(slots: jax.Array, prompt_cache: jax.Array) -> jax.Array:
        prompt_cache = spread(prompt_cache, rows_axis).astype(slots.dtype)
        index = (slice(None),) * rows_axis + (ids, slice(start, prompt_len))
        return slots.at[index].set(prompt_cache, mode="drop")

    hidden = jnp.zeros((rows, start), bool)  # a previous occupant's keys stay masked off
    key_valid = jnp.concatenate([hidden, prompt_mask, jnp.ones((rows, max_new), bool)], axis=1)
    return SlotState(
        cache=jax.tree.map(put_prompt_cache, state.cache, cache),
        key_valid=state.key_valid.at[ids].set(spread(key_valid), mode="drop"),
        next_logits=state.next_logits.at[ids].set(spread(logits[:, -1]), mode="drop"),
        position=state.position.at[ids].set(spread(positions[:, -1] + 1), mode="drop"),
        step=state.step.at[ids].set(0, mode="drop"),
        live=state.live.at[ids].set(True, mode="drop"),
        tokens=state.tokens.at[ids].set(pad_id, mode="drop"),
        token_logp=state.token_logp.at[ids].set(0.0, mode="drop"),
    )


def decode_chunk(
    model: Model,
    params: Params,
    state: SlotState,
    rng: jax.Array,
    chunk: jax.Array,
    max_steps: jax.Array,
    stop_when_free: jax.Array,
    min_steps_left: jax.Array,
    *,
    sampling: SamplingConfig,
    eos_id: int,
    pad_id: int,
) -> tuple[SlotState, jax.Array, jax.Array]:
    """Decodes every live slot for up to `max_steps` steps, drawing with
    `fold_in(rng, chunk)`; stops early when no slot is live or `stop_when_free` slots are
    free (a refill can start, or a compaction) while the live samples may still run
    `min_steps_left` steps (0 for a refill). Returns the new state and the number of steps
    run and the slot-steps spent on live samples. (The counts are int32 scalars: the
    engine passes NumPy ones, which travel with the call instead of each being a device
    program of its own, as `jnp.int32(n)` or an eager `fold_in` would be.)"""
    model, params = model.for_decoding(params)  # scan_layers: unstacked once, not per step
    rng = jax.random.fold_in(rng, chunk)
    width, max_new = state.tokens.shape
    prompt_len = state.key_valid.shape[1] - max_new
    rows = jnp.arange(width)

    def keep_going(carry) -> jax.Array:
        steps, _, s, _ = carry
        free = width - jnp.sum(s.live.astype(jnp.int32))
        steps_left = max_new - jnp.min(jnp.where(s.live, s.step, max_new))
        stop = (free >= stop_when_free) & (steps_left >= min_steps_left)
        return (steps < max_steps) & jnp.any(s.live) & ~stop

    def one_step(carry):
        steps, live_steps, s, rng = carry
        rng, step_rng = jax.random.split(rng)
        token, logp = sample_token(s.next_logits, step_rng, sampling)
        token = jnp.where(s.live, token, pad_id)
        logp = jnp.where(s.live, logp, 0.0)
        write_at = jnp.where(s.live, s.step, max_new)  # out of range: dropped
        ended = s.live & ((token == eos_id) | (s.step + 1 >= max_new))
        logits, cache = model.apply(
            params,
            token[:, None],
            s.position[:, None],
            s.key_valid,
            s.cache,
            prompt_len + jnp.minimum(s.step, max_new - 1),
            logits_dtype=None,
        )
        advance = s.live.astype(jnp.int32)
        new_state = SlotState(
            cache=cache,
            key_valid=s.key_valid,
            next_logits=logits[:, 0],
            position=s.position + advance,
            step=s.step + advance,
            live=s.live & ~ended,
            tokens=s.tokens.at[rows, write_at].set(token, mode="drop"),
            token_logp=s.token_logp.at[rows, write_at].set(logp, mode="drop"),
        )
        return steps + 1, live_steps + jnp.sum(advance), new_state, rng

    initial = (jnp.int32(0), jnp.int32(0), state, rng)
    steps, live_steps, state, _ = jax.lax.while_loop(keep_going, one_step, initial)
    return state, steps, live_steps


def take_rows(state: SlotState, ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tokens [N, T], token_logp [N, T], lengths [N]) of slots `ids` [N]."""
    return state.tokens[ids], state.token_logp[ids], state.step[ids]


def compact(state: SlotState, keep: jax.Array, *, cache_batch_axis: int = 0) -> SlotState:
    """The state of slots `keep` [w] only (w < W): slot i of the result is slot keep[i].
    The cache's rows are on `cache_batch_axis` (`Model.cache_batch_axis`)."""
    rows = jax.tree.map(lambda x: x[keep], state._replace(cache=None))
    cache = jax.tree.map(lambda x: jnp.take(x, keep, axis=cache_batch_axis), state.cache)
    return rows._replace(cache=cache)


class SlotEngine:
    """Samples responses with `width` decode slots (see the module docstring).

    `run` takes requests and yields lists of finished samples after every decode chunk;
    the caller works on them while the next chunk runs on the device."""

    def __init__(
        self,
        model: Model,
        sampling: SamplingConfig,
        config: EngineConfig,
        *,
        max_prompt_len: int,
        eos_id: int,
        pad_id: int,
    ):
        self.model, self.sampling, self.config = model, sampling, config
        self.max_prompt_len, self.eos_id, self.pad_id = max_prompt_len, eos_id, pad_id
        self.max_new = sampling.max_new_tokens
        self._init, self._prefill, self._take, self._compact = _slot_programs(
            model, max_prompt_len, self.max_new, pad_id
        )
        self._decode = decode_program(model, sampling, eos_id, pad_id)
        self.counters = EngineCounters()

    def run(
        self,
        params_fn: Callable[[], tuple[Params, int]],
        requests: Iterable[Request],
        rng: jax.Array,
        *,
        in_flight_updates: bool = False,
        should_stop: Callable[[], bool] | None = None,
        end_early: Callable[[], bool] | None = None,
    ) -> Iterator[list[Finished]]:
        """Samples every request's responses; yields the samples finished by each chunk.

        `params_fn() -> (params, version)` is called once at the start, and before every
        chunk with `in_flight_updates`. `requests` is read lazily (one refill at a time),
        so it may be an endless stream; the caller stops by closing the generator. An item
        `NO_REQUEST_YET` pauses the refills: the live samples decode for a chunk of
        `chunk_steps` steps (no compaction: more requests may come), then the stream is
        read again; with no live sample the run ends. With
        `should_stop`, the run also ends, its live samples given up, as soon as that
        returns True before a chunk: a stop arriving as the requests run out (an async
        run's end, a SIGTERM) does not wait for a tail chunk that may run to
        `max_new_tokens` steps. With `end_early`, the run ends as soon as that returns True
        before a chunk: the samples already finished are yielded, the live ones given up,
        and no more requests are read (an async searcher starting its live prompts over
        on newer params)."""
        config = self.config
        width = config.slots
        widths = config.widths()
        published, version = params_fn()
        params = self._in_compute_dtype(published)
        state = self._empty_slots(width, params)
        slots = _SlotTable(width)
        pending = iter(requests)
        waiting: Request | None = None  # a request read but not yet placed
        exhausted = False
        harvest = None  # finished samples of the last chunk, gathered on the device
        chunk = 0
        while True:
            if should_stop is not None and should_stop():
                return
            if end_early is not None and end_early():
                break
            paused = False  # the stream said no request can start yet
            # Refill free slots, up to `most_prefill_prompts` prompts per prefill call.
            while not exhausted and not paused and width == config.slots:
                batch: list[Request] = []
                free = slots.free_count()
                while len(batch) < config.most_prefill_prompts():
                    if waiting is None:
                        waiting = next(pending, None)
                        if waiting is None:
                            exhausted = True
                            break
                        if waiting is NO_REQUEST_YET:
                            waiting, paused = None, True
                            break
                        _check_request(waiting, config, self.max_prompt_len)
                    # a refill starts once the decode chunk's stop rule would return
                    needed = (
                        config.stop_to_refill(waiting.samples) if not batch else waiting.samples
                    )
                    if free < needed:
                        break
                    batch.append(waiting)
                    free -= waiting.samples
                    waiting = None
                if not batch:
                    break
                state = self._prefill_requests(params, state, slots, batch, version)
            if in_flight_updates:
                newest, version = params_fn()
                if newest is not published:
                    published, params = newest, self._in_compute_dtype(newest)
            live_count = slots.occupied_count()
            if live_count == 0:
                break
            # the rule a decode chunk stops at (stop_to_compact, compact_min_steps)
            if (
                exhausted
                and width - live_count >= config.stop_to_compact(width)
                and self.max_new - slots.fewest_steps() >= config.compact_min_steps
            ):
                new_width = min(w for w in widths if live_count <= w < width)
                keep = slots.compact_to(new_width)
                state = self._compact(state, np.asarray(keep, np.int32))
                self.counters.compactions += 1
                width = new_width
            if exhausted:
                max_steps = config.tail_chunk_steps or self.max_new
                stop_when_free = config.stop_to_compact(width)
                min_steps_left = config.compact_min_steps
            elif paused:  # no refill can start before the stream is read again
                max_steps, stop_when_free, min_steps_left = config.chunk_steps, width + 1, 0
            else:
                max_steps = config.chunk_steps
                stop_when_free = config.stop_to_refill(_next_refill_size(waiting))
                min_steps_left = 0
            state, steps, live_steps = self._decode(
                params,
                state,
                rng,
                np.int32(chunk),
                np.int32(max_steps),
                np.int32(stop_when_free),
                np.int32(min_steps_left),
            )
            chunk += 1
            if harvest is not None:  # the caller works while the chunk runs
                yield _collect(harvest)
                harvest = None
            live, slot_steps, steps, live_steps = jax.device_get(
                (state.live, state.step, steps, live_steps)
            )
            self.counters.add_chunk(int(steps), width, int(live_steps))
            slots.mark_decoded(version, slot_steps)
            ended = slots.ended(live)
            if len(ended):
                ids = np.zeros(width, np.int32)
                ids[: len(ended)] = ended
                harvest = (slots.release(ended), self._take(state, ids))
        if harvest is not None:
            yield _collect(harvest)

    def _in_compute_dtype(self, params: Params) -> Params:
        """`params` with the weights cast to the compute dtype once, on their own
        shardings (`mesh.publish` through `models.compute_dtype_cast`), so that neither
        each prefill nor each decode chunk converts float32 weights again; `params` itself
        when they are in it already (as a run's searchers hold them)."""
        cfg = self.model.config
        if not has_params_to_cast(cfg, params):
            return params
        shardings = jax.tree.map(lambda leaf: leaf.sharding, params)
        return publish(params, shardings, compute_dtype_cast(cfg))

    def _empty_slots(self, width: int, params: Params) -> SlotState:
        """`width` empty slots where the prefill and decode programs leave the state when
        they run on `params`, so that a run's first prefill is the program every later
        prefill of its shape runs (with fresh, uncommitted slots JAX compiles it twice)."""
        return _placed_like(self._init(width), params, self.model.cache_batch_axis)

    def _prefill_requests(
        self, params, state: SlotState, slots: _SlotTable, batch: list[Request], version: int
    ) -> SlotState:
        config = self.config
        copies = max(request.samples for request in batch)
        longest = max(_prompt_span(request.prompt_mask) for request in batch)
        length = config.prefill_length(longest, self.max_prompt_len)
        shape = (config.prefill_rows(len(batch), copies), length)
        prompt_tokens = np.full(shape, self.pad_id, np.int32)
        prompt_mask = np.zeros(shape, bool)
        slot_ids = np.full((shape[0], copies), slots.width, np.int32)  # dropped
        for row, request in enumerate(batch):
            prompt_tokens[row] = request.prompt_tokens[-length:]
            prompt_mask[row] = request.prompt_mask[-length:]
            slot_ids[row, : request.samples] = slots.place(request, version)
        self.counters.prefills += 1
        self.counters.prefilled_prompts += len(batch)
        return self._prefill(params, state, prompt_tokens, prompt_mask, slot_ids)


# Engines on the same model share their jitted programs (keyed by the Model object):
# the evaluation's engine and every searcher's trace and compile each shape once, not
# once per engine. A few models at most live in one process (policy; a notebook's runs).
PROGRAMS_KEPT = 8


@functools.lru_cache(maxsize=PROGRAMS_KEPT)
def _slot_programs(model: Model, prompt_len: int, max_new: int, pad_id: int):
    """(init, prefill, take, compact): the engine's jitted programs that do not depend on
    how tokens are drawn."""
    init = jax.jit(
        functools.partial(init_slots, model, prompt_len=prompt_len, max_new=max_new),
        static_argnums=0,
    )
    # the slot state is donated: each call updates it in place instead of copying it
    prefill = jit_on_mesh(functools.partial(prefill_slots, model, pad_id=pad_id), donate_argnums=1)
    take = jax.jit(take_rows)
    compact_slots = jax.jit(functools.partial(compact, cache_batch_axis=model.cache_batch_axis))
    return init, prefill, take, compact_slots


@functools.lru_cache(maxsize=PROGRAMS_KEPT)
def decode_program(model: Model, sampling: SamplingConfig, eos_id: int, pad_id: int):
    """The jitted decode chunk for `sampling` (the slot state donated); engines on the same
    model and sampling share it."""
    return jit_on_mesh(
        functools.partial(decode_chunk, model, sampling=sampling, eos_id=eos_id, pad_id=pad_id),
        donate_argnums=1,
    )


def _placed_like(state: SlotState, params: Params, cache_batch_axis: int) -> SlotState:
    """`state` committed where programs running on `params` keep it: on the device of
    device-placed params; over the mesh of mesh-placed ones, its slots split over the
    mesh's data (× fsdp) axes when their count divides (each device decodes its share of
    the slots, as the batch generator splits a call's rows), else replicated; as it is for
    uncommitted params. (On a mesh of several devices XLA may place a program's output
    otherwise, so there the first prefill still compiles once more.)"""
    leaf = jax.tree.leaves(params)[0]
    if not getattr(leaf, "committed", False):
        return state
    sharding = leaf.sharding
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return jax.device_put(state, sharding)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return state
    mesh = sharding.mesh
    axes, shards = row_axes(mesh), row_shards(mesh)
    if shards == 1 or state.live.shape[0] % shards:
        return jax.device_put(state, replicated(mesh))

    def rows_on(axis: int) -> jax.sharding.NamedSharding:
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*[None] * axis, axes))

    rows = rows_on(0)
    placed = jax.tree.map(lambda _: rows, state._replace(cache=None))
    cache = jax.tree.map(lambda _: rows_on(cache_batch_axis), state.cache)
    return jax.device_put(state, placed._replace(cache=cache))


def _check_request(request: Request, config: EngineConfig, max_prompt_len: int) -> None:
    config.check_samples_per_prompt(request.samples)
    if np.shape(request.prompt_tokens) != (max_prompt_len,):
        raise ValueError(
            f"A request's prompt has shape {np.shape(request.prompt_tokens)}; the engine takes "
            f"prompts left-padded to max_prompt_len={max_prompt_len}."
        )


def _prompt_span(prompt_mask: np.ndarray) -> int:
    """How many of a left-padded prompt's last positions hold its tokens (from the first)."""
    mask = np.asarray(prompt_mask, bool)
    return len(mask) - int(np.argmax(mask)) if mask.any() else 0


def _next_refill_size(waiting: Request | None) -> int:
    """Free slots at which a decode chunk returns early for a refill: the waiting request's
    samples (none read yet: one slot, then the request is read)."""
    return waiting.samples if waiting is not None else 1


def _collect(harvest) -> list[Finished]:
    owners, (tokens, token_logp, lengths) = harvest
    tokens, token_logp, lengths = jax.device_get((tokens, token_logp, lengths))
    finished = []
    for row, (key, sample, first, last) in enumerate(owners):
        length = int(lengths[row])
        finished.append(
            Finished(key, sample, tokens[row, :length], token_logp[row, :length], first, last)
        )
    return finished


@dataclasses.dataclass
class EngineCounters:
    """What the engine did: decode chunks and steps, slot-steps (width × steps) and those
    spent on live samples, prefill calls and the prompts they prefilled, compactions."""

    chunks: int = 0
    decode_steps: int = 0
    slot_steps: int = 0
    live_slot_steps: int = 0
    prefills: int = 0
    prefilled_prompts: int = 0
    compactions: int = 0

    def add_chunk(self, steps: int, width: int, live_steps: int) -> None:
        self.chunks += 1
        self.decode_steps += steps
        self.slot_steps += steps * width
        self.live_slot_steps += live_steps

    @property
    def occupancy(self) -> float:
        """The share of decoded slot-steps that produced a token."""
        return self.live_slot_steps / max(self.slot_steps, 1)


class _SlotTable:
    """The host's view of the slots: which sample each holds and its policy versions."""

    def __init__(self, width: int):
        self.width = width
        self.owner: list[tuple | None] = [None] * width  # (key, sample, first version)
        self.last_version = np.zeros(width, np.int64)
        self.steps = np.zeros(width, np.int64)  # tokens each slot's sample has, last seen

    def free_count(self) -> int:
        return sum(owner is None for owner in self.owner)

    def occupied_count(self) -> int:
        return self.width - self.free_count()

    def place(self, request: Request, version: int) -> list[int]:
        """Takes `request.samples` free slots for its samples; returns their ids."""
        free = [slot for slot, owner in enumerate(self.owner) if owner is None]
        taken = free[: request.samples]
        for sample, slot in enumerate(taken):
            self.owner[slot] = (request.key, sample, version)
            self.last_version[slot] = version
            self.steps[slot] = 0
        return taken

    def mark_decoded(self, version: int, steps: np.ndarray) -> None:
        """After a decode chunk with `version`'s params: steps [W], tokens per slot."""
        self.steps = np.asarray(steps, np.int64).copy()
        for slot, owner in enumerate(self.owner):
            if owner is not None:
                self.last_version[slot] = version

    def fewest_steps(self) -> int:
        """The fewest tokens any occupied slot's sample has (0 with none occupied)."""
        occupied = [self.steps[slot] for slot, owner in enumerate(self.owner) if owner is not None]
        return int(min(occupied, default=0))

    def ended(self, live: np.ndarray) -> np.ndarray:
        """Occupied slots whose sample is no longer live."""
        return np.asarray(
            [slot for slot, owner in enumerate(self.owner) if owner is not None and not live[slot]],
            np.int32,
        )

    def release(self, slots: np.ndarray) -> list[tuple]:
        """Frees `slots`; returns their (key, sample, first version, last version)."""
        owners = []
        for slot in slots:
            key, sample, first = self.owner[slot]
            owners.append((key, sample, first, int(self.last_version[slot])))
            self.owner[slot] = None
        return owners

    def compact_to(self, width: int) -> np.ndarray:
        """Moves the occupied slots to 0..n-1 of a table of `width`; returns, per new slot,
        the old slot it takes (free old slots fill the rest)."""
        occupied = [slot for slot, owner in enumerate(self.owner) if owner is not None]
        free = [slot for slot, owner in enumerate(self.owner) if owner is None]
        keep = np.asarray((occupied + free)[:width], np.int32)
        self.owner = [self.owner[slot] for slot in keep]
        self.last_version = self.last_version[keep]
        self.steps = self.steps[keep]
        self.width = width
        return keep


class SlotGenerator:
    """`generate.generate`'s contract through the slot engine: `(params, prompt_tokens,
    prompt_mask, rng) -> Generation` (NumPy arrays) for any number of rows N, one response
    per row, the rows streamed through the engine's slots. `generated_batches` hands it
    every row at once (`streams_any_rows`) and slices the result into its batches."""

    streams_any_rows = True

    def __init__(self, engine: SlotEngine):
        self.engine = engine

    def __call__(self, params, prompt_tokens, prompt_mask, rng) -> Generation:
        prompt_tokens, prompt_mask = np.asarray(prompt_tokens), np.asarray(prompt_mask)
        rows, max_new = len(prompt_tokens), self.engine.max_new
        tokens = np.full((rows, max_new), self.engine.pad_id, np.int32)
        token_logp = np.zeros((rows, max_new), np.float32)
        lengths = np.zeros(rows, np.int32)
        requests = (Request(row, prompt_tokens[row], prompt_mask[row], 1) for row in range(rows))
        for chunk in self.engine.run(lambda: (params, 0), requests, rng):
            for item in chunk:
                length = len(item.tokens)
                tokens[item.key, :length] = item.tokens
                token_logp[item.key, :length] = item.token_logp
                lengths[item.key] = length
        mask = (np.arange(max_new)[None, :] < lengths[:, None]).astype(np.float32)
        return Generation(tokens=tokens, mask=mask, lengths=lengths, token_logp=token_logp)


def make_generator(
    model: Model,
    sampling: SamplingConfig,
    *,
    eos_id: int,
    pad_id: int,
    max_prompt_len: int,
    engine: EngineConfig | None,
):
    """A generate function for `sampling`: the batch generator (`make_generate_fn`) when
    `engine` is None, else a `SlotGenerator` with `engine`'s slots."""
    if engine is None:
        return make_generate_fn(model, sampling, eos_id=eos_id, pad_id=pad_id)
    slot_engine = SlotEngine(
        model, sampling, engine, max_prompt_len=max_prompt_len, eos_id=eos_id, pad_id=pad_id
    )
    return SlotGenerator(slot_engine)
