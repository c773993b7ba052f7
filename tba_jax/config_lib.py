"""Config variants (`get_config("mode=sync,method=rloo,steps=200")`) and validation.

Config files build an `ml_collections.ConfigDict` holding every knob, then call
`apply_variant(config, arg)`. A variant is a comma-separated list of
`key=value`; a key is a dotted path into the config (`optim.learning_rate`)
or one of the config's `shortcuts` (`steps` → `learner_steps`). Values are
parsed to the type of the field they replace.

`validate(config, num_devices)` checks everything that can be checked before
any long work starts and raises `ConfigError` with a one-line message;
`output_dir_problem(path)` says why a folder a run would write cannot be made.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import ml_collections

from tba_jax import config_keys
from tba_jax import mesh as mesh_lib
from tba_jax.critic import CRITIC_INITS, CRITIC_KINDS
from tba_jax.errors import ConfigError  # config_lib.ConfigError: the one users catch
from tba_jax.losses import BETA_SCHEDULE_KINDS, GRPO_AGGREGATIONS, get_loss, registered_losses
from tba_jax.models.config import (
    ATTENTIONS,
    DECODE_KERNEL_KNOBS,
    DTYPES,
    HALF_DTYPES,
    REMAT_POLICIES,
    DecodeKernelKnob,
    off_platform,
)
from tba_jax.replay import DRAW_RULES, PRIORITIES
from tba_jax.sampling.engine import ENGINES

LR_SCHEDULES = ("constant", "linear", "wsd")
MAX_LEARNING_RATE = 1.0  # above this an Adam step moves every weight by more than 1
HF_PATH_KEY = "hf_path"  # a config key naming a Hugging Face folder the run reads


def parse_variant(arg: str | None) -> tuple[list[str], dict[str, str]]:
    """'smoke,a=1,b.c=x' → (['smoke'], {'a': '1', 'b.c': 'x'}). Empty or None → ([], {})."""
    names: list[str] = []
    pairs: dict[str, str] = {}
    for item in (arg or "").split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            names.append(item)
            continue
        key, value = item.split("=", 1)
        pairs[key.strip()] = value.strip()
    return names, pairs


def _convert(value: str, current, key: str):
    if isinstance(current, bool):
        if value.lower() in ("true", "1", "yes"):
            return True
        if value.lower() in ("false", "0", "no"):
            return False
        raise ConfigError(f"{key}={value!r} is not a boolean (true/false).")
    if isinstance(current, int):
        try:
            return int(value)
        except ValueError as e:
            raise ConfigError(f"{key}={value!r} is not an integer.") from e
    if isinstance(current, float):
        try:
            return float(value)
        except ValueError as e:
            raise ConfigError(f"{key}={value!r} is not a number.") from e
    if isinstance(current, str) or current is None:
        return value
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError) as e:
        raise ConfigError(f"{key}={value!r} is not a Python literal.") from e


def _leaf_of(
    config: ml_collections.ConfigDict, path: str, shortcuts: Mapping[str, str] | None = None
) -> tuple[ml_collections.ConfigDict, str, Any]:
    """The section holding the dotted `path` of `config`, its leaf's name and its value;
    ConfigError naming the nearest key (or the nearest of a variant's `shortcuts`) when
    `path` is not one of the config's keys."""
    present, current = config_keys.lookup(config, path)
    if not present or isinstance(current, ml_collections.ConfigDict):
        raise ConfigError(config_keys.unknown_key_message(config, path, shortcuts))
    *sections, leaf = path.split(".")
    node = config
    for part in sections:
        node = node[part]
    return node, leaf, current


def _set_path(
    config: ml_collections.ConfigDict,
    path: str,
    value: str,
    shortcuts: Mapping[str, str] | None = None,
) -> None:
    """Sets the dotted `path` of `config` from text (`_leaf_of` says when it is no key)."""
    node, leaf, current = _leaf_of(config, path, shortcuts)
    with node.ignore_type():
        node[leaf] = _convert(value, current, path)


def _set_reference(
    config: ml_collections.ConfigDict, path: str, reference: ml_collections.FieldReference
) -> None:
    """Points the dotted `path` of `config` (an existing key) at `reference`."""
    node, leaf, _ = _leaf_of(config, path)
    with node.ignore_type():
        node[leaf] = reference


def apply_variant(
    config: ml_collections.ConfigDict,
    arg: str | None,
    shortcuts: Mapping[str, str],
    named: Mapping[str, Mapping[str, Any]] | None = None,
) -> ml_collections.ConfigDict:
    """Applies a variant string to `config` in place and records it in `config.variant`.

    Bare names (`smoke`) select a set of overrides from `named` first; then the
    `key=value` items apply, so `smoke,mode=sync` is the smoke test in sync mode. A named
    variant's value may be a function of the config returning a `FieldReference` (for
    example `config.get_ref("learner_steps") // 2`): the key then follows the keys it
    refers to when later items change them, unless an item sets the key itself.
    """
    named = named or {}
    names, pairs = parse_variant(arg)
    for name in names:
        if name not in named:
            raise ConfigError(
                f"Unknown config variant {name!r}; named variants are {sorted(named)}, "
                "other items must be key=value."
            )
        for key, value in named[name].items():
            if callable(value):
                _set_reference(config, shortcuts.get(key, key), value(config))
            else:
                _set_path(config, shortcuts.get(key, key), str(value))
    for key, value in pairs.items():
        _set_path(config, shortcuts.get(key, key), value, shortcuts)
    config.variant = arg or ""
    return config


@dataclasses.dataclass(frozen=True)
class Allowed:
    """The values a config key may take, and how an error message says so."""

    check: Callable[[Any], bool]
    description: str  # completes "... must be <description>."


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def integer_at_least(low: int) -> Allowed:
    return Allowed(lambda v: _is_integer(v) and v >= low, f"an integer >= {low}")


def number_above(low: float) -> Allowed:
    return Allowed(lambda v: _is_number(v) and v > low, f"a finite number > {low}")


def number_at_least(low: float) -> Allowed:
    return Allowed(lambda v: _is_number(v) and v >= low, f"a finite number >= {low}")


def number_in(low: float, high: float, *, low_open: bool = False, high_open: bool = False):
    """A number in the interval from `low` to `high`, each end closed unless said open."""

    def check(value: Any) -> bool:
        if not _is_number(value):
            return False
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        return above and below

    brackets = ("(" if low_open else "[", ")" if high_open else "]")
    return Allowed(check, f"a number in {brackets[0]}{low}, {high}{brackets[1]}")


def one_of(choices) -> Allowed:
    return Allowed(lambda v: v in tuple(choices), f"one of {list(choices)}")


BOOLEAN = Allowed(lambda v: isinstance(v, bool), "true or false")


def _parses(parse: Callable[[str], Any], value) -> bool:
    try:
        parse(value)
    except ValueError:
        return False
    return True


# What each decode kernel's settings must be, beside their fields (`DECODE_KERNEL_KNOBS`).
_SETTINGS_HINTS = {
    "decode_kernel": "powers of two for block_k >= 16 and num_warps, e.g. 2:128:4:2",
    "decode_mlp_kernel": "powers of two, the blocks >= 16, e.g. 64:64:64:4:3",
    "decode_projection_kernel": "powers of two, the blocks >= 16, e.g. 64:64:64:4:4:3",
    "decode_qkv_kernel": "powers of two, the blocks >= 16, e.g. 64:64:4:3",
}


def _settings_spec(kernel: DecodeKernelKnob) -> Allowed:
    """'' or a `kernel.settings_key` spec its parser takes: the settings the Pallas kernel
    runs with."""
    fields = ":".join(kernel.settings_type._fields)
    return Allowed(
        lambda v: isinstance(v, str) and (v == "" or _parses(kernel.parse, v)),
        f"'' or {fields} ({_SETTINGS_HINTS[kernel.settings_key]})",
    )


# The compile cache's (configs/common.py's `compile_cache()`, in the training and the
# reward-model configs).
COMPILE_CACHE_RANGES: dict[str, Allowed] = {
    "compile_cache.min_compile_seconds": number_at_least(0),
    "compile_cache.max_gib": number_above(0),
}
# The optimiser's (configs/common.py's `optimizer()`, in the training and the reward-model
# configs).
OPTIM_RANGES: dict[str, Allowed] = {
    "optim.learning_rate": number_in(0, MAX_LEARNING_RATE, low_open=True),
    "optim.schedule": one_of(LR_SCHEDULES),
    "optim.warmup_steps": integer_at_least(0),
    "optim.decay_fraction": number_in(0, 1),
    "optim.end_lr_fraction": number_in(0, 1),
    "optim.weight_decay": number_at_least(0),
    "optim.b1": number_in(0, 1, high_open=True),
    "optim.b2": number_in(0, 1, high_open=True),
    "optim.eps": number_above(0),
    "optim.grad_clip_norm": number_at_least(0),
}
# Every range a training config's values can take (configs/common.py's keys). Cross-key
# rules (K <= S, batch shapes over devices, ...) are checked in `validate` itself.
RANGES: dict[str, Allowed] = {
    "seed": integer_at_least(0),
    "mode": one_of(("async", "sync")),
    "learner_steps": integer_at_least(1),
    "sync_period": integer_at_least(1),
    "max_prompt_len": integer_at_least(1),
    "max_response_len": integer_at_least(1),
    "model.dtype": one_of(sorted(DTYPES)),
    "model.param_dtype": one_of(sorted(DTYPES)),
    "model.scan_layers": BOOLEAN,
    "model.scan_decode": BOOLEAN,
    "model.remat": one_of(REMAT_POLICIES),
    "model.attention": one_of(ATTENTIONS),
    **{f"model.{kernel.knob}": one_of(kernel.choices) for kernel in DECODE_KERNEL_KNOBS},
    **{f"model.{kernel.settings_key}": _settings_spec(kernel) for kernel in DECODE_KERNEL_KNOBS},
    "model.logprob_chunk": integer_at_least(0),
    "model.vocab_size": integer_at_least(0),
    "warm_start.steps": integer_at_least(0),
    "warm_start.batch_size": integer_at_least(1),
    "warm_start.learning_rate": number_in(0, MAX_LEARNING_RATE, low_open=True),
    "warm_start.warmup_steps": integer_at_least(0),
    "sampling.temperature": number_above(0),
    "sampling.top_k": integer_at_least(0),
    "sampling.top_p": number_in(0, 1, low_open=True),
    "sampling.decode_segments": integer_at_least(1),
    "loss.beta_schedule": one_of(BETA_SCHEDULE_KINDS),
    "loss.beta_start": number_above(0),
    "loss.beta_end": number_above(0),
    "loss.beta_anneal_steps": integer_at_least(0),
    "loss.beta_cut_steps": integer_at_least(0),
    "loss.grpo.clip_epsilon": number_in(0, 1, low_open=True, high_open=True),
    "loss.grpo.scale_rewards": BOOLEAN,
    "loss.grpo.aggregation": one_of(GRPO_AGGREGATIONS),
    "loss.vineppo.clip_epsilon": number_in(0, 1, low_open=True, high_open=True),
    "loss.vineppo.aggregation": one_of(GRPO_AGGREGATIONS),
    "loss.vineppo.rollouts": integer_at_least(1),
    "loss.vineppo.step_delimiters": Allowed(
        lambda v: isinstance(v, str) and len(v) > 0, "a non-empty string of characters"
    ),
    "loss.vineppo.max_steps": integer_at_least(1),
    "loss.vineppo.rows_per_call": integer_at_least(0),
    "loss.ppo.critic": one_of(CRITIC_KINDS),
    "loss.ppo.critic_init": one_of(CRITIC_INITS),
    "loss.ppo.gamma": number_in(0, 1),
    "loss.ppo.lam": number_in(0, 1),
    "loss.ppo.clip_epsilon": number_in(0, 1, low_open=True, high_open=True),
    "loss.ppo.value_clip": number_above(0),
    "loss.ppo.vf_coef": number_above(0),
    "loss.ppo.epochs": integer_at_least(1),
    "loss.ppo.minibatches": integer_at_least(1),
    "loss.ppo.whiten_advantages": BOOLEAN,
    "loss.ppo.fused_step": BOOLEAN,
    "loss.ppo.critic_learning_rate": number_in(0, MAX_LEARNING_RATE),
    "batch.prompts_per_batch": integer_at_least(1),
    "batch.samples_per_prompt": integer_at_least(2),
    "batch.samples_generated_per_prompt": integer_at_least(2),
    "batch.num_microbatches": integer_at_least(1),
    "replay.capacity": integer_at_least(1),
    "replay.capacity_per_prompt": integer_at_least(1),
    "replay.recency_prob": number_in(0, 1),
    "replay.priority": one_of(PRIORITIES),
    "replay.priority_inverse_temperature": number_at_least(0),
    "replay.draw_rule": one_of(DRAW_RULES),
    "replay.min_prompts": integer_at_least(1),
    "replay.max_policy_lag": integer_at_least(0),
    "search.num_searchers": integer_at_least(1),
    "distributed.topology": one_of(("roles_within_host", "roles_by_process")),
    "distributed.learner_processes": integer_at_least(1),
    "search.prompts_per_call": integer_at_least(1),
    "search.score_rows_per_chunk": integer_at_least(0),
    "search.engine": one_of(ENGINES),
    "search.slots": integer_at_least(0),
    "search.chunk_steps": integer_at_least(1),
    "search.tail_chunk_steps": integer_at_least(0),
    "search.prefill_prompts": integer_at_least(0),
    "search.prefill_buckets": integer_at_least(1),
    "search.bucket_min_tokens": integer_at_least(1),
    "search.compact_below": number_in(0, 1, high_open=True),
    "search.refill_free": number_in(0, 1),
    "search.min_width": integer_at_least(1),
    "search.compact_min_steps": integer_at_least(0),
    "search.score_rows": integer_at_least(0),
    "search.score_length_buckets": integer_at_least(1),
    "search.in_flight_updates": BOOLEAN,
    "search.restart_on_publish": BOOLEAN,
    "search.max_samples_per_draw": number_at_least(0),
    **OPTIM_RANGES,
    "eval.num_examples": integer_at_least(0),
    "eval.batch_size": integer_at_least(1),
    "eval.refill_free": number_in(0, 1),
    "eval.every_steps": integer_at_least(0),
    **COMPILE_CACHE_RANGES,
    "log_every": integer_at_least(1),
    "checkpoint_every": integer_at_least(1),
    "keep_checkpoints": integer_at_least(1),
    "progress_bar": BOOLEAN,
    "max_nonfinite_steps": integer_at_least(1),
    "record_learner_batches": BOOLEAN,
}
FINITE_NUMBER = Allowed(_is_number, "a finite number")
# The task's keys, which differ from task to task: a config is checked on those it has
# (`check_ranges` skips the others). Rules between them and the task's data are its
# builder's (e.g. the arithmetic task's operand and term ranges).
_ROLE_MODEL_RANGES = {
    "batch_size": integer_at_least(1),
    "dtype": one_of(sorted(DTYPES)),
    "attention": one_of(ATTENTIONS),
    "seed": integer_at_least(0),
}
TASK_RANGES: dict[str, Allowed] = {
    "task.seed": integer_at_least(0),
    "task.num_train": integer_at_least(0),  # 0: all (as a slice's end, -1 would leave out
    "task.num_test": integer_at_least(0),  # the last example)
    "task.max_prompt_len": integer_at_least(1),
    "task.max_solution_len": integer_at_least(0),  # 0: keep every training solution
    "task.eval_score_rows_per_chunk": integer_at_least(0),
    "task.non_eos_penalty": FINITE_NUMBER,
    "task.embed_batch_size": integer_at_least(1),
    "task.num_example_attacks": integer_at_least(0),
    "task.toxic_threshold": number_in(0, 1),
    **{
        f"task.{role}.{key}": allowed
        for role in ("reward_model", "gold_reward_model", "judge", "victim")
        for key, allowed in _ROLE_MODEL_RANGES.items()
    },
    "task.reward_model.max_len": integer_at_least(1),
    "task.reward_model.min_bucket_len": integer_at_least(1),
    "task.gold_reward_model.max_len": integer_at_least(1),
    "task.gold_reward_model.min_bucket_len": integer_at_least(1),
    "task.judge.max_prompt_len": integer_at_least(1),
    "task.judge.num_labels": integer_at_least(2),
    "task.victim.max_new_tokens": integer_at_least(1),
    "task.victim.max_prompt_len": integer_at_least(1),
    "task.victim.num_responses": integer_at_least(1),
    "task.victim.temperature": number_above(0),
    "task.victim.top_p": number_in(0, 1, low_open=True),
}


# Sections every training config has (configs/common.py's `base_config`), and those of a
# reward-model config (configs/reward_model.py): what tells one launcher's config from the
# other's before either reads a key the other lacks.
TRAINING_SECTIONS = ("method", "learner_steps", "batch", "replay", "search")
REWARD_MODEL_SECTIONS = ("train", "data", "max_len")


def check_config_kind(config: ml_collections.ConfigDict, reward_model: bool = False) -> None:
    """ConfigError when `config` is not the kind its launcher runs: a training config for
    experiments/train.py, a reward-model one (`reward_model`) for train_reward_model.py."""
    wanted = REWARD_MODEL_SECTIONS if reward_model else TRAINING_SECTIONS
    missing = [key for key in wanted if key not in config]
    if not missing:
        return
    kind, other = (
        ("a reward-model config", "a training config runs with experiments/train.py")
        if reward_model
        else (
            "a training config",
            "a reward-model config trains with experiments/train_reward_model.py",
        )
    )
    raise ConfigError(
        f"config {config.get('name', '?')!r} is not {kind} (it has no {', '.join(missing)}); "
        f"{other}."
    )


def check_ranges(config: ml_collections.ConfigDict, ranges: Mapping[str, Allowed]) -> None:
    """ConfigError naming the first key whose value is outside its range (keys the config
    does not have are skipped)."""
    for path, allowed in ranges.items():
        present, value = config_keys.lookup(config, path)
        if present and not allowed.check(value):
            raise ConfigError(f"{path}={value!r} must be {allowed.description}.")


def _check_ppo_batches(ppo: ml_collections.ConfigDict, rows: int, num_microbatches: int) -> None:
    """PPO splits each batch of `rows` into `ppo.minibatches` updates of `num_microbatches`
    micro-batches each: both must divide evenly."""
    if rows % (ppo.minibatches * num_microbatches):
        raise ConfigError(
            f"A batch of {rows} rows (prompts_per_batch × samples_per_prompt) does not split "
            f"into loss.ppo.minibatches={ppo.minibatches} × batch.num_microbatches="
            f"{num_microbatches} equal parts; change one of them."
        )


def _check_critic_init(config: ml_collections.ConfigDict) -> None:
    """A critic that starts as the reward model needs its own model and a task with one."""
    if config.loss.ppo.critic_init != "reward_model":
        return
    if config.loss.ppo.critic != "separate":
        raise ConfigError(
            "loss.ppo.critic_init=reward_model needs loss.ppo.critic=separate (a shared critic "
            "is a value head on the policy's trunk, not a model of its own)."
        )
    if "reward_model" not in config.task:
        raise ConfigError(
            f"loss.ppo.critic_init=reward_model, but task {config.task.name!r} has no "
            "task.reward_model (its rewards come from elsewhere); use critic_init=policy."
        )


def check_sample_limit(config: ml_collections.ConfigDict) -> None:
    """search.max_samples_per_draw bounds async searchers that share a process with the
    learner (whose draws they follow)."""
    if config.mode != "async" or not config.search.get("max_samples_per_draw", 0.0):
        return
    if config.get("distributed", {}).get("topology") == "roles_by_process":
        raise ConfigError(
            "search.max_samples_per_draw is built for searchers beside their learner "
            "(distributed.topology=roles_within_host); with roles_by_process the searchers "
            "have their own devices and their outbox bounds what they hand on. Leave it 0."
        )


def validate(
    config: ml_collections.ConfigDict,
    num_devices: int,
    learner_devices: int | None = None,
    num_processes: int = 1,
) -> None:
    """Raises ConfigError for settings that cannot work. Cheap: runs before any long work.
    `learner_devices`: the learner mesh's size when it is not split from `num_devices`
    (a multi-process run's layout, `tba_jax.topology`); `num_processes`: the run's JAX
    processes."""
    check_ranges(config, RANGES)
    check_ranges(config, TASK_RANGES)
    if config.record_learner_batches and num_processes > 1:
        raise ConfigError(
            f"record_learner_batches is not built for runs over several processes (this one "
            f"has {num_processes}): its replay needs the whole global batch in one process. "
            "Record a single-process run, or leave it False."
        )
    if config.model.get("scan_decode") and not config.model.get("scan_layers"):
        raise ConfigError(
            "model.scan_decode=True scans the stacked blocks of model.scan_layers=True; set "
            "model.scan_layers=True too (or leave scan_decode off)."
        )
    if config.sampling.get("decode_segments", 1) > config.max_response_len:
        raise ConfigError(
            f"sampling.decode_segments={config.sampling.decode_segments} is more than "
            f"max_response_len={config.max_response_len} decode steps; lower it."
        )
    if config.method not in registered_losses():
        raise ConfigError(f"method={config.method!r} is not one of {registered_losses()}.")
    batch = config.batch
    if batch.samples_per_prompt > batch.samples_generated_per_prompt:
        raise ConfigError(
            f"K (batch.samples_per_prompt={batch.samples_per_prompt}) is larger than the "
            f"samples generated per prompt (batch.samples_generated_per_prompt="
            f"{batch.samples_generated_per_prompt}); raise the latter or lower K."
        )
    if config.mode == "async" and get_loss(config.method).on_policy:
        raise ConfigError(
            f"method={config.method!r} is an on-policy loss; run it with mode=sync "
            "(async replays off-policy samples)."
        )
    rows = batch.prompts_per_batch * batch.samples_per_prompt
    if get_loss(config.method).needs_critic:
        _check_ppo_batches(config.loss.ppo, rows, batch.num_microbatches)
        _check_critic_init(config)
    if batch.prompts_per_batch % batch.num_microbatches:
        raise ConfigError(
            f"batch.prompts_per_batch={batch.prompts_per_batch} does not divide into "
            f"batch.num_microbatches={batch.num_microbatches} (micro-batches hold whole prompts)."
        )
    if learner_devices is None:
        learner_devices = _learner_device_count(config, num_devices)
    batch_shards = learner_devices // (config.mesh.learner_axes.get("tensor", 1) or 1)
    rows_per_micro = rows // batch.num_microbatches
    if get_loss(config.method).needs_critic:  # PPO's micro-batches split its mini-batches
        rows_per_micro //= config.loss.ppo.minibatches
    if rows_per_micro % max(batch_shards, 1):
        raise ConfigError(
            f"A micro-batch of {rows_per_micro} rows (prompts_per_batch × samples_per_prompt / "
            f"num_microbatches, / loss.ppo.minibatches for PPO) does not divide over the "
            f"learner's {batch_shards} batch shards; "
            "change batch.prompts_per_batch, batch.num_microbatches or mesh.learner_axes."
        )
    for key, path in hf_folders(config.to_dict()):  # the policy, π_ref and the task's roles
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(
                f"{key}={path!r} is not a Hugging Face model folder (no config.json there); "
                "pass a local folder saved with save_pretrained."
            )
    check_score_chunks(config)
    check_sample_limit(config)
    check_engine(config)
    check_length_buckets(config)
    check_attention(config)
    check_role_attention(config)
    replay = config.replay
    if config.mode == "async" and replay.capacity < replay.capacity_per_prompt:
        raise ConfigError(
            f"replay.capacity={replay.capacity} is smaller than replay.capacity_per_prompt="
            f"{replay.capacity_per_prompt} (the samples one prompt keeps); raise "
            "replay.capacity or lower replay.capacity_per_prompt."
        )
    if config.loss.beta_schedule == "linear" and config.loss.beta_anneal_steps < 1:
        raise ConfigError(
            f"loss.beta_anneal_steps={config.loss.beta_anneal_steps} must be >= 1 for a linear "
            "β schedule (or set loss.beta_schedule=constant)."
        )
    check_scored_lengths(config)


def check_scored_lengths(config: ml_collections.ConfigDict) -> None:
    """ConfigError for a task's reward model (a role section with `max_len`) that cannot
    hold a whole response and its EOS: it keeps responses whole and drops prompt tokens
    to fit, so a shorter `max_len` fails at the first long response, mid-run. (In its own
    tokens; a checkpoint's tokenizer, or its BOS, may need a few more.)"""
    task = config.get("task")
    least = config.max_response_len + 1
    for key, role in role_attentions(task.to_dict() if task is not None else {}):
        if "max_len" in role and role["max_len"] < least:
            raise ConfigError(
                f"{key}.max_len={role['max_len']} cannot hold a whole response "
                f"(max_response_len={config.max_response_len}) and its EOS; raise it to at "
                f"least {least} (the configs set max_prompt_len + max_response_len + 1)."
            )


def hf_folders(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, folder) of every non-empty `hf_path` in a config (as a dict):
    model.hf_path, reference.hf_path, a task's reward model, victim or judge, ..."""
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from hf_folders(value, f"{dotted}.")
        elif key == HF_PATH_KEY and isinstance(value, str) and value:
            yield dotted, value


def check_platform_kernel(name: str, key: str, value: Any, backend: str | None = None) -> None:
    """ConfigError when `value` of execution field `key` (set as `name`, e.g.
    "task.victim.attention") is a kernel of another platform than this run's (`backend`:
    JAX's, default this process's; `models.config.PLATFORM_EXECUTION`): cuDNN's attention
    or the Pallas decode kernels off a GPU, splash attention off a TPU, where it would not
    run, or run in Pallas' interpreter, many times slower."""
    backend = backend or jax.default_backend()
    found = off_platform(key, value, backend)
    if found is not None:
        platform, instead = found
        raise ConfigError(
            f"{name}={value} is a {platform.upper()} kernel, and this run's JAX platform is "
            f"{backend}; use {name}={instead} here (the same computation, another kernel)."
        )


def check_half_dtype_for_cudnn(name: str, attention: str, dtype: str | None) -> None:
    """ConfigError for cuDNN's attention without a half-precision compute dtype (its kernel
    takes bfloat16 or float16 only)."""
    if attention == "cudnn" and (dtype or "float32") not in HALF_DTYPES:
        raise ConfigError(
            f"{name}.attention=cudnn needs {name}.dtype in {list(HALF_DTYPES)}, got "
            f"{dtype or 'float32'!r}; use {name}.attention=dot_product for float32."
        )


def check_attention(config: ml_collections.ConfigDict, backend: str | None = None) -> None:
    """ConfigError for the policy's attention kernels: cuDNN's without a half-precision
    compute dtype, and any kernel of another platform than this run's
    (`check_platform_kernel`)."""
    model = config.model
    check_half_dtype_for_cudnn("model", model.get("attention"), model.get("dtype"))
    for key in ("attention", *(kernel.knob for kernel in DECODE_KERNEL_KNOBS)):
        check_platform_kernel(f"model.{key}", key, model.get(key), backend)


def role_attentions(task: Mapping[str, Any], prefix: str = "task.") -> Iterator[tuple[str, Any]]:
    """(dotted key, section) of every frozen role section under a config's `task` (a
    reward model, victim or judge: the sections with an `attention` key)."""
    for key, value in task.items():
        if isinstance(value, Mapping):
            if "attention" in value:
                yield f"{prefix}{key}", value
            else:
                yield from role_attentions(value, f"{prefix}{key}.")


def check_role_attention(config: ml_collections.ConfigDict, backend: str | None = None) -> None:
    """ConfigError for a role's `attention` that is no kernel, `cudnn` without a
    half-precision dtype, or a kernel of another platform than this run's (`backend`:
    JAX's, default this process's)."""
    task = config.get("task")
    for key, role in role_attentions(task.to_dict() if task is not None else {}):
        attention = role["attention"]
        if attention not in ATTENTIONS:
            raise ConfigError(f"{key}.attention={attention!r} must be one of {list(ATTENTIONS)}.")
        check_half_dtype_for_cudnn(key, attention, role.get("dtype"))
        check_platform_kernel(f"{key}.attention", "attention", attention, backend)


def check_score_chunks(config: ml_collections.ConfigDict) -> None:
    """ConfigError unless search.score_rows_per_chunk divides the rows a search call scores
    (prompts_per_call × S in async mode, prompts_per_batch × K in sync mode)."""
    chunk = config.search.score_rows_per_chunk
    if chunk < 0:
        raise ConfigError(f"search.score_rows_per_chunk={chunk} must be >= 0 (0: all rows).")
    rows = samples_per_search_call(config)
    if config.mode == "async":
        described = "search.prompts_per_call × batch.samples_generated_per_prompt"
    else:
        described = "batch.prompts_per_batch × batch.samples_per_prompt"
    if chunk and rows % chunk:
        raise ConfigError(
            f"search.score_rows_per_chunk={chunk} does not divide the {rows} rows a search "
            f"call scores ({described}); pick a divisor or 0."
        )


def check_engine(config: ml_collections.ConfigDict) -> None:
    """ConfigError unless the slot engine's width holds one prompt's samples and its scoring
    groups split into search.score_rows_per_chunk rows."""
    search = config.search
    if search.engine != "slots":
        return
    samples = samples_per_search_prompt(config)
    width = search.slots or samples_per_search_call(config)
    if width < samples:
        raise ConfigError(
            f"search.slots={search.slots} cannot hold the {samples} samples of one prompt "
            "(a prompt's samples are prefilled together); raise search.slots or set 0."
        )
    rows = search.score_rows or samples
    chunk = search.score_rows_per_chunk
    if chunk and rows % chunk:
        raise ConfigError(
            f"search.score_rows_per_chunk={chunk} does not divide the {rows} samples the slot "
            "engine scores at a time (search.score_rows, 0: samples per prompt); pick a divisor."
        )
    if search.in_flight_updates and config.mode != "async":
        raise ConfigError(
            "search.in_flight_updates only applies to async searchers; a sync batch is "
            "generated with the params of its step (set mode=async or leave it False)."
        )


# Length-bucket knobs and the length their buckets divide: the slot engine prefills at
# one of `prefill_buckets` prompt lengths, π_ref scoring pads to one of
# `score_length_buckets` response lengths (limit × i / N, each at least a token apart).
LENGTH_BUCKETS = {
    "prefill_buckets": ("max_prompt_len", "prefill prompts", "prefill"),
    "score_length_buckets": ("max_response_len", "π_ref scoring pads responses", "score"),
}


def check_length_buckets(config: ml_collections.ConfigDict) -> None:
    """ConfigError unless each search.*_buckets knob is at most the length it divides."""
    for knob, (limit_key, what, action) in LENGTH_BUCKETS.items():
        buckets, limit = config.search[knob], config[limit_key]
        if buckets > limit:
            raise ConfigError(
                f"search.{knob}={buckets} must be in [1, {limit_key}={limit}] ({what} to one "
                f"of that many lengths, each at least a token longer than the last); lower it, "
                f"or set 1 to always {action} at {limit_key}."
            )


# The keys only one setting reads: the slot engine's knobs (the batch engine reads none),
# and what only an async run reads (a sync run generates K samples per prompt, learns
# from each batch once, and publishes after every step).
SLOT_ENGINE_KEYS = (
    "search.slots",
    "search.chunk_steps",
    "search.tail_chunk_steps",
    "search.prefill_prompts",
    "search.refill_free",
    "search.prefill_buckets",
    "search.compact_below",
    "search.min_width",
    "search.compact_min_steps",
    "search.score_rows",
    "search.score_length_buckets",
    "search.bucket_min_tokens",
    "search.in_flight_updates",
    "search.restart_on_publish",
    "eval.refill_free",
)
ASYNC_ONLY_KEYS = (
    "sync_period",
    "replay",
    "search.prompts_per_call",
    "search.restart_on_publish",
    "search.max_samples_per_draw",
    "batch.samples_generated_per_prompt",
)


def _under(key: str, section: str) -> bool:
    return key == section or key.startswith(section + ".")


def unread_key_reason(config: ml_collections.ConfigDict, key: str) -> str | None:
    """Why the dotted `key` changes nothing in a run of `config` (another method's
    `loss.<method>` options, the slot engine's knobs with search.engine=batch, an async
    run's knobs with mode=sync), or None when the run reads it."""
    for method in registered_losses():
        if method != config.method and _under(key, f"loss.{method}"):
            return f"only method={method} reads loss.{method}.* (this run: method={config.method})"
    if config.search.engine != "slots" and any(_under(key, k) for k in SLOT_ENGINE_KEYS):
        return f"only search.engine=slots reads it (this run: search.engine={config.search.engine})"
    if config.mode != "async" and any(_under(key, k) for k in ASYNC_ONLY_KEYS):
        return f"only mode=async reads it (this run: mode={config.mode})"
    for kernel in DECODE_KERNEL_KNOBS:
        if config.model.get(kernel.knob) != "pallas" and key == f"model.{kernel.settings_key}":
            return f"only model.{kernel.knob}=pallas reads it"
    if config.search.in_flight_updates and _under(key, "search.restart_on_publish"):
        return "search.in_flight_updates=True never restarts: live samples take the new params"
    return None


def samples_per_search_prompt(config: ml_collections.ConfigDict) -> int:
    """Responses generated per prompt: S in async mode, K in sync mode."""
    batch = config.batch
    if config.mode == "async":
        return batch.samples_generated_per_prompt
    return batch.samples_per_prompt


def samples_per_search_call(config: ml_collections.ConfigDict) -> int:
    """Rows of one search call: prompts_per_call × S (async) or prompts_per_batch × K (sync)."""
    prompts = (
        config.search.prompts_per_call if config.mode == "async" else config.batch.prompts_per_batch
    )
    return prompts * samples_per_search_prompt(config)


def _learner_device_count(config: ml_collections.ConfigDict, num_devices: int) -> int:
    """How many devices the learner gets, by the same split the run will make (one
    process); both roles' `mesh.<role>_axes` are checked against their shares."""
    sampler, learner = mesh_lib.split_devices(
        range(num_devices), config.mesh.sampler_devices, config.mesh.colocate
    )
    mesh_lib.mesh_shape(len(sampler), config.mesh.sampler_axes, "mesh.sampler_axes", "sampler")
    mesh_lib.mesh_shape(len(learner), config.mesh.learner_axes, "mesh.learner_axes", "learner")
    return len(learner)


# Output folders (a run's --workdir, a launcher's --out), checked before anything is written.


def nearest_existing_path(path: str) -> str:
    """`path` or its closest ancestor that exists."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


URL_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # gs://, s3://, file://, ...


def is_url(path: str) -> bool:
    """Whether `path` is a URL (a scheme and ://), not a filesystem path."""
    return URL_PATTERN.match(path) is not None


def output_dir_problem(path: str) -> str | None:
    """Why the folder `path` cannot be made or written (None if it can); leaves nothing
    behind. A URL is refused: runs write their folders (config, metrics, data,
    checkpoints) through the filesystem, where gs://b/r would be a local folder named
    'gs:'. Writability is tried, not only asked: an empty folder is made and removed in
    the nearest existing folder, since `os.access` says yes to root where making one
    fails (/proc, /sys)."""
    if is_url(path):
        scheme = path.split("://", 1)[0]
        return (
            f"is a URL, not a folder: runs write their files through the filesystem, so "
            f"mount the {scheme}:// bucket (e.g. with gcsfuse) and pass the mounted path"
        )
    if os.path.exists(path) and not os.path.isdir(path):
        return "is a file, not a folder"
    existing = nearest_existing_path(path)
    if not os.path.isdir(existing):
        return f"cannot be created: {existing} is a file"
    why_not = _folder_cannot_be_made_in(existing)
    if why_not is None:
        return None
    if existing == os.path.abspath(path):
        return f"is not writable{why_not}"
    return f"cannot be created: {existing} is not writable{why_not}"


def _folder_cannot_be_made_in(folder: str) -> str | None:
    """None if an empty folder can be made (and is removed again) in `folder`; else why
    not: "" when `os.access` says so, " (the OS's reason)" when making one failed."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return ""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".tba_jax_probe_", dir=folder))
    except OSError as error:
        return f" ({error.strerror or error})"
    return None
