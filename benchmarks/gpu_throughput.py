r"""Decode, scoring and learner-step throughput of tba_jax on one accelerator.

    python benchmarks/gpu_throughput.py --shape=qwen2.5-0.5b --batch=256 --prompt=256 --new=256

Random weights with a real architecture's shape (a preset), bfloat16 (`--dtype`: the
compute dtype, and the decode and scoring params' unless `--param_dtype` says otherwise:
float32 is what a run's searchers and π_ref hold; the learner keeps float32 params and
Adam state). Decoding samples
exactly `--new` tokens per row at temperature 0.7 (EOS is an id that is never drawn, as
transformers' `min_new_tokens` forces in ../shared/bench/hf_generate_baseline.py, the peer
figure to run in the same command). Scoring is the searcher's π_ref pass; the learner step
is a full TB step (forward, backward over `--microbatches`, AdamW) on B×K sequences;
`--pairs=N` also times a reward model's Bradley–Terry step on N preference pairs of
prompt + new tokens (`experiments/train_reward_model.py`'s step, the shape with a scalar
head), with the device's peak memory beside what `static_profile.py --program=reward_model`
plans.
Prints one JSON line per measurement: the median of `--repeats` timed runs after a
compiling warm-up, with tokens/s; for decode, the memory-bound roofline at `--hbm_tb_s`
(`tba_jax.roofline`: the weights and each row's KV cache read once a step) and the share
of it reached; for the learner, model FLOP utilisation against `--peak_tflops` (dense
bf16), with the FLOPs per token written out. Unset, both are the device's datasheet
figures (`roofline.DEVICE_PEAKS`: H100, H200, A100, TPU v4-v6e; an H100 SXM's for another
device), named in the first line's `peaks`. `--layers` changes the preset's depth, and
`--scan_layers`, `--scan_decode`, `--remat`, `--attention`, `--decode_attention`,
`--decode_kernel`, `--decode_mlp`, `--decode_mlp_kernel`, `--decode_projection`,
`--decode_projection_kernel`, `--decode_qkv`, `--decode_qkv_kernel` and `--logprob_chunk`
set those execution knobs
(`benchmarks/static_profile.py` gives each one's MFU ceiling; decode reports its compile
seconds, `compile_s`, lowered and compiled ahead of the first run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from tba_jax import cli, device_trace, learner, roofline, run_totals, train_reward_model
from tba_jax import mesh as mesh_lib
from tba_jax.models import compute_dtype_cast, init_model, preset
from tba_jax.models.config import (
    ATTENTIONS,
    REMAT_POLICIES,
)
from tba_jax.sampling.generate import SamplingConfig, make_generate_fn
from tba_jax.sampling.scoring import make_score_fn

TEMPERATURE = 0.7
BETA = 0.05  # the TB loss's β, held constant
LEARNING_RATE = 1e-6
PROGRAMS = ("decode", "score", "train")  # what --skip may leave out
# The integer flags' smallest values (None: unset allowed where the default is None).
MINIMUMS = {
    "batch": 1,
    "prompt": 1,
    "new": 1,
    "train_prompts": 1,
    "train_k": 1,
    "microbatches": 1,
    "repeats": 1,
    "score_rows_per_chunk": 0,
    "layers": 1,
    "logprob_chunk": 0,
    "decode_segments": 1,
    "pairs": 0,
    "vocab": 2,
    "profile": 0,
}


def timed(fn, repeats: int) -> tuple[float, list[float]]:
    """(compile + first run seconds, per-run seconds of `repeats` more runs)."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return first, times


def report(name: str, first: float, times: list[float], **figures) -> None:
    median = statistics.median(times)
    line = {"bench": name, "median_s": round(median, 4), "first_call_s": round(first, 2)}
    line.update({k: (round(v, 1) if isinstance(v, float) else v) for k, v in figures.items()})
    line["runs_s"] = [round(t, 4) for t in times]
    peak = run_totals.peak_device_gib()  # accelerators report it; the process's peak so far
    if peak is not None:
        line["peak_device_gib"] = peak
    print(json.dumps(line), flush=True)


def profile(name: str, fn, top: int) -> None:
    """One more run of `fn` under `jax.profiler.trace`: its kernel time by HLO op, a JSON line."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(fn())
        summary = device_trace.kernel_summary(trace_dir, top)
    if not summary["kernels"]:
        summary["note"] = (
            f"the trace has no device kernels (JAX's platform here is {jax.default_backend()}, "
            "whose trace has no device plane): profile on a GPU"
        )
    print(json.dumps({"bench": f"{name}_profile", **summary}), flush=True)


def random_prompts(rng: np.random.Generator, batch: int, length: int, vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, size=(batch, length), dtype=np.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--train_prompts", type=int, default=8, help="B")
    parser.add_argument("--train_k", type=int, default=20, help="K")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--score_rows_per_chunk", type=int, default=0, help="0: all rows")
    parser.add_argument(
        "--peak_tflops", type=float, default=None, help="dense bf16 (unset: the device's)"
    )
    parser.add_argument(
        "--hbm_tb_s", type=float, default=None, help="HBM TB/s (unset: the device's)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--param_dtype",
        default=None,
        choices=["bfloat16", "float32"],
        help="decode and score params (unset: --dtype)",
    )
    parser.add_argument("--layers", type=int, default=None, help="the preset's depth if unset")
    parser.add_argument("--scan_layers", action="store_true", help="model.scan_layers")
    parser.add_argument("--remat", default="none", choices=REMAT_POLICIES, help="model.remat")
    parser.add_argument("--attention", default="einsum", choices=ATTENTIONS, help="model.attention")
    cli.add_decode_kernel_arguments(parser)
    parser.add_argument("--logprob_chunk", type=int, default=0, help="model.logprob_chunk")
    parser.add_argument("--scan_decode", action="store_true", help="model.scan_decode")
    parser.add_argument("--decode_segments", type=int, default=1, help="sampling.decode_segments")
    parser.add_argument("--skip", default="", help="comma list of decode,score,train")
    parser.add_argument(
        "--pairs", type=int, default=0, help="> 0: also time a reward-model step on N pairs"
    )
    parser.add_argument("--vocab", type=int, default=None, help="for presets without one")
    parser.add_argument(
        "--profile", type=int, default=0, help="> 0: also trace one run, print its N top ops"
    )
    args = parser.parse_args()
    try:
        skip = checked_skip(args)
    except cli.UsageError as error:
        cli.exit_with_error(str(error))

    peaks = fill_in_peaks(args)
    print(
        json.dumps(
            {"devices": [str(d) for d in jax.devices()], "jax": jax.__version__, "peaks": peaks}
        )
    )
    rng = np.random.default_rng(0)
    total = args.prompt + args.new
    sizes = dict(max_seq_len=total, vocab_size=args.vocab)
    if args.layers:
        sizes["num_layers"] = args.layers
    execution = execution_fields(args)
    param_dtype = args.param_dtype or args.dtype
    decoder = preset(args.shape, dtype=args.dtype, param_dtype=param_dtype, **sizes, **execution)
    dtype_bytes = jnp.dtype(args.dtype).itemsize
    vocab = decoder.vocab_size
    model, params = init_model(decoder, seed=0)
    params = jax.device_put(params)
    num_params = sum(x.size for x in jax.tree.leaves(params))
    prompts = jnp.asarray(random_prompts(rng, args.batch, args.prompt, vocab - 1))
    prompt_mask = jnp.ones_like(prompts, dtype=bool)

    if "decode" not in skip:
        # EOS = the last id, which vocab_limit keeps from ever being drawn: every row decodes
        # exactly --new tokens.
        sampling = SamplingConfig(
            max_new_tokens=args.new,
            temperature=TEMPERATURE,
            vocab_limit=vocab - 1,
            decode_segments=args.decode_segments,
        )
        generate = make_generate_fn(model, sampling, eos_id=vocab - 1, pad_id=0)
        key = jax.random.key(0)
        began = time.perf_counter()
        generate = generate.lower(params, prompts, prompt_mask, key).compile()
        compile_s = time.perf_counter() - began
        first, times = timed(lambda: generate(params, prompts, prompt_mask, key), args.repeats)
        out = generate(params, prompts, prompt_mask, key)
        assert int(out.lengths.min()) == args.new, "a row stopped early"
        tokens_per_s = args.batch * args.new / statistics.median(times)
        shape = (decoder, args.batch, args.prompt, args.new, dtype_bytes, dtype_bytes)
        ceiling = roofline.decode_roofline_tokens_per_s(*shape, args.hbm_tb_s * 1e12)
        report(
            "decode",
            first,
            times,
            shape=args.shape,
            params=num_params,
            layers=decoder.num_layers,
            scan_layers=decoder.scan_layers,
            scan_decode=decoder.scan_decode,
            decode_segments=args.decode_segments,
            attention=decoder.attention,
            decode_attention=decoder.decode_attention,
            decode_kernel=decoder.decode_kernel_settings.spec(),
            decode_mlp=decoder.decode_mlp,
            decode_mlp_kernel=decoder.decode_mlp_kernel_settings.spec(),
            decode_projection=decoder.decode_projection,
            decode_projection_kernel=decoder.decode_projection_kernel_settings.spec(),
            decode_qkv=decoder.decode_qkv,
            decode_qkv_kernel=decoder.decode_qkv_kernel_settings.spec(),
            param_dtype=param_dtype,
            batch=args.batch,
            prompt=args.prompt,
            new=args.new,
            compile_s=compile_s,
            tokens_per_s=tokens_per_s,
            step_bytes=roofline.decode_step_bytes(*shape),
            roofline_tokens_per_s=ceiling,
            roofline_percent=100 * tokens_per_s / ceiling,
        )
        if args.profile:
            profile("decode", lambda: generate(params, prompts, prompt_mask, key), args.profile)

    responses = jnp.asarray(random_prompts(rng, args.batch, args.new, vocab - 1))
    response_mask = jnp.ones(responses.shape, jnp.float32)
    if "score" not in skip:
        score = make_score_fn(
            model, temperature=TEMPERATURE, rows_per_chunk=args.score_rows_per_chunk
        )
        run_score = lambda: score(params, prompts, prompt_mask, responses, response_mask)
        first, times = timed(run_score, args.repeats)
        report(
            "score",
            first,
            times,
            batch=args.batch,
            param_dtype=param_dtype,
            rows_per_chunk=args.score_rows_per_chunk,
            tokens_per_s=args.batch * total / statistics.median(times),
        )
        if args.profile:
            profile("score", run_score, args.profile)
    params = (
        None  # the decode params freed before the learner steps (the closures above keep the name)
    )

    if "train" not in skip:
        mixed = preset(args.shape, dtype=args.dtype, param_dtype="float32", **sizes, **execution)
        measure_train_step(args, mixed, rng)
    if args.pairs:
        mixed = preset(args.shape, dtype=args.dtype, param_dtype="float32", **sizes, **execution)
        measure_reward_model_step(args, train_reward_model.scalar_score_config(mixed), rng)


def fill_in_peaks(args) -> dict:
    """Sets --hbm_tb_s and --peak_tflops the flags leave unset to the device's datasheet
    figures (`roofline.peaks_for`), and says which were used and where from."""
    peaks = roofline.peaks_for(jax.devices()[0].device_kind, args.hbm_tb_s, args.peak_tflops)
    args.hbm_tb_s = peaks.hbm_bytes_per_s / 1e12
    args.peak_tflops = peaks.dense_bf16_flops / 1e12
    return {"hbm_tb_s": args.hbm_tb_s, "peak_tflops": args.peak_tflops, "source": peaks.name}


def execution_fields(args) -> dict:
    """The model's execution knobs as the flags set them."""
    return cli.execution_flags(lambda name: getattr(args, name))


def checked_skip(args) -> set[str]:
    """The programs --skip leaves out; UsageError, before any work, for an unknown one, an
    integer flag below its minimum, a --shape that is no preset or has no vocabulary
    without --vocab, knobs the model refuses, and cuDNN's attention without a GPU."""
    skip = set(filter(None, args.skip.split(",")))
    unknown = sorted(skip - set(PROGRAMS))
    if unknown:
        raise cli.UsageError(f"--skip={args.skip} names {unknown}; choose from {list(PROGRAMS)}.")
    for name, minimum in MINIMUMS.items():
        value = getattr(args, name)
        if value is not None and value < minimum:
            raise cli.UsageError(f"--{name}={value} must be >= {minimum}.")
    cli.check_preset_flags(args.shape, args.vocab)
    try:
        preset(
            args.shape,
            dtype=args.dtype,
            vocab_size=args.vocab,
            num_layers=args.layers,
            **execution_fields(args),
        )
    except ValueError as error:
        raise cli.UsageError(str(error)) from error
    if args.attention == "cudnn":
        cli.check_cudnn_backend(
            "--attention=cudnn", "pass another --attention (dot_product, einsum)."
        )
    return skip


def new_train_state(mixed):
    """(model, optimizer, float32 params + Adam state of `mixed` on one device, its shardings,
    the one-device mesh)."""
    model, params = init_model(mixed, seed=0)
    optimizer = learner.make_optimizer(learner.OptimConfig(learning_rate=LEARNING_RATE))
    return model, optimizer, *learner.one_device_train_state(model, params, optimizer)


def timed_steps(step, state, batch: dict, mesh, repeats: int):
    """(first, times, run_step, holder): `step(state, batch)` timed with the host `batch`
    placed on `mesh`'s batch sharding, the newest state in holder["state"] (each step
    donates the one before)."""
    batch = jax.device_put(batch, mesh_lib.batch_sharding(mesh))
    holder = {"state": state}

    def run_step():
        holder["state"], metrics = step(holder["state"], batch)
        return metrics

    first, times = timed(run_step, repeats)
    return first, times, run_step, holder


def step_figures(mixed, rows: int, seq_len: int, median: float, peak_tflops: float) -> dict:
    """Tokens/s, FLOPs per token (6·params + attention, written out) and MFU of a learner
    step on `rows` sequences of `seq_len` tokens that took `median` seconds."""
    tokens = rows * seq_len
    flops_per_token = roofline.train_flops_per_token(mixed, seq_len)
    flops = tokens * flops_per_token
    return {
        "remat": mixed.remat,
        "attention": mixed.attention,
        "tokens_per_s": tokens / median,
        "flops_per_token": flops_per_token,
        "model_tflops_per_s": flops / median / 1e12,
        "mfu_percent": 100 * flops / median / 1e12 / peak_tflops,
    }


def measure_train_step(args, mixed, rng: np.random.Generator) -> None:
    """A full TB step (forward, backward over --microbatches, AdamW) on B×K sequences, then
    a publish of its params."""
    model, optimizer, state, state_sharding, mesh = new_train_state(mixed)
    step = learner.constant_beta_tb_step(
        model,
        optimizer,
        state_sharding,
        mesh,
        beta=BETA,
        samples_per_prompt=args.train_k,
        num_microbatches=args.microbatches,
        temperature=TEMPERATURE,
    )
    n, vocab = args.train_prompts * args.train_k, mixed.vocab_size
    batch = {
        "prompt_tokens": random_prompts(rng, n, args.prompt, vocab - 1),
        "prompt_mask": np.ones((n, args.prompt), bool),
        "response_tokens": random_prompts(rng, n, args.new, vocab - 1),
        "response_mask": np.ones((n, args.new), np.float32),
        "reward": rng.random(n).astype(np.float32),
        "logp_ref": -rng.random(n).astype(np.float32) * 100,
        "logp_behaviour": -rng.random(n).astype(np.float32) * 100,
    }
    first, times, run_step, holder = timed_steps(step, state, batch, mesh, args.repeats)
    median = statistics.median(times)
    report(
        "train_step",
        first,
        times,
        sequences=n,
        seq_len=args.prompt + args.new,
        microbatches=args.microbatches,
        scan_layers=mixed.scan_layers,
        logprob_chunk=mixed.logprob_chunk,
        **step_figures(mixed, n, args.prompt + args.new, median, args.peak_tflops),
    )
    if args.profile:
        profile("train_step", run_step, args.profile)
    time_publish(holder, run_step, median, args.repeats, compute_dtype_cast(mixed))


def measure_reward_model_step(args, scorer, rng: np.random.Generator) -> None:
    """A reward model's Bradley–Terry step (`train_reward_model.make_train_step`: chosen and
    rejected rows of prompt + new tokens, --microbatches, AdamW) on --pairs pairs, with the
    device's peak memory: what `static_profile.py --program=reward_model` plans."""
    model, optimizer, state, state_sharding, mesh = new_train_state(scorer)
    step = train_reward_model.make_train_step(
        model,
        optimizer,
        num_microbatches=args.microbatches,
        state_sharding=state_sharding,
        mesh=mesh,
    )
    seq_len = args.prompt + args.new
    shape = (args.pairs, seq_len)
    batch = {
        "chosen_tokens": random_prompts(rng, *shape, scorer.vocab_size),
        "chosen_mask": np.ones(shape, bool),
        "rejected_tokens": random_prompts(rng, *shape, scorer.vocab_size),
        "rejected_mask": np.ones(shape, bool),
    }
    first, times, _, _ = timed_steps(step, state, batch, mesh, args.repeats)
    median = statistics.median(times)
    report(
        "reward_model_step",
        first,
        times,
        pairs=args.pairs,
        seq_len=seq_len,
        microbatches=args.microbatches,
        **step_figures(scorer, 2 * args.pairs, seq_len, median, args.peak_tflops),
    )


def time_publish(holder: dict, run_step, step_s: float, repeats: int, cast) -> None:
    """A publish (`mesh.publish` of the learner's params onto sampler shardings through
    `cast`, the weights in the compute dtype: here the same device, a copy into new
    buffers, as a colocated run makes) on its own, and a learner step with one publish
    started beside it (the copy overlapping the step), each as a share of a plain step's
    `step_s`."""
    params = holder["state"].params
    shardings = jax.tree.map(lambda leaf: leaf.sharding, params)

    def publish():
        return mesh_lib.publish(holder["state"].params, shardings, cast)

    first, alone = timed(publish, repeats)

    def step_with_publish():
        published = publish()
        return run_step(), published

    _, overlapped = timed(step_with_publish, repeats)
    report(
        "publish",
        first,
        alone,
        param_gib=sum(x.nbytes for x in jax.tree.leaves(params)) / 2**30,
        share_of_step_percent=100 * statistics.median(alone) / step_s,
        step_with_publish_ms=1e3 * statistics.median(overlapped),
        overlapped_cost_percent=100 * (statistics.median(overlapped) - step_s) / step_s,
    )


if __name__ == "__main__":
    main()
