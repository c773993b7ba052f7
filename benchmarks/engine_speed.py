r"""Scored samples per second: batch-then-score against the fused slot engine, same decode width.

    python benchmarks/engine_speed.py                      # tiny model, W=64 slots, S=4
    python benchmarks/engine_speed.py --mixes=long_tailed --eos_bias=2.0 --repeats=5
    python benchmarks/engine_speed.py --smoke              # seconds on CPU: it runs, no more

Both paths make and score `--prompts` × S samples (S = `--samples_per_prompt`) with the
same random-weight model as the policy and as π_ref, the same jitted `score_fn`
(`sampling.scoring.make_score_fn`) and the same cheap host reward (the share of digits in
the response text), at the same decode width W (`--width`):

- batch: `runtime.SearchWorker.search` over the prompts in calls of W / S prompts, each
  call generating W rows with `generate.make_generate_fn` (one jitted prefill + decode
  loop that runs until the call's longest response ends), then scoring them;
- fused: one `fused.FusedSearchWorker.search` over all the prompts with a
  `sampling.engine.SlotEngine` of W slots (`--chunk_steps`, `--tail_chunk_steps`,
  `--prefill_prompts`, `--refill_free`, `--compact_below`, `--min_width`,
  `--compact_min_steps`), scoring
  finished samples in groups of `--score_rows` × 4^i while decoding goes on.

Response lengths come from the model's EOS logit. Residual dimension 0 is made a constant
(embedding column 0 = `CARRIER_PER_ROOT_D` × sqrt(d_model); no attention or MLP output
writes to it), so it dominates every RMSNorm's scale: after the final norm it is about
sqrt(d_model) at every position, and lm_head[0, EOS] = bias / sqrt(d_model) adds about
`bias` nats to the EOS logit everywhere, while the other logits of the random
init_std=0.02 model stay near 0. (With a carrier of 3, as this script had until
2026-11-27, a 22-layer rho-1b's residual outgrew it: the EOS logit ended near 0 at a bias
of -50, so the `uniform` mix was not uniform.) Two length mixes:

- `long_tailed`: bias `--eos_bias`; every step ends a response with about the same
  probability, so lengths are geometric: most responses are short and a few run to
  `--max_new_tokens`. A batch call decodes until its longest row ends, so most of its
  slot-steps go to rows that have already ended; the slot engine refills those slots;
- `uniform`: bias `--no_eos_bias` (EOS never drawn): every response runs to
  `--max_new_tokens`. There is nothing to refill, so this measures the engine's overhead
  (a host round trip per decode chunk, prefill calls) against one jitted loop.

For each mix, both paths first run untimed over all the prompts, compiling their shapes
(the fused path again, up to `WARMUP_FUSED_RUNS` times, while a run still compiles: its
prefill and scoring shapes follow the traffic; `compiles_while_timing` counts any
compilation the timed runs still hit, e.g. a tail-compaction width the warm-up did not
reach), then `--repeats` timed runs of each,
alternating. samples/s is a run's samples over its wall seconds; figures are medians over
the repeats. Per mix and path: samples/s and fused / batch (`fused_over_batch`, of the
medians; `fused_over_batch_paired`, the median of each repeat's ratio), response
lengths (mean, max, share at the limit), decode work as slot-steps (width × decode steps,
summed over calls or chunks) and occupancy (the share of slot-steps that produced a token;
the engine's `counters.occupancy`), the engine's decode chunks, prefill calls and tail
compactions, each worker's `TimeSplit` "generating" / "scoring" seconds, and
`cpu_ms_per_sample`: the process's CPU time (every thread's, XLA's included) per scored
sample, what a path takes from a learner that shares the CPU.
`decode_work_ratio` = batch slot-steps / engine slot-steps: the speed-up that decode work
alone would give.

Reading the split: the batch worker blocks on generation, then scores, so its two figures
are device time. The fused worker's π_ref scoring runs on the device behind the decode
chunks, so its device time shows in "generating" (waits on the next chunk) and its
"scoring" is host time only. The batch path scores every sample at the full
`--max_new_tokens` width, the fused path each group at the smallest of four length buckets
that holds it (`search.score_length_buckets`' default, none under `--bucket_min_tokens`);
what scoring is left bounds
the speed-up where the device cannot run it alongside decoding, as on a CPU, whose cores
do both.

`--attention`, `--decode_attention`, `--decode_mlp`, `--decode_projection` and
`--decode_qkv` (and their kernels' settings) set the model's kernels for both paths (e.g.
`--attention=cudnn --decode_attention=pallas` on a GPU: the Pallas kernel stops at each
slot's last visible cache slot, where cuDNN's reads the whole cache).

The last stdout line is JSON: {"benchmark": "engine_speed", "mixes": {mix: {"batch": {...},
"fused": {...}, "fused_over_batch", ...}}, then the settings and the device}. Run it on a
quiet machine: every figure is a wall-clock time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from tba_jax import cli
from tba_jax.fused import FusedSearchWorker
from tba_jax.metrics import RateMeter, TimeSplit
from tba_jax.models import PRESETS, init_model, preset
from tba_jax.models.config import ATTENTIONS
from tba_jax.models.tokenizers import PRINTABLE_ASCII, CharTokenizer
from tba_jax.runtime import SearchWorker
from tba_jax.sampling.engine import EngineConfig, EngineCounters, SlotEngine
from tba_jax.sampling.generate import SamplingConfig, make_generate_fn
from tba_jax.sampling.scoring import make_score_fn
from tba_jax.trajectories import Trajectory

MIXES = ("long_tailed", "uniform")
# --smoke: small enough to compile and run in seconds on a CPU (flags given explicitly win).
SMOKE = dict(
    preset="micro",
    max_prompt_len=8,
    max_new_tokens=16,
    width=8,
    samples_per_prompt=2,
    prompts=8,
    score_rows=4,
    chunk_steps=4,
    min_width=2,
    repeats=1,
    eos_bias=3.0,
)
DIGITS = frozenset("0123456789")
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Untimed fused runs at most, each with its own draws, until one compiles nothing new.
WARMUP_FUSED_RUNS = 3
# Residual dimension 0's constant over sqrt(d_model) (`length_params`): large enough that
# what the layers add to the other dimensions stays negligible beside it. Measured on
# rho-1b in bfloat16 at a bias of -50: the EOS logit came out at +0.5 with a carrier of
# 3, -24.9 with 3 × sqrt(d_model), -49.0 with 30 × and -49.75 with 300 ×.
CARRIER_PER_ROOT_D = 300.0
# EngineConfig's fields that a flag of another name sets (the others are their flags' names).
ENGINE_FLAGS = {"slots": "width"}

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags, defined only when run as a script (tba_jax.cli's rule)."""
    flags.DEFINE_string("preset", "tiny", "Model preset (tba_jax.models.PRESETS).")
    flags.DEFINE_enum(
        "dtype", "float32", ["float32", "bfloat16"], "The model's compute (and params') dtype."
    )
    flags.DEFINE_enum(
        "param_dtype",
        None,
        ["float32", "bfloat16"],
        "The params' dtype (unset: --dtype); float32 with bfloat16 compute is what a run's "
        "searchers and π_ref hold.",
    )
    flags.DEFINE_enum("attention", "einsum", list(ATTENTIONS), "model.attention.")
    cli.define_decode_kernel_flags()
    flags.DEFINE_integer("max_prompt_len", 32, "P: prompt tokens.", lower_bound=1)
    flags.DEFINE_integer("max_new_tokens", 128, "T: the response length limit.", lower_bound=1)
    flags.DEFINE_integer(
        "width", 64, "W: rows per batch call = the engine's decode slots.", lower_bound=1
    )
    flags.DEFINE_integer(
        "samples_per_prompt", 4, "S: samples per prompt (W must be a multiple).", lower_bound=1
    )
    flags.DEFINE_integer(
        "prompts", 64, "Prompts per measurement (a multiple of W / S).", lower_bound=1
    )
    flags.DEFINE_integer(
        "score_rows",
        None,
        "The fused path's π_ref scoring calls take score_rows × 4^i ready samples (default S).",
    )
    flags.DEFINE_integer(
        "chunk_steps", EngineConfig.chunk_steps, "Engine decode steps per chunk (at most)."
    )
    flags.DEFINE_integer(
        "tail_chunk_steps",
        0,
        "Engine decode steps per chunk once no prompt is waiting (0: until the slots are empty "
        "or a compaction can start).",
    )
    flags.DEFINE_integer(
        "prefill_prompts", 0, "Engine: prompts per prefill call (0: every one that fits)."
    )
    flags.DEFINE_float(
        "refill_free", 0.0, "Engine: a chunk returns for a refill once this share is free."
    )
    flags.DEFINE_integer(
        "bucket_min_tokens",
        32,
        "Engine: prefill and scoring length buckets never closer than this many tokens "
        "(search.bucket_min_tokens; 1: four buckets whatever the length).",
        lower_bound=1,
    )
    flags.DEFINE_float("compact_below", 0.5, "Engine tail compaction (0: off).")
    flags.DEFINE_integer("min_width", 8, "Engine: compaction's narrowest width.")
    flags.DEFINE_integer(
        "compact_min_steps", 32, "Engine: compact only a tail that may run this many more steps."
    )
    flags.DEFINE_integer(
        "repeats", 3, "Timed runs of each path per mix (medians are reported).", lower_bound=1
    )
    flags.DEFINE_integer("seed", 0, "Model init, prompts and sampling.")
    flags.DEFINE_list("mixes", list(MIXES), f"Length mixes to measure, of {MIXES}.")
    flags.DEFINE_float(
        "eos_bias",
        1.0,
        "long_tailed: about the EOS logit's lead over the other ~97 near-0 logits (nats). "
        "1.0: mean length ~40 of 128, ~4% of responses at the limit.",
    )
    flags.DEFINE_float("no_eos_bias", -50.0, "uniform: EOS logit bias (never drawn).")
    flags.DEFINE_boolean("smoke", False, f"Tiny sizes, one repeat: {SMOKE}.")
    flags.adopt_module_key_flags(cli)


@dataclasses.dataclass(frozen=True)
class Settings:
    preset: str
    dtype: str
    param_dtype: str | None
    attention: str
    decode_attention: str
    decode_kernel: str
    decode_mlp: str
    decode_mlp_kernel: str
    decode_projection: str
    decode_projection_kernel: str
    decode_qkv: str
    decode_qkv_kernel: str
    max_prompt_len: int
    max_new_tokens: int
    width: int
    samples_per_prompt: int
    prompts: int
    score_rows: int
    chunk_steps: int
    tail_chunk_steps: int
    prefill_prompts: int
    refill_free: float
    bucket_min_tokens: int
    compact_below: float
    min_width: int
    compact_min_steps: int
    repeats: int
    seed: int
    mixes: tuple[str, ...]
    eos_bias: float
    no_eos_bias: float
    smoke: bool

    @property
    def prompts_per_call(self) -> int:
        """The batch path's prompts per `SearchWorker.search` call: W rows of S samples."""
        return self.width // self.samples_per_prompt


def read_settings() -> Settings:
    """The flags, with --smoke's sizes for those not given explicitly; UsageError on a
    combination the measurement cannot run."""
    values = {
        name: getattr(FLAGS, name)
        for name in (
            "preset",
            "dtype",
            "param_dtype",
            "attention",
            "decode_attention",
            "decode_kernel",
            "decode_mlp",
            "decode_mlp_kernel",
            "decode_projection",
            "decode_projection_kernel",
            "decode_qkv",
            "decode_qkv_kernel",
            "max_prompt_len",
            "max_new_tokens",
            "width",
            "samples_per_prompt",
            "prompts",
            "score_rows",
            "chunk_steps",
            "tail_chunk_steps",
            "prefill_prompts",
            "refill_free",
            "bucket_min_tokens",
            "compact_below",
            "min_width",
            "compact_min_steps",
            "repeats",
            "seed",
            "eos_bias",
            "no_eos_bias",
            "smoke",
        )
    }
    if FLAGS.smoke:
        values.update({k: v for k, v in SMOKE.items() if not FLAGS[k].present})
    if values["score_rows"] is None:
        values["score_rows"] = values["samples_per_prompt"]
    settings = Settings(mixes=tuple(FLAGS.mixes), **values)
    unknown = sorted(set(settings.mixes) - set(MIXES))
    if unknown or not settings.mixes:
        raise cli.UsageError(f"--mixes={','.join(settings.mixes)}: choose from {MIXES}.")
    if settings.width % settings.samples_per_prompt:
        raise cli.UsageError(
            f"--width={settings.width} is not a multiple of "
            f"--samples_per_prompt={settings.samples_per_prompt}: the batch path's calls "
            "hold W / S whole prompts."
        )
    if settings.prompts % settings.prompts_per_call:
        raise cli.UsageError(
            f"--prompts={settings.prompts} is not a multiple of W / S = "
            f"{settings.prompts_per_call} (the batch path's prompts per call; a smaller last "
            "call would compile a second shape)."
        )
    if settings.score_rows < 1:
        raise cli.UsageError(f"--score_rows={settings.score_rows} must be >= 1.")
    for name in ("eos_bias", "no_eos_bias"):  # an EOS logit of nan or inf samples no token
        if not math.isfinite(getattr(settings, name)):
            raise cli.UsageError(f"--{name}={getattr(settings, name)} must be a finite number.")
    engine_config(settings)  # its flags checked before any work
    model_config(settings, vocab_size=2)
    if settings.attention == "cudnn":
        cli.check_cudnn_backend(
            "--attention=cudnn", "pass another --attention (dot_product, einsum)."
        )
    return settings


def model_config(settings: Settings, vocab_size: int):
    """The preset's config with the flags' dtypes and attention kernels; UsageError for a
    combination the model refuses (cuDNN's attention in float32)."""
    if settings.preset not in PRESETS:
        raise cli.UsageError(f"--preset={settings.preset}: choose one of {sorted(PRESETS)}.")
    sequence = settings.max_prompt_len + settings.max_new_tokens
    try:
        return preset(
            settings.preset,
            dtype=settings.dtype,
            param_dtype=settings.param_dtype or settings.dtype,
            attention=settings.attention,
            decode_attention=settings.decode_attention,
            decode_kernel=settings.decode_kernel,
            decode_mlp=settings.decode_mlp,
            decode_mlp_kernel=settings.decode_mlp_kernel,
            decode_projection=settings.decode_projection,
            decode_projection_kernel=settings.decode_projection_kernel,
            decode_qkv=settings.decode_qkv,
            decode_qkv_kernel=settings.decode_qkv_kernel,
            vocab_size=vocab_size,
            max_seq_len=max(PRESETS[settings.preset]["max_seq_len"], sequence),
        )
    except ValueError as error:
        raise cli.UsageError(str(error)) from error


def engine_config(settings: Settings) -> EngineConfig:
    """The slot engine's config of `settings`; UsageError naming the flag of a bad value."""
    try:
        config = EngineConfig(
            slots=settings.width,
            chunk_steps=settings.chunk_steps,
            tail_chunk_steps=settings.tail_chunk_steps,
            prefill_prompts=settings.prefill_prompts,
            refill_free=settings.refill_free,
            bucket_min_tokens=settings.bucket_min_tokens,
            compact_below=settings.compact_below,
            min_width=settings.min_width,
            compact_min_steps=settings.compact_min_steps,
        )
        config.check_samples_per_prompt(settings.samples_per_prompt)
    except ValueError as error:
        raise cli.UsageError(as_flags(str(error))) from error
    return config


def as_flags(message: str) -> str:
    """EngineConfig's `message` with its `field=value`s spelt as this script's flags
    (`chunk_steps=0` as `--chunk_steps=0`, `slots=` as `--width=`)."""
    fields = "|".join(field.name for field in dataclasses.fields(EngineConfig))
    return re.sub(
        rf"\b({fields})=", lambda found: f"--{ENGINE_FLAGS.get(found[1], found[1])}=", message
    )


# ---------------------------------------------------------------------------- the setup


def length_params(params: dict, eos_id: int, bias: float) -> dict:
    """`params` whose EOS logit is raised by about `bias` (nats) at every position (see
    the module docstring: residual dimension 0 is a constant after the final norm)."""
    p = jax.tree.map(np.array, params)
    d_model = p["embedding"].shape[1]
    p["embedding"][:, 0] = CARRIER_PER_ROOT_D * math.sqrt(d_model)
    for block in p["blocks"].values():
        block["attn"]["wo"][..., 0] = 0.0
        block["mlp"]["w_down"][:, 0] = 0.0
    p["lm_head"][0, :] = 0.0
    p["lm_head"][0, eos_id] = bias / math.sqrt(d_model)
    return jax.tree.map(jnp.asarray, p)


def make_prompts(settings: Settings) -> list[dict]:
    """`prompts` examples of random printable text, 1/4 to all of max_prompt_len long."""
    rng = np.random.default_rng(settings.seed)
    alphabet = np.asarray(list(PRINTABLE_ASCII))
    longest = settings.max_prompt_len
    lengths = rng.integers(max(1, longest // 4), longest + 1, size=settings.prompts)
    return [
        {"id": i, "prompt": "".join(rng.choice(alphabet, size=length))}
        for i, length in enumerate(lengths)
    ]


def digit_share_rewards(examples: list[dict], texts: list[str]) -> np.ndarray:
    """A cheap host reward: the share of digits in each response text. float32 [N]."""
    del examples
    return np.asarray(
        [sum(c in DIGITS for c in text) / max(len(text), 1) for text in texts], np.float32
    )


@dataclasses.dataclass
class Paths:
    """The two workers (built once, so both mixes reuse their compiled functions)."""

    batch: SearchWorker
    fused: FusedSearchWorker
    base_params: dict
    eos_id: int


def build_paths(settings: Settings) -> Paths:
    tokenizer = CharTokenizer.for_text()
    config = model_config(settings, tokenizer.vocab_size)
    model, params = init_model(config, settings.seed)
    sampling = SamplingConfig(max_new_tokens=settings.max_new_tokens)
    ids = dict(eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    shared = dict(
        score_fn=make_score_fn(model, temperature=sampling.temperature),
        reference_params=params,
        tokenizer=tokenizer,
        rewards_fn=digit_share_rewards,
        max_prompt_len=settings.max_prompt_len,
        samples_per_prompt=settings.samples_per_prompt,
        time_split=TimeSplit(),
        rates=RateMeter(),
    )
    engine = SlotEngine(
        model, sampling, engine_config(settings), max_prompt_len=settings.max_prompt_len, **ids
    )
    return Paths(
        batch=SearchWorker(generate_fn=make_generate_fn(model, sampling, **ids), **shared),
        fused=FusedSearchWorker(
            engine=engine,
            score_rows=settings.score_rows,
            bucket_min_tokens=settings.bucket_min_tokens,
            **shared,
        ),
        base_params=params,
        eos_id=tokenizer.eos_id,
    )


# --------------------------------------------------------------------------- measurement


def length_figures(trajectories: list[Trajectory], limit: int) -> dict:
    lengths = np.asarray([t.response_length for t in trajectories])
    return {
        "mean_length": float(lengths.mean()),
        "max_length": int(lengths.max()),
        "share_at_limit": float(np.mean(lengths >= limit)),
    }


def run_batch(paths: Paths, settings: Settings, params, examples, rng) -> dict:
    """The batch path over `examples`, W / S prompts per call: its wall seconds, samples
    and decode work (each call decodes W rows until its longest response ends)."""
    worker, per_call = paths.batch, settings.prompts_per_call
    worker.reference_params, worker.time_split = params, TimeSplit()
    trajectories, decode_steps = [], 0
    start, cpu_start = time.perf_counter(), time.process_time()
    for call in range(len(examples) // per_call):
        batch = examples[call * per_call : (call + 1) * per_call]
        out = worker.search(params, 0, batch, jax.random.fold_in(rng, call))
        decode_steps += max(t.response_length for t in out)
        trajectories += out
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(t.response_length for t in trajectories)
    seconds_by_phase = worker.time_split.totals()
    return {
        "seconds": seconds,
        "cpu_ms_per_sample": 1e3 * cpu_seconds / len(trajectories),
        "samples": len(trajectories),
        "samples_per_s": len(trajectories) / seconds,
        "decode_steps": decode_steps,
        "slot_steps": decode_steps * settings.width,
        "occupancy": tokens / (decode_steps * settings.width),
        "generating_s": seconds_by_phase.get("generating", 0.0),
        "scoring_s": seconds_by_phase.get("scoring", 0.0),
        **length_figures(trajectories, settings.max_new_tokens),
    }


def run_fused(paths: Paths, settings: Settings, params, examples, rng) -> dict:
    """The fused path: one `search` over every prompt; its wall seconds, samples and the
    engine's counters."""
    worker = paths.fused
    worker.reference_params, worker.time_split = params, TimeSplit()
    worker.engine.counters = EngineCounters()
    start, cpu_start = time.perf_counter(), time.process_time()
    trajectories = worker.search(params, 0, examples, rng)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    counters = worker.engine.counters
    seconds_by_phase = worker.time_split.totals()
    return {
        "seconds": seconds,
        "cpu_ms_per_sample": 1e3 * cpu_seconds / len(trajectories),
        "samples": len(trajectories),
        "samples_per_s": len(trajectories) / seconds,
        "decode_steps": counters.decode_steps,
        "slot_steps": counters.slot_steps,
        "occupancy": counters.occupancy,
        "chunks": counters.chunks,
        "prefills": counters.prefills,
        "compactions": counters.compactions,
        "generating_s": seconds_by_phase.get("generating", 0.0),
        "scoring_s": seconds_by_phase.get("scoring", 0.0),
        **length_figures(trajectories, settings.max_new_tokens),
    }


class CompileCounter:
    """Counts XLA compilations (a timed run that compiles is not measuring throughput)."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        del duration, kwargs
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1


def medians(runs: list[dict]) -> dict:
    """Per figure, the median over runs (ints stay ints when the median is whole)."""
    out = {}
    for name in runs[0]:
        value = statistics.median(run[name] for run in runs)
        out[name] = int(value) if isinstance(runs[0][name], int) and value == int(value) else value
    return out


def measure_mix(
    paths: Paths, settings: Settings, mix: str, examples: list[dict], compiles: CompileCounter
) -> dict:
    bias = settings.eos_bias if mix == "long_tailed" else settings.no_eos_bias
    params = length_params(paths.base_params, paths.eos_id, bias)
    rng = jax.random.fold_in(jax.random.key(settings.seed), MIXES.index(mix))
    start = time.perf_counter()  # warm-up: compiles the shapes of both paths
    run_batch(paths, settings, params, examples, jax.random.fold_in(rng, 10_000))
    for attempt in range(WARMUP_FUSED_RUNS):
        compiled = compiles.count
        run_fused(paths, settings, params, examples, jax.random.fold_in(rng, 10_001 + attempt))
        if compiles.count == compiled:
            break
    warmup_s = time.perf_counter() - start
    compiled_before = compiles.count
    batch_runs, fused_runs = [], []
    for repeat in range(settings.repeats):
        key = jax.random.fold_in(rng, repeat)
        batch_runs.append(run_batch(paths, settings, params, examples, key))
        fused_runs.append(run_fused(paths, settings, params, examples, key))
    batch, fused = medians(batch_runs), medians(fused_runs)
    return {
        "eos_bias": bias,
        "batch": batch,
        "fused": fused,
        "fused_over_batch": fused["samples_per_s"] / batch["samples_per_s"],
        # the median of each repeat's fused / batch: the two runs of a repeat are adjacent in
        # time, so this is the steadier figure on a machine whose speed drifts
        "fused_over_batch_paired": statistics.median(
            f["samples_per_s"] / b["samples_per_s"]
            for b, f in zip(batch_runs, fused_runs, strict=True)
        ),
        "decode_work_ratio": batch["slot_steps"] / max(fused["slot_steps"], 1),
        "batch_samples_per_s_runs": [run["samples_per_s"] for run in batch_runs],
        "fused_samples_per_s_runs": [run["samples_per_s"] for run in fused_runs],
        "warmup_s": warmup_s,
        "compiles_while_timing": compiles.count - compiled_before,
    }


# ------------------------------------------------------------------------------- output


def rounded(value, digits: int = 4):
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v, digits) for v in value]
    return value


def table(results: dict) -> str:
    """One row per mix and path: the figures a reader compares."""
    header = (
        f"{'mix':<12} {'path':<6} {'samples/s':>10} {'×batch':>7} {'mean len':>9} "
        f"{'max':>4} {'at limit':>8} {'slot-steps':>10} {'occupancy':>9} {'chunks':>6} "
        f"{'prefills':>8} {'compact':>7} {'gen s':>6} {'score s':>7}"
    )
    lines = [header, "-" * len(header)]
    for mix, result in results.items():
        for path in ("batch", "fused"):
            r = result[path]
            ratio = result["fused_over_batch"] if path == "fused" else 1.0
            extra = (
                f"{r['chunks']:>6} {r['prefills']:>8} {r['compactions']:>7}"
                if path == "fused"
                else f"{'':>6} {'':>8} {'':>7}"
            )
            lines.append(
                f"{mix:<12} {path:<6} {r['samples_per_s']:>10.1f} {ratio:>7.2f} "
                f"{r['mean_length']:>9.1f} {r['max_length']:>4} {r['share_at_limit']:>8.1%} "
                f"{r['slot_steps']:>10} {r['occupancy']:>9.1%} {extra} "
                f"{r['generating_s']:>6.2f} {r['scoring_s']:>7.2f}"
            )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    settings = read_settings()
    paths = build_paths(settings)
    examples = make_prompts(settings)
    compiles = CompileCounter()
    results = {}
    for mix in settings.mixes:
        results[mix] = measure_mix(paths, settings, mix, examples, compiles)
        r = results[mix]
        if r["compiles_while_timing"]:
            print(
                f"warning: {mix}: {r['compiles_while_timing']} compilations during the timed "
                "runs (a shape the warm-up did not reach); its figures include them.",
                flush=True,
            )
        print(
            f"{mix}: batch {r['batch']['samples_per_s']:.1f} samples/s, fused "
            f"{r['fused']['samples_per_s']:.1f} samples/s ({r['fused_over_batch']:.2f}×, "
            f"paired {r['fused_over_batch_paired']:.2f}×; warm-up {r['warmup_s']:.1f} s)",
            flush=True,
        )
    print(table(results), flush=True)
    settings_json = {k: v for k, v in dataclasses.asdict(settings).items() if k != "mixes"}
    line = {
        "benchmark": "engine_speed",
        "mixes": rounded(results),  # in --mixes order
        **settings_json,
        "samples_per_measurement": settings.prompts * settings.samples_per_prompt,
        **cli.machine_fields(),
    }
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
