"""The sampler (prefill + KV-cache decode loop) against teacher-forced scoring, greedy
step-by-step decoding, NumPy truncation and the tempered softmax it should draw from."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import SMALL_DECODER as CFG

from tba_jax.models import abstract_model, positions_from_mask
from tba_jax.sampling.generate import (
    SamplingConfig,
    block_masses_one_pass,
    block_masses_passes,
    draw_by_inverse_cdf,
    draw_with_logp,
    draw_with_logp_one_pass,
    draw_with_logp_passes,
    make_generate_fn,
    order_keys,
    response_mask,
    truncate_logits,
)
from tba_jax.sampling.scoring import make_score_fn

TOL = 1e-4
EOS, PAD, PROMPT_PAD = 2, 1, 0
B, P, T = 12, 6, 6
PROMPT_LENGTHS = [6, 5, 4, 3, 2, 1, 6, 5, 4, 3, 2, 1]


SAMPLED_07 = SamplingConfig(max_new_tokens=T, temperature=0.7, top_k=8, top_p=0.9)
SAMPLED_10 = SamplingConfig(max_new_tokens=T, temperature=1.0)
GREEDY = SamplingConfig(max_new_tokens=T, greedy=True)
TOP1 = SamplingConfig(max_new_tokens=T, temperature=0.7, top_k=1)

# EOS logit bias of each params variant (see `eos_params`).
EOS_BIAS = {"no_eos": -50.0, "some_eos": 2.0, "all_eos": 1000.0}


# ----------------------------------------------------------------------------------------
# Module-wide model, params, prompts and jitted functions (each compiled once).
# ----------------------------------------------------------------------------------------


def eos_params(base, bias):
    """Params whose EOS logit is shifted by about `bias` times a positive constant.

    Residual dimension 0 is a constant 3 for every token (embedding column 0 = 3, and no
    attention or MLP output writes to it), so after the final RMSNorm it is positive in
    every slot; lm_head[0, EOS] = bias then raises (or lowers) the EOS logit everywhere.
    """
    p = jax.tree.map(np.array, base)
    p["embedding"][:, 0] = 3.0
    for block in p["blocks"].values():
        block["attn"]["wo"][..., 0] = 0.0
        block["mlp"]["w_down"][:, 0] = 0.0
    p["lm_head"][0, EOS] = bias
    return jax.tree.map(jnp.asarray, p)


@pytest.fixture(scope="module")
def setup():
    model, abstract = abstract_model(CFG)
    rng = np.random.default_rng(0)
    base = jax.tree.map(
        lambda a: rng.normal(0.0, CFG.init_std, a.shape).astype(np.float32), abstract
    )
    for norm in [base["final_norm"]] + [
        block[name] for block in base["blocks"].values() for name in ("attn_norm", "mlp_norm")
    ]:
        norm["scale"] = rng.uniform(0.5, 1.5, CFG.d_model).astype(np.float32)
    params = {name: eos_params(base, bias) for name, bias in EOS_BIAS.items()}

    tokens = rng.integers(3, CFG.vocab_size, size=(B, P)).astype(np.int32)
    mask = np.arange(P)[None, :] >= P - np.asarray(PROMPT_LENGTHS)[:, None]
    tokens = np.where(mask, tokens, PROMPT_PAD).astype(np.int32)
    return dict(
        model=model,
        params=params,
        prompt_tokens=tokens,
        prompt_mask=mask,
        apply=jax.jit(model.apply),
        gen_fns={},
        score_fns={},
    )


def generate(setup, sampling, params_name, seed=0, prompts=None):
    fns = setup["gen_fns"]
    if sampling not in fns:
        fns[sampling] = make_generate_fn(setup["model"], sampling, eos_id=EOS, pad_id=PAD)
    tokens, mask = prompts or (setup["prompt_tokens"], setup["prompt_mask"])
    gen = fns[sampling](setup["params"][params_name], tokens, mask, jax.random.key(seed))
    return jax.tree.map(np.asarray, gen)


def score(setup, temperature, params_name, gen):
    fns = setup["score_fns"]
    if temperature not in fns:
        fns[temperature] = make_score_fn(setup["model"], temperature=temperature)
    out = fns[temperature](
        setup["params"][params_name],
        setup["prompt_tokens"],
        setup["prompt_mask"],
        gen.tokens,
        gen.mask,
    )
    return np.asarray(out)


def last_logits(setup, params_name, tokens, mask):
    """Full-forward logits at the last slot of each (left-padded) row: [B, V]."""
    logits, _ = setup["apply"](
        setup["params"][params_name], tokens, positions_from_mask(jnp.asarray(mask)), mask
    )
    return np.asarray(logits[:, -1], np.float64)


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def check_generation_invariants(gen, max_new_tokens):
    """EOS / padding / mask / length bookkeeping; returns the first-EOS index per row."""
    batch = gen.tokens.shape[0]
    assert gen.tokens.shape == gen.mask.shape == gen.token_logp.shape == (batch, max_new_tokens)
    assert gen.tokens.dtype == np.int32 and gen.lengths.dtype == np.int32
    first_eos = np.full(batch, -1)
    for row in range(batch):
        hits = np.flatnonzero(gen.tokens[row] == EOS)
        expected_mask = np.ones(max_new_tokens, np.float32)
        if hits.size:
            first_eos[row] = hits[0]
            assert np.all(gen.tokens[row, hits[0] + 1 :] == PAD)
            expected_mask[hits[0] + 1 :] = 0.0
        np.testing.assert_array_equal(gen.mask[row], expected_mask)
    np.testing.assert_array_equal(gen.lengths, gen.mask.sum(-1))
    np.testing.assert_array_equal(gen.lengths[first_eos < 0], max_new_tokens)
    np.testing.assert_array_equal(gen.lengths[first_eos >= 0], first_eos[first_eos >= 0] + 1)
    assert np.all(gen.token_logp[gen.mask == 0] == 0.0)
    assert np.all(gen.token_logp[gen.mask == 1] <= 0.0)
    return first_eos


# ----------------------------------------------------------------------------------------
# 1. Behaviour log-probs equal scoring log-probs.
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("params_name", ["no_eos", "some_eos"])
@pytest.mark.parametrize(
    "sampling, temperature",
    [(SAMPLED_07, 0.7), (SAMPLED_10, 1.0), (GREEDY, 1.0)],
    ids=["t0.7_topk_topp", "t1.0", "greedy"],
)
def test_behaviour_logp_equals_scoring_logp(setup, sampling, temperature, params_name):
    gen = generate(setup, sampling, params_name)
    check_generation_invariants(gen, T)
    if params_name == "some_eos":
        assert (gen.mask == 0).any()  # padding is exercised
    scored = score(setup, temperature, params_name, gen)
    on = gen.mask == 1
    np.testing.assert_allclose(gen.token_logp[on], scored[on], rtol=TOL, atol=TOL)
    assert np.all(scored[~on] == 0.0)
    assert np.all(gen.token_logp[~on] == 0.0)


def test_behaviour_logp_is_of_the_full_tempered_softmax(setup):
    """With top-k / top-p on, the behaviour log-prob is of the full tempered softmax
    (DESIGN.md), not of the renormalised truncated one, and not at temperature 1."""
    gen = generate(setup, SAMPLED_07, "no_eos")
    logits = last_logits(setup, "no_eos", setup["prompt_tokens"], setup["prompt_mask"])
    tempered = logits / 0.7
    first = gen.tokens[:, 0]
    rows = np.arange(B)
    keep = np_truncate(tempered, SAMPLED_07.top_k, SAMPLED_07.top_p)
    assert np.all(keep[rows, first])  # only kept tokens are drawn
    assert np.all(keep.sum(-1) < CFG.vocab_size)  # truncation bites in every row
    full = np_log_softmax(tempered)[rows, first]
    truncated = np_log_softmax(np.where(keep, tempered, -np.inf))[rows, first]
    untempered = np_log_softmax(logits)[rows, first]
    np.testing.assert_allclose(gen.token_logp[:, 0], full, rtol=TOL, atol=TOL)
    assert np.all(np.abs(full - truncated) > 100 * TOL)
    assert np.all(np.abs(full - untempered) > 100 * TOL)


# ----------------------------------------------------------------------------------------
# 2. Keys.
# ----------------------------------------------------------------------------------------


def test_same_key_same_samples_different_key_different_samples(setup):
    first = generate(setup, SAMPLED_10, "no_eos", seed=7)
    again = generate(setup, SAMPLED_10, "no_eos", seed=7)
    other = generate(setup, SAMPLED_10, "no_eos", seed=8)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    assert (first.tokens != other.tokens).mean() > 0.3


# ----------------------------------------------------------------------------------------
# 3. EOS handling.
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [SAMPLED_10, SAMPLED_07], ids=["t1.0", "t0.7_topk_topp"])
def test_eos_handling(setup, sampling):
    gen = generate(setup, sampling, "some_eos", seed=3)
    first_eos = check_generation_invariants(gen, T)
    # Coverage: rows that stop early, and rows that never emit EOS.
    assert np.any((first_eos >= 0) & (first_eos < T - 1))
    assert np.any(first_eos < 0)


def test_all_rows_stop_at_the_first_step(setup):
    gen = generate(setup, SAMPLED_10, "all_eos")
    check_generation_invariants(gen, T)
    np.testing.assert_array_equal(gen.tokens[:, 0], EOS)
    np.testing.assert_array_equal(gen.tokens[:, 1:], PAD)
    np.testing.assert_array_equal(gen.lengths, 1)
    np.testing.assert_allclose(gen.token_logp[:, 0], 0.0, atol=1e-5)


def test_without_eos_every_row_is_full_length(setup):
    gen = generate(setup, SAMPLED_10, "no_eos", seed=4)
    assert not np.any(gen.tokens == EOS)
    np.testing.assert_array_equal(gen.lengths, T)
    np.testing.assert_array_equal(gen.mask, 1.0)


# ----------------------------------------------------------------------------------------
# 4-5. Greedy decoding and top-k = 1.
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy_reference(setup):
    """Step-by-step argmax of the full forward over the growing sequence."""
    tokens, mask = setup["prompt_tokens"], setup["prompt_mask"]
    done = np.zeros(B, bool)
    out_tokens = np.full((B, T), PAD, np.int32)
    out_logp = np.zeros((B, T))
    for step in range(T):
        logits = last_logits(setup, "some_eos", tokens, mask)
        logp = np_log_softmax(logits)
        choice = np.argmax(logits, -1)
        out_tokens[~done, step] = choice[~done]
        out_logp[~done, step] = logp[np.arange(B), choice][~done]
        done |= choice == EOS
        tokens = np.concatenate([tokens, out_tokens[:, step : step + 1]], axis=1)
        mask = np.concatenate([mask, np.ones((B, 1), bool)], axis=1)
    return out_tokens, out_logp


def test_greedy_equals_step_by_step_argmax(setup, greedy_reference):
    ref_tokens, ref_logp = greedy_reference
    gen = generate(setup, GREEDY, "some_eos", seed=0)
    first_eos = check_generation_invariants(gen, T)
    assert np.any(first_eos >= 0) and np.any(first_eos < 0)  # both kinds of rows
    np.testing.assert_array_equal(gen.tokens, ref_tokens)
    np.testing.assert_allclose(gen.token_logp, ref_logp, rtol=TOL, atol=TOL)
    # Greedy ignores the key.
    np.testing.assert_array_equal(generate(setup, GREEDY, "some_eos", seed=5).tokens, ref_tokens)


@pytest.mark.parametrize("segments", [2, 4])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED_10], ids=["greedy", "sampled"])
def test_decode_segments_attend_over_less_and_sample_the_same(setup, sampling, segments):
    """Segments attend over only the cache slots their steps can have filled; the slots
    left out are masked off anyway, so the samples and log-probs are those of one loop."""
    segmented = dataclasses.replace(sampling, decode_segments=segments)
    assert segmented.segment_ends()[-1] == T and len(segmented.segment_ends()) == segments
    for params_name in ("no_eos", "some_eos"):
        want = generate(setup, sampling, params_name, seed=3)
        got = generate(setup, segmented, params_name, seed=3)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_allclose(got.token_logp, want.token_logp, atol=1e-5)  # summation order


def test_a_key_valid_shorter_than_the_cache_attends_over_its_first_slots(setup):
    """A cached pass given key_valid [B, S_att] reads only the first S_att cache slots: a
    cache whose later slots hold NaN (which a masked read would still spread: its
    attention weight is 0, and 0 × NaN is NaN) gives the logits of a clean one."""
    model, params = setup["model"], setup["params"]["some_eos"]
    tokens, mask = setup["prompt_tokens"], setup["prompt_mask"]
    positions = positions_from_mask(jnp.asarray(mask))
    clean = model.init_cache(B, P + T)
    garbage = jax.tree.map(lambda x: x.at[:, P:].set(jnp.nan), clean)
    want, _ = setup["apply"](params, tokens, positions, jnp.asarray(mask), clean, 0)
    got, cache = setup["apply"](params, tokens, positions, jnp.asarray(mask), garbage, 0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
    assert bool(jnp.all(jnp.isnan(cache[0]["v"][:, P:])))  # left as they were
    full_valid = jnp.concatenate([jnp.asarray(mask), jnp.ones((B, T), bool)], axis=1)
    spread, _ = setup["apply"](params, tokens, positions, full_valid, garbage, 0)
    assert bool(jnp.any(jnp.isnan(spread)))  # read over every slot, the NaN gets through


def test_top_k_one_is_greedy(setup, greedy_reference):
    ref_tokens, _ = greedy_reference
    for seed in (0, 1):
        gen = generate(setup, TOP1, "some_eos", seed=seed)
        np.testing.assert_array_equal(gen.tokens, ref_tokens)


def np_truncate(logits, top_k, top_p):
    """Boolean mask of the tokens kept by top-k then top-p (on the renormalised top-k)."""
    keep = np.ones_like(logits, bool)
    for row, values in enumerate(np.asarray(logits, np.float64)):
        order = np.argsort(-values)
        if top_k > 0:
            keep[row, order[top_k:]] = False
            order = order[:top_k]
        if top_p < 1.0:
            probs = np.exp(values[order] - values[order].max())
            cumulative = np.cumsum(probs / probs.sum())
            size = int(np.searchsorted(cumulative, top_p)) + 1  # first index reaching top_p
            keep[row, order[size:]] = False
    return keep


@pytest.mark.parametrize(
    "top_k, top_p",
    [(1, 1.0), (5, 1.0), (17, 1.0), (0, 0.05), (0, 0.3), (0, 0.7), (0, 0.95), (10, 0.6)],
)
def test_truncate_logits_matches_numpy(top_k, top_p):
    rng = np.random.default_rng(top_k * 100 + int(top_p * 100))
    logits = rng.normal(0.0, 2.0, size=(16, 40)).astype(np.float32)
    out = np.asarray(truncate_logits(jnp.asarray(logits), top_k, top_p))
    kept = out > np.finfo(np.float32).min
    expected = np_truncate(logits, top_k, top_p)
    np.testing.assert_array_equal(kept, expected)
    np.testing.assert_array_equal(out[kept], logits[kept])  # kept logits untouched
    if top_k > 0 and top_p == 1.0:
        np.testing.assert_array_equal(kept.sum(-1), top_k)
    if top_p < 1.0:
        # The kept set is the *smallest* prefix reaching top_p.
        # (Probabilities renormalised over the top-k survivors when top-k is on.)
        top_k_kept = np_truncate(logits, top_k, 1.0)
        probs = np.exp(np_log_softmax(np.where(top_k_kept, logits, -np.inf)))
        mass = np.where(kept, probs, 0.0)
        assert np.all(mass.sum(-1) >= top_p - 1e-6)
        smallest_kept = np.where(kept, probs, np.inf).min(-1)
        assert np.all(mass.sum(-1) - smallest_kept < top_p)
    assert kept.sum() < kept.size  # something was truncated


@pytest.mark.parametrize("top_k, top_p", [(7, 1.0), (0, 0.5), (0, 0.9)])
def test_truncate_logits_keeps_every_tie_at_its_threshold_as_a_sort_would(top_k, top_p):
    """Logits on a coarse grid (many ties, both signs, ±0.0, the float's min as a masked
    id): the sort-free thresholds keep what the sorted reference keeps, ties at the
    threshold included."""
    rng = np.random.default_rng(top_k + int(10 * top_p))
    logits = (rng.integers(-6, 7, size=(12, 300)) * 0.5).astype(np.float32)
    logits[0, :3] = [0.0, -0.0, np.finfo(np.float32).min]
    out = np.asarray(truncate_logits(jnp.asarray(logits), top_k, top_p))
    kept = out > np.finfo(np.float32).min
    reference = np_truncate(logits, top_k, top_p)
    for row in range(len(logits)):  # np_truncate keeps a tie group whole only by chance
        threshold = logits[row][reference[row]].min()
        np.testing.assert_array_equal(kept[row], logits[row] >= threshold, err_msg=f"{row}")


def test_order_keys_sort_like_the_floats():
    values = np.array(
        [np.finfo(np.float32).min, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, np.inf], np.float32
    )
    keys = np.asarray(order_keys(jnp.asarray(values))).astype(np.int64)
    steps = np.diff(keys)
    assert steps[3] == 0  # -0.0 == 0.0
    assert np.all(np.delete(steps, 3) > 0)


@pytest.mark.parametrize("draw", [draw_with_logp_one_pass, draw_with_logp_passes, draw_with_logp])
def test_draw_with_logp_takes_the_first_argmax_and_the_log_softmax_there(draw):
    """Both ways of drawing (the one-pass reduce accelerators compile, the separate passes
    a CPU compiles) against NumPy: scores with many ties (the first wins), masked ids at
    the float's min, a row whose best score sits after its largest logit."""
    rng = np.random.default_rng(3)
    logits = rng.normal(0.0, 4.0, size=(16, 257)).astype(np.float32)
    scores = (rng.integers(-4, 5, size=logits.shape) * 0.5).astype(np.float32)
    logits[1, 100:] = scores[1, 100:] = np.finfo(np.float32).min
    scores[2] = logits[2] - 100.0 * (np.arange(257) < 200)  # the best score is after id 200
    token, logp = jax.jit(draw)(jnp.asarray(logits), jnp.asarray(scores))
    expected = np.argmax(scores, axis=-1)
    np.testing.assert_array_equal(np.asarray(token), expected)
    reference = np_log_softmax(logits.astype(np.float64))[np.arange(16), expected]
    np.testing.assert_allclose(np.asarray(logp), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab", [1, 7, 1000])  # 1000: 32 blocks of 32, the last of 8
def test_inverse_cdf_draws_follow_the_softmax_and_never_a_zero_mass_id(vocab):
    rng = np.random.default_rng(5)
    scores = rng.normal(0.0, 2.0, size=vocab).astype(np.float32)
    scores[rng.random(vocab) < 0.3] = np.finfo(np.float32).min  # truncated or padded ids
    scores[rng.random(vocab) < 0.1] = -np.inf  # a padded id's min over a temperature < 1
    scores[-min(vocab - 1, 40) :] = -np.inf  # whole blocks of them
    scores[0] = 9.0  # a peaked row: one id holds most of the mass
    draws = 40_000
    token, top, total = jax.jit(draw_by_inverse_cdf)(
        jnp.broadcast_to(jnp.asarray(scores), (draws, vocab)), jax.random.key(0)
    )
    expected = np.exp(np_log_softmax(scores.astype(np.float64)))
    counts = np.bincount(np.asarray(token), minlength=vocab)
    assert counts.size == vocab and np.all(counts[expected == 0] == 0)
    big = draws * expected >= 5
    chi2 = ((counts[big] - draws * expected[big]) ** 2 / (draws * expected[big])).sum()
    assert chi2 < 2 * big.sum() + 20
    np.testing.assert_allclose(np.asarray(top), scores.max())
    np.testing.assert_allclose(np.asarray(total), np.exp(scores - scores.max()).sum(), rtol=1e-5)


def test_a_tempered_padded_vocabulary_samples_finite_log_probs(setup):
    """Ids past the vocab limit are masked at the float's min, which a temperature below
    1 takes to -inf: whole blocks of such ids must not turn the draw into NaN."""
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.5, vocab_limit=CFG.vocab_size // 3)
    gen = generate(setup, sampling, next(iter(EOS_BIAS)))
    assert np.all(np.isfinite(gen.token_logp)) and gen.tokens.max() < CFG.vocab_size // 3


def test_block_masses_in_one_pass_equal_the_two_passes():
    """The one-pass reduce accelerators compile against the max and sum a CPU compiles,
    a block of ids at the float's min (all masked) included."""
    rng = np.random.default_rng(4)
    blocks = rng.normal(0.0, 4.0, size=(3, 5, 37)).astype(np.float32)
    blocks[1, 2] = blocks[2, 4, 30:] = np.finfo(np.float32).min
    one_pass = jax.jit(block_masses_one_pass)(jnp.asarray(blocks))
    passes = jax.jit(block_masses_passes)(jnp.asarray(blocks))
    np.testing.assert_array_equal(np.asarray(one_pass[0]), blocks.max(-1))
    np.testing.assert_allclose(np.asarray(one_pass[1]), np.asarray(passes[1]), rtol=1e-5)


def test_truncate_logits_off_is_identity():
    logits = np.random.default_rng(1).normal(size=(3, 9)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(truncate_logits(jnp.asarray(logits), 0, 1.0)), logits)


# ----------------------------------------------------------------------------------------
# 6. Empirical distribution of a single sampling step.
# ----------------------------------------------------------------------------------------

NUM_DRAWS = 4000


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(max_new_tokens=1, temperature=0.7),
        SamplingConfig(max_new_tokens=1, temperature=1.3, top_k=6, top_p=0.9),
    ],
    ids=["t0.7", "t1.3_topk_topp"],
)
def test_sampling_frequencies_match_tempered_softmax(setup, sampling):
    row = 1
    prompt_tokens = np.repeat(setup["prompt_tokens"][row : row + 1], NUM_DRAWS, axis=0)
    prompt_mask = np.repeat(setup["prompt_mask"][row : row + 1], NUM_DRAWS, axis=0)
    gen = generate(setup, sampling, "no_eos", seed=11, prompts=(prompt_tokens, prompt_mask))
    counts = np.bincount(gen.tokens[:, 0], minlength=CFG.vocab_size)

    logits = last_logits(setup, "no_eos", setup["prompt_tokens"][row : row + 1], prompt_mask[:1])
    tempered = logits[0] / sampling.temperature
    keep = np_truncate(tempered[None], sampling.top_k, sampling.top_p)[0]
    expected = np.exp(np_log_softmax(np.where(keep, tempered, -np.inf)))
    assert expected.max() < 0.6 and (expected > 0.02).sum() >= 4  # not degenerate

    assert np.all(counts[~keep] == 0)
    freq = counts / NUM_DRAWS
    stderr = np.sqrt(expected * (1 - expected) / NUM_DRAWS)
    assert np.all(np.abs(freq - expected) <= 4.5 * stderr + 1e-3)
    big = NUM_DRAWS * expected >= 5
    chi2 = ((counts[big] - NUM_DRAWS * expected[big]) ** 2 / (NUM_DRAWS * expected[big])).sum()
    assert chi2 < 3 * big.sum() + 20

    # Power check: the untempered, untruncated softmax is clearly rejected.
    wrong = np.exp(np_log_softmax(logits[0]))
    chi2_wrong = (((counts - NUM_DRAWS * wrong) ** 2) / (NUM_DRAWS * wrong)).sum()
    assert chi2_wrong > 10 * chi2


# ----------------------------------------------------------------------------------------
# 7. SamplingConfig validation.
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=-3), "max_new_tokens"),
        (dict(max_new_tokens=4, temperature=0.0), "temperature"),
        (dict(max_new_tokens=4, temperature=-1.0), "temperature"),
        (dict(max_new_tokens=4, top_p=0.0), "top_p"),
        (dict(max_new_tokens=4, top_p=1.5), "top_p"),
        (dict(max_new_tokens=4, top_p=-0.2), "top_p"),
        (dict(max_new_tokens=4, top_k=-1), "top_k"),
    ],
)
def test_sampling_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_sampling_config_valid_edge_cases():
    assert SamplingConfig(max_new_tokens=1, temperature=0.0, greedy=True).greedy
    assert SamplingConfig(max_new_tokens=1, top_p=1.0, top_k=0).top_p == 1.0


# ----------------------------------------------------------------------------------------
# 8. response_mask.
# ----------------------------------------------------------------------------------------


def test_response_mask_on_hand_written_rows():
    tokens = np.array(
        [
            [5, 2, 7, 2],  # EOS in the middle, a second EOS later
            [2, 1, 1, 1],  # EOS first
            [5, 6, 7, 8],  # no EOS
            [5, 6, 7, 2],  # EOS last
            [2, 2, 2, 2],  # only EOS
            [1, 1, 1, 1],  # only padding ids, no EOS: all counted
        ],
        np.int32,
    )
    expected = np.array(
        [
            [1, 1, 0, 0],
            [1, 0, 0, 0],
            [1, 1, 1, 1],
            [1, 1, 1, 1],
            [1, 0, 0, 0],
            [1, 1, 1, 1],
        ],
        np.float32,
    )
    out = np.asarray(response_mask(jnp.asarray(tokens), EOS))
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("greedy", [False, True])
def test_ids_past_the_vocab_limit_are_never_drawn(setup, greedy):
    """A model whose embedding is padded past the tokenizer's vocabulary (e.g. Pythia)."""
    limit = CFG.vocab_size // 2
    sampling = SamplingConfig(max_new_tokens=8, temperature=2.0, greedy=greedy, vocab_limit=limit)
    name = next(iter(EOS_BIAS))
    drawn = np.concatenate([generate(setup, sampling, name, seed=seed).tokens for seed in range(4)])
    assert drawn.max() < limit
    unlimited = SamplingConfig(max_new_tokens=8, temperature=2.0, greedy=greedy)
    assert generate(setup, unlimited, name).tokens.max() >= limit  # the limit did something


def test_chunked_scoring_equals_whole_batch_scoring(setup):
    gen = generate(setup, SAMPLED_07, "some_eos")
    rows = gen.tokens.shape[0]
    divisor = next(d for d in range(2, rows + 1) if rows % d == 0)
    whole = score(setup, 0.7, "some_eos", gen)
    chunked_fn = make_score_fn(setup["model"], temperature=0.7, rows_per_chunk=rows // divisor)
    args = (setup["prompt_tokens"], setup["prompt_mask"], gen.tokens, gen.mask)
    chunked = np.asarray(chunked_fn(setup["params"]["some_eos"], *args))
    np.testing.assert_allclose(chunked, whole, rtol=TOL, atol=TOL)  # float32 reordering
    with pytest.raises(ValueError, match="rows_per_chunk"):
        make_score_fn(setup["model"], temperature=0.7, rows_per_chunk=rows + 1)(
            setup["params"]["some_eos"], *args
        )
