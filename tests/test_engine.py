"""The slot engine (continuous batching) against the batch generator it replaces.

Greedy decoding is deterministic, so the engine must return exactly the batch path's
responses whatever the slot width, refills, chunking and tail compaction; sampled
responses' behaviour log-probs must equal teacher-forced scoring of the same tokens (an
independent check that every slot reads its own cache at its own offsets).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import SMALL_DECODER as CFG
from support import TRACE_EVENT, recorded_durations

from tba_jax.models import abstract_model, stack_layers
from tba_jax.sampling.engine import (
    NO_REQUEST_YET,
    EngineConfig,
    Request,
    SlotEngine,
    bucket_length,
)
from tba_jax.sampling.generate import SamplingConfig, make_generate_fn
from tba_jax.sampling.scoring import make_score_fn

EOS, PAD = 2, 1
P, T = 6, 12
GREEDY = SamplingConfig(max_new_tokens=T, greedy=True)
SAMPLED = SamplingConfig(max_new_tokens=T, temperature=0.8, top_k=10)
TOL = 1e-4


@pytest.fixture(scope="module")
def setup():
    model, abstract = abstract_model(CFG)
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda a: jnp.asarray(rng.normal(0.0, CFG.init_std, a.shape).astype(np.float32)),
        abstract,
    )
    for norm in [params["final_norm"]] + [
        block[name] for block in params["blocks"].values() for name in ("attn_norm", "mlp_norm")
    ]:
        norm["scale"] = jnp.ones(CFG.d_model)
    # EOS a little likelier than the rest, so responses end at many different lengths
    params["lm_head"] = params["lm_head"].at[:, EOS].add(0.15)
    lengths = rng.integers(1, P + 1, size=20)
    tokens = rng.integers(3, CFG.vocab_size, size=(20, P)).astype(np.int32)
    mask = np.arange(P)[None, :] >= P - lengths[:, None]
    tokens = np.where(mask, tokens, 0).astype(np.int32)
    return dict(model=model, params=params, prompt_tokens=tokens, prompt_mask=mask)


def engine_for(setup, sampling, **config) -> SlotEngine:
    return SlotEngine(
        setup["model"],
        sampling,
        EngineConfig(**config),
        max_prompt_len=P,
        eos_id=EOS,
        pad_id=PAD,
    )


def run_engine(setup, engine, samples=1, rng=0, rows=None, **run):
    rows = range(len(setup["prompt_tokens"])) if rows is None else rows
    requests = [
        Request(row, setup["prompt_tokens"][row], setup["prompt_mask"][row], samples)
        for row in rows
    ]
    finished = [
        item
        for chunk in engine.run(lambda: (setup["params"], 0), requests, jax.random.key(rng), **run)
        for item in chunk
    ]
    return {(item.key, item.sample): item for item in finished}


@pytest.fixture(scope="module")
def greedy_reference(setup):
    generate_fn = make_generate_fn(setup["model"], GREEDY, eos_id=EOS, pad_id=PAD)
    out = jax.device_get(
        generate_fn(
            setup["params"], setup["prompt_tokens"], setup["prompt_mask"], jax.random.key(0)
        )
    )
    return [
        (out.tokens[row, : out.lengths[row]], out.token_logp[row, : out.lengths[row]])
        for row in range(len(out.tokens))
    ]


def test_the_reference_responses_end_at_many_lengths(greedy_reference):
    lengths = {len(tokens) for tokens, _ in greedy_reference}
    assert len(lengths) >= 4, f"lengths {lengths}: the tests below would not exercise refills"


@pytest.mark.parametrize(
    "config",
    [
        # refills mid-chunk, no compaction, every prompt prefilled at max_prompt_len, and
        # the tail in chunks of 2 steps
        dict(slots=4, chunk_steps=3, compact_below=0.0, prefill_buckets=1, tail_chunk_steps=2),
        # several prompts per prefill, at a length per prompt length
        dict(slots=8, chunk_steps=5, prefill_prompts=3, prefill_buckets=6),
        # refills wait until half the slots are free, and fill them in one call
        dict(slots=8, chunk_steps=5, refill_free=0.5),
        # tail compaction
        dict(slots=16, chunk_steps=2, compact_below=0.5, min_width=2, compact_min_steps=0),
        # chunks longer than any response: they return when the tail can be compacted
        dict(slots=32, chunk_steps=64, compact_below=0.5, min_width=2, compact_min_steps=0),
        # a tail that may run at most T = 12 more steps is not worth compacting
        dict(slots=16, chunk_steps=2, compact_below=0.5, min_width=2, compact_min_steps=13),
    ],
)
def test_greedy_engine_responses_equal_the_batch_generator(setup, greedy_reference, config):
    engine = engine_for(setup, GREEDY, **config)
    finished = run_engine(setup, engine)
    assert sorted(finished) == [(row, 0) for row in range(len(greedy_reference))]
    for row, (tokens, token_logp) in enumerate(greedy_reference):
        np.testing.assert_array_equal(finished[row, 0].tokens, tokens, err_msg=f"row {row}")
        np.testing.assert_allclose(finished[row, 0].token_logp, token_logp, atol=TOL)
    # compaction off, no width under 8, or a tail too short to repay it: none
    compacts = config.get("compact_min_steps") == 0
    assert (engine.counters.compactions > 0) == compacts


@pytest.mark.parametrize("samples, prefill_rows", [(1, {4, 8}), (2, {2, 4})])
def test_refills_wait_for_refill_free_and_prefill_at_least_that_many_prompts(
    setup, greedy_reference, samples, prefill_rows
):
    # refill_free=0.5 of 8 slots: a refill (after the first) starts with 4 slots free, so
    # it takes at least 4 // samples prompts, the smallest prefill shape; the stream's last
    # few prompts are padded to it
    engine = engine_for(setup, GREEDY, slots=8, chunk_steps=2, refill_free=0.5)
    rows_prefilled = []
    prefill = engine._prefill

    def recorded(params, state, prompt_tokens, *rest):
        rows_prefilled.append(len(prompt_tokens))
        return prefill(params, state, prompt_tokens, *rest)

    engine._prefill = recorded
    finished = run_engine(setup, engine, samples=samples)
    assert sorted(finished) == [(row, s) for row in range(20) for s in range(samples)]
    for (row, _), item in finished.items():
        np.testing.assert_array_equal(item.tokens, greedy_reference[row][0])
    assert set(rows_prefilled) == prefill_rows
    assert engine.counters.prefilled_prompts == 20
    assert engine.counters.prefills == len(rows_prefilled) < 20 // min(prefill_rows)


@pytest.mark.parametrize("tail_chunk_steps", [0, 1, 5])
def test_with_no_prompt_waiting_a_chunk_runs_tail_chunk_steps_or_to_the_end(
    setup, greedy_reference, tail_chunk_steps
):
    # 3 prompts in 4 slots: the first refill reads the whole stream, so every chunk is a
    # tail chunk; compaction off, so only tail_chunk_steps ends one before the last sample
    engine = engine_for(
        setup, GREEDY, slots=4, chunk_steps=2, compact_below=0.0, tail_chunk_steps=tail_chunk_steps
    )
    finished = run_engine(setup, engine, rows=range(3))
    longest = max(len(greedy_reference[row][0]) for row in range(3))
    assert engine.counters.chunks == (-(-longest // tail_chunk_steps) if tail_chunk_steps else 1)
    assert engine.counters.decode_steps == longest
    for row in range(3):
        np.testing.assert_array_equal(finished[row, 0].tokens, greedy_reference[row][0])


def test_a_stop_ends_the_run_before_its_next_chunk_not_after_the_tail(setup):
    """An async searcher's prompts end when it is told to stop: without `should_stop` the
    engine would then run its live samples to the end in one tail chunk."""
    engine = engine_for(setup, GREEDY, slots=4, chunk_steps=2, compact_below=0.0)

    def stop() -> bool:
        return engine.counters.chunks >= 1

    def prompts():  # as runtime.Searcher's: it ends at a stop
        row = 0
        while not stop():
            yield Request(row, setup["prompt_tokens"][row], setup["prompt_mask"][row], 1)
            row += 1

    params_fn = lambda: (setup["params"], 0)
    chunks = list(engine.run(params_fn, prompts(), jax.random.key(0), should_stop=stop))
    assert chunks == [] and engine.counters.chunks == 1
    assert engine.counters.decode_steps <= 2  # one chunk of chunk_steps, no tail


def test_ending_early_yields_what_finished_and_reads_no_more_requests(setup, greedy_reference):
    """An async searcher starting its live prompts over on newer params: the samples that
    finished come back (as the batch generator makes them), the live ones do not."""
    engine = engine_for(setup, GREEDY, slots=4, chunk_steps=2, compact_below=0.0)
    read = []

    def requests():
        for row in range(len(setup["prompt_tokens"])):
            read.append(row)
            yield Request(row, setup["prompt_tokens"][row], setup["prompt_mask"][row], 1)

    def end_early() -> bool:
        return engine.counters.chunks >= 6

    params_fn = lambda: (setup["params"], 0)
    chunks = list(engine.run(params_fn, requests(), jax.random.key(0), end_early=end_early))
    finished = [item for chunk in chunks for item in chunk]
    assert engine.counters.chunks == 6 and engine.counters.decode_steps <= 12
    assert 0 < len(finished) < len(read) < len(setup["prompt_tokens"])
    for item in finished:
        np.testing.assert_array_equal(item.tokens, greedy_reference[item.key][0])
    assert {item.key for item in finished} < set(read)


def test_a_request_stream_that_has_none_yet_pauses_the_refills_not_the_decoding(
    setup, greedy_reference
):
    """An async searcher bounded by the learner's draws: while its stream says no prompt
    may start, the live samples decode on (chunks of chunk_steps, no compaction) and the
    stream is read again after each chunk; the next prompts start beside the tail, in
    the same run. Before, the stream ended at the bound and the tail ran out alone."""
    engine = engine_for(
        setup, GREEDY, slots=4, chunk_steps=2, compact_below=0.5, min_width=2, compact_min_steps=0
    )
    pauses_left = {4: 3, 9: 2}  # before prompt 4, three reads say "none yet"; before 9, two
    reads = []

    def requests():
        for row in range(len(setup["prompt_tokens"])):
            while pauses_left.get(row, 0):
                pauses_left[row] -= 1
                reads.append(("none yet", engine.counters.chunks))
                yield NO_REQUEST_YET
            reads.append((row, engine.counters.chunks))
            yield Request(row, setup["prompt_tokens"][row], setup["prompt_mask"][row], 1)

    params_fn = lambda: (setup["params"], 0)
    chunks = list(engine.run(params_fn, requests(), jax.random.key(0)))
    finished = {item.key: item for chunk in chunks for item in chunk}
    assert sorted(finished) == list(range(len(greedy_reference)))  # one run, every prompt
    for row, (tokens, token_logp) in enumerate(greedy_reference):
        np.testing.assert_array_equal(finished[row].tokens, tokens, err_msg=f"row {row}")
        np.testing.assert_allclose(finished[row].token_logp, token_logp, atol=TOL)
    # each "none yet" is read after a chunk of its own: the reads wait for decoding
    paused_at = [chunk for item, chunk in reads if item == "none yet"]
    assert len(paused_at) == 5 and len(set(paused_at)) == 5
    # compaction only at the stream's end, once nothing more may come
    assert engine.counters.compactions <= 1


def test_a_stream_with_none_yet_and_no_live_sample_ends_the_run(setup):
    """Nothing to decode while no prompt may start: the run ends (an async searcher then
    waits for the learner's next draw before it starts another), without a chunk."""
    engine = engine_for(setup, GREEDY, slots=4, chunk_steps=2)
    row = 0
    request = Request(row, setup["prompt_tokens"][row], setup["prompt_mask"][row], 1)
    chunks = list(
        engine.run(lambda: (setup["params"], 0), iter([NO_REQUEST_YET, request]), jax.random.key(0))
    )
    assert chunks == [] and engine.counters.chunks == 0 and engine.counters.prefills == 0


def test_samples_of_a_prompt_share_its_prefill_and_each_comes_back_once(setup, greedy_reference):
    engine = engine_for(setup, GREEDY, slots=8, chunk_steps=4)
    finished = run_engine(setup, engine, samples=3)
    assert sorted(finished) == [(row, s) for row in range(20) for s in range(3)]
    assert engine.counters.prefilled_prompts == 20  # one per prompt, not one per sample
    assert engine.counters.prefills < 20  # the prompts that fit go in one call
    for (row, _), item in finished.items():
        np.testing.assert_array_equal(item.tokens, greedy_reference[row][0])


def test_a_scanned_decoder_runs_the_engine_on_its_stacked_cache(setup, greedy_reference):
    """With `scan_decode` the cache is stacked ([L, W, ...]: rows on its second axis); the
    prefill's copies into slots, the decode chunks and the compactions keep every sample's
    own cache rows, so the responses are the batch generator's."""
    model, _ = abstract_model(dataclasses.replace(CFG, scan_layers=True, scan_decode=True))
    stacked = {**setup, "model": model, "params": stack_layers(setup["params"])}
    engine = engine_for(stacked, GREEDY, slots=16, chunk_steps=2, min_width=2, compact_min_steps=0)
    finished = run_engine(stacked, engine, samples=2)
    assert sorted(finished) == [(row, s) for row in range(20) for s in range(2)]
    assert engine.counters.compactions > 0 and engine.counters.prefills > 1
    for (row, _), item in finished.items():
        tokens, token_logp = greedy_reference[row]
        np.testing.assert_array_equal(item.tokens, tokens, err_msg=f"row {row}")
        np.testing.assert_allclose(item.token_logp, token_logp, atol=TOL)


def test_sampled_behaviour_logp_equals_teacher_forced_scoring(setup):
    engine = engine_for(setup, SAMPLED, slots=6, chunk_steps=4, min_width=2, compact_min_steps=0)
    finished = run_engine(setup, engine, samples=2, rng=3)
    score_fn = make_score_fn(setup["model"], temperature=SAMPLED.temperature)
    keys = sorted(finished)
    rows = np.asarray([row for row, _ in keys])
    tokens = np.full((len(keys), T), PAD, np.int32)
    mask = np.zeros((len(keys), T), np.float32)
    for i, key in enumerate(keys):
        length = len(finished[key].tokens)
        assert 1 <= length <= T
        tokens[i, :length], mask[i, :length] = finished[key].tokens, 1.0
        ended = finished[key].tokens[-1] == EOS
        assert ended or length == T
        assert EOS not in finished[key].tokens[:-1]
    logp = np.asarray(
        score_fn(
            setup["params"], setup["prompt_tokens"][rows], setup["prompt_mask"][rows], tokens, mask
        )
    )
    for i, key in enumerate(keys):
        length = len(finished[key].tokens)
        np.testing.assert_allclose(finished[key].token_logp, logp[i, :length], atol=TOL)
    # two samples of one prompt differ somewhere (each slot draws its own tokens)
    assert any(
        not np.array_equal(finished[row, 0].tokens, finished[row, 1].tokens) for row in range(20)
    )


def with_own_programs(setup) -> dict:
    """`setup` with a Model object of its own: engines share their jitted programs per
    Model object, so a test that counts compiled programs needs one no other test used."""
    return {**setup, "model": abstract_model(CFG)[0]}


def test_engines_on_one_model_share_their_programs(setup, greedy_reference):
    """The evaluation's engine and each searcher's: a shape one has compiled, the next
    runs without tracing or compiling it again."""
    setup = with_own_programs(setup)
    run_engine(setup, engine_for(setup, GREEDY, slots=4, chunk_steps=3), rows=range(6))
    with recorded_durations(TRACE_EVENT) as traced:
        second = engine_for(setup, GREEDY, slots=4, chunk_steps=3)
        finished = run_engine(setup, second, rows=range(6))
    assert not traced
    for row in range(6):
        np.testing.assert_array_equal(finished[row, 0].tokens, greedy_reference[row][0])
    # another way of drawing tokens is another decode program, the rest shared
    sampled = engine_for(setup, SAMPLED, slots=4, chunk_steps=3)
    assert sampled._prefill is second._prefill and sampled._decode is not second._decode


@pytest.mark.parametrize("prefill_prompts, most_prefill_rows", [(1, 1), (0, 2)])
def test_nothing_recompiles_as_prompts_come_and_go(setup, prefill_prompts, most_prefill_rows):
    setup = with_own_programs(setup)
    engine = engine_for(
        setup, SAMPLED, slots=8, chunk_steps=2, min_width=2, prefill_prompts=prefill_prompts
    )
    run_engine(setup, engine, samples=2, rng=1)
    run_engine(setup, engine, samples=2, rng=2, rows=range(7))
    # one decode program per width (8, 4, 2) and one prefill program per prefill length
    # (prompts of 1..6 tokens at buckets of 2: 2, 4, 6) and row count (a fixed 1, or
    # 1 and 4 rows for up to 4 prompts of 2 samples in 8 slots), whatever the traffic
    assert engine._decode._cache_size() <= 3
    assert engine._prefill._cache_size() <= 3 * most_prefill_rows


def test_params_on_a_mesh_compile_each_prefill_shape_once(setup):
    # Params placed on a mesh (as the searchers' are) leave the slot state placed there;
    # a run's fresh slots must already be, or its first prefill compiles a second program.
    setup = with_own_programs(setup)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    on_mesh = jax.device_put(setup["params"], replicated)
    engine = engine_for(
        setup,
        SAMPLED,
        slots=8,
        chunk_steps=2,
        prefill_prompts=1,
        prefill_buckets=1,
        compact_below=0.0,
    )
    for rng in (1, 2):
        run_engine({**setup, "params": on_mesh}, engine, samples=2, rng=rng)
    assert engine._prefill._cache_size() == 1  # [1 prompt, P] into 2 slots
    assert engine._decode._cache_size() == 1  # width 8


def test_in_flight_updates_record_the_first_and_last_versions(setup):
    engine = engine_for(setup, SAMPLED, slots=4, chunk_steps=2)
    calls = iter(range(1000))
    requests = [
        Request(row, setup["prompt_tokens"][row], setup["prompt_mask"][row], 1) for row in range(8)
    ]

    def newer_params_every_call():
        return setup["params"], next(calls)

    finished = [
        item
        for chunk in engine.run(
            newer_params_every_call, requests, jax.random.key(0), in_flight_updates=True
        )
        for item in chunk
    ]
    assert all(item.version_first <= item.version_last for item in finished)
    long = [item for item in finished if len(item.tokens) > 2]
    assert long and all(item.version_last > item.version_first for item in long)
    fixed = run_engine(setup, engine_for(setup, SAMPLED, slots=4, chunk_steps=2))
    assert all(item.version_first == item.version_last == 0 for item in fixed.values())


def test_float32_params_are_cast_once_a_publish_for_bfloat16_compute(setup):
    """A run's searchers hold the learner's float32 params: the engine casts the weights
    to the compute dtype once for each params object it is given (the first, and each
    newer one an in-flight update brings), not in every prefill and decode chunk; its
    programs get bfloat16 weights (and the norms as stored)."""
    model, _ = abstract_model(dataclasses.replace(CFG, dtype="bfloat16"))
    engine = engine_for({**setup, "model": model}, SAMPLED, slots=4, chunk_steps=2)
    first, second = setup["params"], jax.tree.map(jnp.copy, setup["params"])
    calls = iter(range(1000))

    def a_newer_object_after_two_calls():
        call = next(calls)
        return (first if call < 3 else second), call

    casts, weights = [], []
    cast, decode = engine._in_compute_dtype, engine._decode
    engine._in_compute_dtype = lambda params: casts.append(params) or cast(params)

    def recording_decode(params, *args):
        weights.append(
            (params["blocks"][0]["attn"]["wq"].dtype, params["final_norm"]["scale"].dtype)
        )
        return decode(params, *args)

    engine._decode = recording_decode
    requests = [
        Request(row, setup["prompt_tokens"][row], setup["prompt_mask"][row], 1) for row in range(8)
    ]
    run = engine.run(
        a_newer_object_after_two_calls, requests, jax.random.key(0), in_flight_updates=True
    )
    finished = [item for chunk in run for item in chunk]
    assert len(finished) == 8 and len(weights) > 3  # chunks on both params objects
    assert [params is first for params in casts] == [True, False]
    assert set(weights) == {(jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))}


def test_more_samples_than_slots_is_refused(setup):
    engine = engine_for(setup, GREEDY, slots=2)
    with pytest.raises(ValueError, match=r"raise search\.slots"):
        run_engine(setup, engine, samples=3)


def test_a_decoder_with_per_row_cache_offsets_equals_one_row_at_a_time(setup):
    model, params = setup["model"], setup["params"]
    rng = np.random.default_rng(1)
    rows, length = 3, 10
    cache = jax.tree.map(
        lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), model.init_cache(rows, length)
    )
    tokens = jnp.asarray(rng.integers(3, CFG.vocab_size, size=(rows, 1)), jnp.int32)
    offsets = jnp.asarray([2, 7, 4], jnp.int32)
    positions = offsets[:, None] + 1
    key_valid = jnp.ones((rows, length), bool)
    logits, new_cache = model.apply(params, tokens, positions, key_valid, cache, offsets)
    for row in range(rows):
        one_cache = jax.tree.map(lambda x, r=row: x[r : r + 1], cache)
        expected, expected_cache = model.apply(
            params,
            tokens[row : row + 1],
            positions[row : row + 1],
            key_valid[row : row + 1],
            one_cache,
            int(offsets[row]),
        )
        np.testing.assert_allclose(logits[row], expected[0], atol=1e-5)
        caches = zip(jax.tree.leaves(new_cache), jax.tree.leaves(expected_cache), strict=True)
        for got, want in caches:
            np.testing.assert_allclose(got[row], want[0], atol=1e-5)


@pytest.fixture(scope="module")
def fused_parts(setup):
    """What the batch and the fused search workers share, and ten prompts to search."""
    from tba_jax.metrics import RateMeter, TimeSplit
    from tba_jax.models.tokenizers import CharTokenizer

    tokenizer = CharTokenizer("abcdefghijklmnopqrstu")  # ids 3..23: the model's vocabulary
    assert tokenizer.vocab_size == CFG.vocab_size and tokenizer.eos_id == EOS
    examples = [{"id": i, "prompt": "abcdefghij"[i % 7 : i % 7 + 1 + i % 4]} for i in range(10)]

    def rewards(examples, texts):  # any host function of the text
        pairs = zip(examples, texts, strict=True)
        return np.asarray([len(text) + 0.5 * example["id"] for example, text in pairs])

    shared = dict(
        score_fn=make_score_fn(setup["model"], temperature=1.0),
        reference_params=jax.tree.map(lambda x: x * 0.9, setup["params"]),
        tokenizer=tokenizer,
        rewards_fn=rewards,
        max_prompt_len=P,
        samples_per_prompt=2,
        time_split=TimeSplit(),
        rates=RateMeter(),
        non_eos_penalty=-1.0,
    )
    return shared, examples


def fused_worker(setup, shared, sampling, slots=6, score_rows=4, **worker):
    from tba_jax.fused import FusedSearchWorker

    engine = SlotEngine(
        setup["model"],
        sampling,
        EngineConfig(slots=slots, chunk_steps=3, min_width=2, compact_min_steps=0),
        max_prompt_len=P,
        eos_id=EOS,
        pad_id=shared["tokenizer"].pad_id,
    )
    return FusedSearchWorker(engine=engine, score_rows=score_rows, **{**shared, **worker})


def short_prompt_examples(count: int = 100) -> list[dict]:
    """`count` examples of 1 to 4 letters: a searcher's prompt stream in these tests."""
    return [{"id": i, "prompt": "abcdefghij"[i % 7 : i % 7 + 1 + i % 4]} for i in range(count)]


def searcher_adding_to_a_list(setup, worker, version_fn, **searcher):
    """A `Searcher` of `worker` over `short_prompt_examples()` taken one per call, whose
    store holds `setup`'s params at version `version_fn()` (no publish interval known) and
    whose buffer appends to a list. Returns (searcher, prompt stream, added list, errors);
    `searcher` holds further `Searcher` keywords (a limit, restarts)."""
    import queue
    import threading

    from tba_jax.data.pipeline import PromptStream
    from tba_jax.runtime import Searcher

    prompts, added, errors = PromptStream(short_prompt_examples(), seed=0), [], queue.Queue()

    class Store:
        def get(self):
            return setup["params"], version_fn()

        def publish_interval(self):
            return None

    class Buffer:
        def add(self, trajectories):
            added.extend(trajectories)

    searcher_thread = Searcher(
        0, worker, Store(), prompts, Buffer(), prompts_per_call=1, seed=0,
        stop=threading.Event(), errors=errors, max_empty_calls=100, **searcher,
    )  # fmt: skip
    return searcher_thread, prompts, added, errors


def wait_until_added(added: list, samples: int, errors, timeout_s: float) -> None:
    """Waits until `samples` are in `added` (or an error, or `timeout_s`), then 0.3 s more:
    time for a searcher to go over, if it would."""
    import time

    deadline = time.monotonic() + timeout_s
    while len(added) < samples and time.monotonic() < deadline and errors.empty():
        time.sleep(0.01)
    time.sleep(0.3)


def test_scoring_groups_are_the_most_ready_samples_in_growing_units(setup, fused_parts):
    worker = fused_worker(setup, fused_parts[0], GREEDY, slots=48, score_rows=2)
    rows = {ready: worker._group_rows(ready) for ready in (1, 2, 7, 8, 31, 32, 47, 48, 100)}
    assert rows == {1: 2, 2: 2, 7: 2, 8: 8, 31: 8, 32: 32, 47: 32, 48: 48, 100: 48}


# groups of 4 or 6 in 6 slots; groups of 2, 8 or 16 in 16 slots
@pytest.mark.parametrize("slots, score_rows", [(6, 4), (16, 2)])
def test_fused_search_equals_batch_then_score_on_greedy_samples(
    setup, fused_parts, slots, score_rows
):
    from tba_jax.runtime import SearchWorker

    shared, examples = fused_parts
    batch = SearchWorker(
        generate_fn=make_generate_fn(
            setup["model"], GREEDY, eos_id=EOS, pad_id=shared["tokenizer"].pad_id
        ),
        **shared,
    )
    fused = fused_worker(setup, shared, GREEDY, slots, score_rows)
    key = jax.random.key(0)
    expected = batch.search(setup["params"], 7, examples, key)
    got = fused.search(setup["params"], 7, examples, key)
    assert len(got) == len(expected) == 20
    assert {len(t.response_tokens) for t in got} != {T}, "every sample ran to the limit"
    for want, have in zip(expected, got, strict=True):
        assert have.prompt_id == want.prompt_id and have.policy_version == 7
        np.testing.assert_array_equal(have.prompt_tokens, want.prompt_tokens)
        np.testing.assert_array_equal(have.response_tokens, want.response_tokens)
        assert have.reward == pytest.approx(want.reward)
        np.testing.assert_allclose(have.token_logp_ref, want.token_logp_ref, atol=TOL)
        np.testing.assert_allclose(have.token_logp_behaviour, want.token_logp_behaviour, atol=TOL)
        assert have.logp_ref == pytest.approx(want.logp_ref, abs=1e-3)


def test_a_stopped_batch_search_skips_the_scoring(setup, fused_parts):
    from tba_jax.runtime import SearchWorker

    shared, examples = fused_parts
    scored = []

    def score_fn(*args):
        scored.append(1)
        return shared["score_fn"](*args)

    batch = SearchWorker(
        generate_fn=make_generate_fn(
            setup["model"], GREEDY, eos_id=EOS, pad_id=shared["tokenizer"].pad_id
        ),
        **{**shared, "score_fn": score_fn},
    )
    key = jax.random.key(0)
    assert batch.search(setup["params"], 7, examples, key, should_stop=lambda: True) == []
    assert not scored
    assert len(batch.search(setup["params"], 7, examples, key, should_stop=lambda: False)) == 20
    assert scored


def test_length_buckets_are_never_closer_than_bucket_min_tokens():
    def lengths(limit, buckets, min_tokens=1):
        return sorted({bucket_length(n, limit, buckets, min_tokens) for n in range(limit + 1)})

    assert lengths(512, 4) == lengths(512, 4, 32) == [128, 256, 384, 512]
    assert lengths(12, 4) == [3, 6, 9, 12]
    assert lengths(12, 4, 32) == [12]  # the demo's responses: one scoring shape
    assert lengths(100, 4, 32) == [32, 64, 96, 100]
    assert lengths(100, 10, 40) == [40, 80, 100]
    # the engine's prefill lengths and the sources' wiring from the config
    assert EngineConfig(slots=4, bucket_min_tokens=32).prefill_length(3, 10) == 10
    assert EngineConfig(slots=4).prefill_length(3, 10) == 3


@pytest.mark.parametrize("buckets, min_tokens, want", [(1, 1, 1), (4, 1, 4), (T, 1, T), (T, 5, 3)])
def test_scoring_compiles_a_program_per_response_length_bucket(
    setup, fused_parts, buckets, min_tokens, want
):
    shared, examples = fused_parts
    score_fn = make_score_fn(setup["model"], temperature=1.0)
    shapes = []  # (rows, response length) of each scoring call

    def recorded(params, prompt_tokens, prompt_mask, response_tokens, response_mask):
        shapes.append(response_tokens.shape)
        return score_fn(params, prompt_tokens, prompt_mask, response_tokens, response_mask)

    def worker(**scoring):  # groups of one prompt's 2 samples, or of 4
        return fused_worker(setup, shared, GREEDY, slots=4, score_rows=2, **scoring)

    got = worker(
        score_fn=recorded, score_length_buckets=buckets, bucket_min_tokens=min_tokens
    ).search(setup["params"], 0, examples, jax.random.key(0))
    lengths = {length for _, length in shapes}
    bucket = max(-(-T // buckets), min_tokens)  # (T, 5): lengths 5, 10 and 12
    allowed = {min(T, bucket * i) for i in range(1, buckets + 1)}
    assert lengths <= allowed and len(allowed) == want
    assert score_fn._cache_size() == len(set(shapes))
    if buckets == 1:
        assert lengths == {T}
    else:
        assert len(lengths) > 1, "every group was scored at one length"
    # padding a response further changes its π_ref log-probs only at float rounding
    expected = worker().search(setup["params"], 0, examples, jax.random.key(0))
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_array_equal(have.response_tokens, want.response_tokens)
        np.testing.assert_allclose(have.token_logp_ref, want.token_logp_ref, atol=TOL)


def test_fused_stream_with_in_flight_updates_gives_trajectories_both_versions(setup, fused_parts):
    shared, examples = fused_parts
    calls = iter(range(1000))
    stream = fused_worker(setup, shared, SAMPLED).stream(
        lambda: (setup["params"], next(calls)), examples, jax.random.key(3), in_flight_updates=True
    )
    trajectories = [item.trajectory for items in stream for item in items]
    assert len(trajectories) == 20
    assert all(t.policy_version <= t.policy_version_last for t in trajectories)
    assert any(t.policy_version < t.policy_version_last for t in trajectories)


def test_fused_stream_hands_on_each_prompts_samples_together(setup, fused_parts):
    # The replay buffer draws a prompt's K rows from the samples it holds; a prompt added
    # before its long samples end would be drawn from its short ones alone.
    shared, examples = fused_parts
    worker = fused_worker(setup, {**shared, "samples_per_prompt": 4}, SAMPLED, slots=8)
    stream = worker.stream(lambda: (setup["params"], 0), examples, jax.random.key(5))
    handed_on = [[item.key for item in items] for items in stream]
    assert len(handed_on) > 1, "every prompt came in one hand-off: nothing streamed"
    keys = [key for items in handed_on for key in items]
    assert sorted(keys) == sorted(list(range(len(examples))) * 4)
    for items in handed_on:
        assert all(items.count(key) == 4 for key in items), items
    # ...at least three at a time when asked (the buffer's recency draws repeat the
    # prompts refreshed since a publish when too few are)
    stream = worker.stream(
        lambda: (setup["params"], 0), examples, jax.random.key(5), prompts_per_hand_on=3
    )
    prompts_handed_on = [len({item.key for item in items}) for items in stream]
    assert sum(prompts_handed_on) == len(examples) and len(prompts_handed_on) > 1
    assert min(prompts_handed_on[:-1]) >= 3, prompts_handed_on
    # ...although the samples of a prompt end at different steps
    lengths = {}
    for item in worker.search(setup["params"], 0, examples, jax.random.key(5)):
        lengths.setdefault(item.prompt_id, set()).add(item.response_length)
    assert any(len(per_prompt) > 1 for per_prompt in lengths.values())


def test_a_stopped_fused_stream_scores_nothing_more(setup, fused_parts):
    shared, examples = fused_parts
    from tba_jax.metrics import RateMeter

    worker = fused_worker(setup, {**shared, "rates": RateMeter()}, SAMPLED)
    stream = worker.stream(
        lambda: (setup["params"], 0),
        examples,
        jax.random.key(3),
        should_stop=lambda: worker.engine.counters.chunks >= 2,
    )
    assert list(stream) == [] and worker.engine.counters.chunks == 2
    assert worker.rates.totals().get("samples", 0) == 0


def run_to_the_end(stream) -> tuple[list, list[dict]]:
    """A fused stream's scored samples, all hand-ons together, and the examples it returns."""
    handed_on = []
    while True:
        try:
            handed_on += next(stream)
        except StopIteration as end:
            return handed_on, end.value


def test_a_restarted_fused_stream_hands_on_whole_prompts_and_returns_the_rest(setup, fused_parts):
    from tba_jax.metrics import RateMeter
    from tba_jax.runtime import RESTARTED_PROMPTS

    shared, examples = fused_parts
    worker = fused_worker(setup, {**shared, "rates": RateMeter()}, GREEDY)
    expected = {
        (t.prompt_id, tuple(t.response_tokens))
        for t in worker.search(setup["params"], 0, examples, jax.random.key(0))
    }
    chunks_before = worker.engine.counters.chunks
    stream = worker.stream(
        lambda: (setup["params"], 0),
        examples,
        jax.random.key(0),
        restart=lambda: worker.engine.counters.chunks >= chunks_before + 5,
    )
    handed_on, returned = run_to_the_end(stream)
    trajectories = [item.trajectory for item in handed_on]
    ids = [t.prompt_id for t in trajectories]
    assert ids and all(ids.count(i) == 2 for i in ids)  # S = 2: whole prompts only
    assert {(t.prompt_id, tuple(t.response_tokens)) for t in trajectories} <= expected
    # the rest, in the order they were read: every example read is handed on or returned
    returned_ids = [example["id"] for example in returned]
    assert returned_ids == sorted(returned_ids) and returned_ids
    assert not set(returned_ids) & set(ids)
    assert set(returned_ids) | set(ids) == set(range(max(returned_ids + ids) + 1))
    assert worker.rates.totals()[RESTARTED_PROMPTS] == len(returned)
    # counted: the search's 20 samples and those handed on, not those of returned prompts
    assert worker.rates.totals()["samples"] == 20 + len(handed_on)


def test_samples_of_prompts_started_over_are_not_counted(setup, fused_parts):
    from tba_jax.metrics import RateMeter

    shared, examples = fused_parts
    shared = {**shared, "rates": RateMeter(), "samples_per_prompt": 3}
    worker = fused_worker(setup, shared, SAMPLED, slots=9, score_rows=1)
    stream = worker.stream(
        lambda: (setup["params"], 0),
        examples,
        jax.random.key(1),
        restart=lambda: worker.engine.counters.chunks >= 3,
    )
    handed_on, returned = run_to_the_end(stream)
    assert returned and worker.rates.totals().get("samples", 0) == len(handed_on)


def test_a_prompt_started_over_once_finishes_on_its_params(setup, fused_parts):
    shared, examples = fused_parts
    worker = fused_worker(setup, shared, SAMPLED)
    stream = worker.stream(
        lambda: (setup["params"], 0),
        examples,
        jax.random.key(0),
        restart=lambda: True,
        restarted_prompts=4,  # examples 0-3 were started over before
    )
    items, examples_returned = run_to_the_end(stream)
    handed_on = [item.trajectory.prompt_id for item in items]
    returned = [example["id"] for example in examples_returned]
    assert {0, 1, 2, 3} <= set(handed_on) and not {0, 1, 2, 3} & set(returned)
    assert returned, "the stream should end as soon as examples 0-3 are done"


def test_prompt_seconds_count_prompts_given_up_as_seconds_without_an_ending():
    from tba_jax.fused import PromptSeconds

    observations = [(0.2, True), (0.5, False), (0.1, True), (0.9, False), (0.3, True)]
    estimate = PromptSeconds(decay=0.8)
    assert estimate.mean() is None
    for seconds, ended in observations:
        estimate.add(seconds, ended=ended)
    weights = 0.8 ** np.arange(len(observations))[::-1]  # the latest weighs 1
    seconds, ended = np.array(observations).T
    assert estimate.mean() == pytest.approx((weights * seconds).sum() / (weights * ended).sum())
    # Exponential durations cut short at 0.8 s (a restart): the estimate finds their mean
    # of 1 s, where the mean of those that ended is 0.36 s.
    durations = np.random.default_rng(0).exponential(1.0, 20_000)
    estimate = PromptSeconds(decay=1.0)
    for duration in durations:
        estimate.add(min(duration, 0.8), ended=duration <= 0.8)
    assert estimate.mean() == pytest.approx(1.0, rel=0.05)
    assert durations[durations <= 0.8].mean() < 0.4


def test_the_policy_store_times_its_publishes(monkeypatch):
    import types

    from tba_jax import runtime

    clock = iter([10.0, 11.0, 11.5, 13.5, *range(20, 40)])
    monkeypatch.setattr(runtime, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    store = runtime.PolicyStore(None, {"w": np.zeros(2)}, version=0, copy_fn=lambda p, _: p)
    assert store.publish_interval() is None  # the creation (at 10 s) alone
    store.publish({"w": np.ones(2)}, version=1)
    assert store.publish_interval() == 1.0 and store.get()[1] == 1
    store.publish({"w": np.ones(2)}, version=2)
    store.publish({"w": np.ones(2)}, version=3)
    assert store.publish_interval() == pytest.approx((13.5 - 10.0) / 3)
    for version in range(4, 24):  # at 20, 21, ..., 39 s: the latest gaps of 1 s
        store.publish({"w": np.ones(2)}, version=version)
    assert store.publish_interval() == 1.0


@pytest.mark.parametrize(
    "restart_on_publish, publish_interval, restarts",
    [(True, None, True), (False, None, False), (True, 1e-6, False)],
    ids=["restarts", "no_restarts", "restarts_do_not_pay"],
)
def test_a_fused_searcher_adds_every_prompt_once_whole_at_least_prompts_per_call_at_a_time(
    setup, fused_parts, restart_on_publish, publish_interval, restarts
):
    """Params are published every few chunks: the live prompts start over on the new
    params (or finish on the old ones), and none is lost or added twice. They finish on
    the old ones, too, when publishes come faster than prompts have taken to finish."""
    import queue
    import threading

    from tba_jax.data.pipeline import PromptStream, epoch_order
    from tba_jax.metrics import RateMeter
    from tba_jax.runtime import RESTARTED_PROMPTS, Searcher

    shared, _ = fused_parts
    examples = short_prompt_examples()
    worker = fused_worker(setup, {**shared, "rates": RateMeter()}, SAMPLED, slots=6)
    worker.prompt_seconds.add(1e-3, ended=True)  # known from the start: no first restart
    stop, errors = threading.Event(), queue.Queue()

    class Store:  # a newer version every 3 decode chunks
        def get(self):
            return setup["params"], worker.engine.counters.chunks // 3

        def publish_interval(self):
            return publish_interval

    class Buffer:
        def __init__(self):
            self.adds = []

        def add(self, trajectories):
            self.adds.append(list(trajectories))
            if sum(map(len, self.adds)) >= 60:
                stop.set()

    prompts, buffer = PromptStream(examples, seed=0), Buffer()
    searcher = Searcher(
        0, worker, Store(), prompts, buffer, prompts_per_call=3, seed=0, stop=stop,
        errors=errors, max_empty_calls=100, restart_on_publish=restart_on_publish,
    )  # fmt: skip
    searcher.run()  # in this thread
    assert errors.empty() and searcher.calls > 3
    restarted = worker.rates.totals().get(RESTARTED_PROMPTS, 0)
    assert restarted > 0 if restarts else restarted == 0
    added = []
    for add in buffer.adds:
        ids = [t.prompt_id for t in add]
        assert len(set(ids)) >= 3 and all(ids.count(i) == 2 for i in ids)  # S = 2
        versions = {(t.prompt_id, t.policy_version) for t in add}
        assert len(versions) == len(set(ids))  # each prompt's samples: one version
        added += sorted(set(ids))
    assert len(added) == len(set(added)) >= 30
    # the prompts not added were in flight or held at the stop: at most 3 live (6 slots),
    # 1 read but not placed, 2 held (fewer than prompts_per_call) and 3 started over
    taken = epoch_order(len(examples), 0, epoch=0)[: prompts.position["index"]]
    assert set(added) <= set(taken.tolist())
    assert len(taken) - len(added) <= 9


def test_a_sample_limit_counts_its_room_from_the_learners_draws():
    import threading

    from tba_jax.runtime import SampleLimit

    limit = SampleLimit(1.5, warm_samples=6, draws_per_step=4)
    assert limit.allowed() == 6 + 1.5 * 4  # before the first draw: the fill and a step
    assert limit.try_start(8) and limit.try_start(4)  # 0, then 8 < 12: the last goes over
    assert not limit.try_start(1)
    stop = threading.Event()
    waiter = threading.Thread(target=limit.wait_for_room, args=(stop,))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "12 samples started, 12 allowed: no room"
    limit.learner_drew(1)  # allowed: 6 + 1.5 × 4 × 2 = 18
    waiter.join(5)
    assert not waiter.is_alive() and limit.allowed() == 18 and limit.paused_seconds >= 0.2
    assert limit.try_start(6) and not limit.try_start(1)
    with limit.lifted(dropped_samples=10):  # the learner waits for stale samples' places
        assert limit.try_start(100)
    assert not limit.try_start(1)  # 18 + 100 - 10 started
    with limit.lifted(dropped_samples=100):
        pass
    assert limit.try_start(1)  # 8 started
    stop.set()
    assert not limit.wait_for_room(stop)  # a stop ends the wait


@pytest.mark.parametrize("engine", ["batch", "slots"])
def test_searchers_under_a_sample_limit_start_only_the_samples_the_learners_draws_allow(
    setup, fused_parts, engine
):
    """A searcher takes prompts while the limit has room, pauses (the slot engine's live
    samples finish and are added) and goes on when the learner draws."""
    import collections

    from tba_jax.metrics import RateMeter
    from tba_jax.runtime import SampleLimit, SearchWorker

    shared, _ = fused_parts
    shared = {**shared, "rates": RateMeter()}  # S = 2
    if engine == "slots":
        worker = fused_worker(setup, shared, SAMPLED, slots=6)
    else:
        generate_fn = make_generate_fn(
            setup["model"], SAMPLED, eos_id=EOS, pad_id=shared["tokenizer"].pad_id
        )
        worker = SearchWorker(generate_fn=generate_fn, **shared)
    # 6 + 2 × 4 = 14 samples before the learner's first draw: 7 prompts of 2 samples
    limit = SampleLimit(2.0, warm_samples=6, draws_per_step=4)
    searcher, prompts, added, errors = searcher_adding_to_a_list(
        setup, worker, lambda: 0, limit=limit
    )

    def settles_at(samples: int) -> None:
        wait_until_added(added, samples, errors, timeout_s=60)
        assert errors.empty() and len(added) == samples
        assert prompts.position["index"] == samples // 2  # no prompt taken beyond the room

    searcher.start()
    try:
        settles_at(14)
        limit.learner_drew(1)  # 6 + 2 × 4 × 2 = 22
        settles_at(22)
        limit.learner_drew(3)  # 6 + 2 × 4 × 4 = 38
        settles_at(38)
    finally:
        searcher.stop.set()
        searcher.join(10)
    assert not searcher.is_alive() and limit.paused_seconds > 0.6
    samples_per_prompt = collections.Counter(t.prompt_id for t in added)
    assert len(samples_per_prompt) == 19 and set(samples_per_prompt.values()) == {2}


def test_a_slot_searcher_starts_its_restarted_prompts_over_without_waiting_for_room(
    setup, fused_parts
):
    """Params are published once the limit's room is used up, while prompts are live: the
    searcher starts them over on the new params at once (they were counted when they
    first started), so every prompt it took is added before the learner draws again.
    Before, it waited for the learner's next draw with those prompts in hand."""
    import collections

    from tba_jax.metrics import RateMeter
    from tba_jax.runtime import RESTARTED_PROMPTS, SampleLimit

    shared, _ = fused_parts
    rates = RateMeter()
    # S = 2 samples in 2 slots: the next prompt is read (and counted) while one decodes,
    # so a publish finds it waiting and starts both over
    worker = fused_worker(setup, {**shared, "rates": rates}, SAMPLED, slots=2)
    # 6 + 2 × 4 = 14 samples before the learner's first draw: 7 prompts of 2 samples
    limit = SampleLimit(2.0, warm_samples=6, draws_per_step=4)
    searcher, prompts, added, errors = searcher_adding_to_a_list(
        setup,
        worker,
        lambda: int(limit._started >= 14),  # version 1 once the 7th prompt has started
        restart_on_publish=True,
        limit=limit,
    )
    searcher.start()
    try:
        wait_until_added(added, 14, errors, timeout_s=30)
    finally:
        searcher.stop.set()
        searcher.join(10)
    assert not searcher.is_alive() and errors.empty()
    assert rates.totals().get(RESTARTED_PROMPTS, 0) > 0  # a publish found live prompts
    assert len(added) == 14 and prompts.position["index"] == 7
    samples_per_prompt = collections.Counter(t.prompt_id for t in added)
    assert len(samples_per_prompt) == 7 and set(samples_per_prompt.values()) == {2}
    assert {t.policy_version for t in added} == {0, 1}  # the restarted ones on version 1


def test_search_config_sets_the_engines_bucket_min_tokens():
    from configs.arithmetic import get_config
    from tba_jax.sources import engine_config

    search = get_config().search
    assert engine_config(search, 8).bucket_min_tokens == search.bucket_min_tokens == 32
    with search.unlocked():
        del search["bucket_min_tokens"]  # a run saved before the key: N buckets, as then
    assert engine_config(search, 8).bucket_min_tokens == 1


def test_evaluation_refills_at_eval_refill_free():
    from configs.arithmetic import get_config
    from tba_jax.sources import evaluation_engine_config

    config = get_config("search.engine=slots,search.refill_free=0.125")
    engine = evaluation_engine_config(config)
    assert engine.slots == config.eval.batch_size and engine.refill_free == 0.25
    with config.eval.unlocked():
        del config.eval["refill_free"]  # a run saved before the key: as its searchers
    assert evaluation_engine_config(config).refill_free == 0.125
    assert evaluation_engine_config(get_config()) is None  # search.engine=batch
