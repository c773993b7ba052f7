"""The `Task` record, the task registry, and text helpers shared by task builders."""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections
import numpy as np
from absl import logging

from tba_jax.config_lib import ConfigError, role_attentions
from tba_jax.models import Model
from tba_jax.models.frozen import Placement
from tba_jax.models.tokenizers import CharTokenizer, Tokenizer
from tba_jax.rewards import score_pairs
from tba_jax.sampling.engine import EngineConfig, make_generator
from tba_jax.sampling.generate import SamplingConfig

# (examples, response texts) -> rewards float32 [N]; examples[i] is response i's prompt.
BatchRewardFn = Callable[[Sequence[dict], Sequence[str]], np.ndarray]
ACCURACY = "accuracy"
MEAN_REWARD = "mean_reward"
# (model, params, settings, reference_params) -> JSON-able metrics; see `Task.evaluate`.
TaskEvaluator = Callable[[Any, Any, Any, Any], dict]


def per_sample_rewards(reward_fn: Callable[[str, str], float]) -> BatchRewardFn:
    """A batch reward from a per-sample `reward_fn(response_text, example["answer"])`."""

    def rewards(examples: Sequence[dict], responses: Sequence[str]) -> np.ndarray:
        return score_pairs(reward_fn, responses, [ex["answer"] for ex in examples])

    return rewards


@dataclasses.dataclass(frozen=True)
class Task:
    """train / test: examples with at least `id` and `prompt` (plus what the reward reads,
    e.g. `answer`, and `solution` for a supervised warm start).

    `rewards(examples, responses)` scores a batch at once, so a reward model can run one
    forward pass per batch; `per_sample_rewards` wraps a per-sample checker.

    `evaluate(model, params, settings, reference_params)`: the task's own held-out
    metrics (`tba_jax.evaluation.evaluate_policy` calls it); None: greedy pass@1 and
    sampled pass@k, the verifiable-reward metrics.

    `eval_metric`: what the mean reward of greedy responses on the test split is called in
    training logs and summary.json (`eval_<metric>`, `eval_<metric>_start|_end`):
    `ACCURACY` where the reward is a 0/1 verifier, `MEAN_REWARD` where it is a score (a
    reward model, a red-team judge).

    `non_eos_penalty`: the reward of a sampled response that did not end with EOS
    (`tba_jax.rewards.apply_non_eos_penalty`); None: no penalty.
    """

    name: str
    train: Sequence[dict]
    test: Sequence[dict]
    tokenizer: Tokenizer
    rewards: BatchRewardFn
    identity: dict  # JSON-able: what makes two runs' tasks the same (for checkpoints)
    evaluate: TaskEvaluator | None = None
    non_eos_penalty: float | None = None
    eval_metric: str = ACCURACY


# (task config, workdir, tokenizer or None for the task's own) -> Task; a task with frozen
# role models (reward models, a victim, a judge) also takes `placement=` (where they go;
# None: the default device), and one whose role models generate, `engine=` (how)
TaskBuilder = Callable[..., Task]
# (task config, tokenizer or None for the task's own, placement) -> None: a task's cheap
# checks (config and tokenizer files; its role models' layouts on the placement), a
# ConfigError for what cannot work, before anything is prepared or written.
TaskCheck = Callable[[ml_collections.ConfigDict, Tokenizer | None, Placement | None], None]
_TASKS: dict[str, TaskBuilder] = {}
_CHECKS: dict[str, TaskCheck] = {}
# Per task: config keys that only change how a run is evaluated (e.g. the gold reward
# model), so a checkpoint may be evaluated with other values.
_EVALUATION_KEYS: dict[str, tuple[str, ...]] = {}


def register_task(
    name: str, *, evaluation_keys: Sequence[str] = (), check: TaskCheck | None = None
):
    """Registers a task builder under `name`; `evaluation_keys` are task-config keys that
    are not part of the task's identity (they only change its evaluation); `check` runs
    the task's cheap checks (`check_task`; `build_task` runs them before the builder)."""

    def decorator(builder: TaskBuilder) -> TaskBuilder:
        _TASKS[name] = builder
        _EVALUATION_KEYS[name] = tuple(evaluation_keys)
        if check is not None:
            _CHECKS[name] = check
        return builder

    return decorator


def check_task(
    task_config: ml_collections.ConfigDict,
    tokenizer: Tokenizer | None = None,
    placement: Placement | None = None,
) -> None:
    """The task's cheap checks (`register_task`'s `check`): a ConfigError for settings
    its build would refuse, from config and tokenizer files alone (its role models'
    templates and layouts on `placement`, e.g.), so a run refuses them before it claims a
    workdir. A task without role models has none beyond its build's data checks."""
    if task_config.name not in _TASKS:
        raise ConfigError(f"task.name={task_config.name!r} is not one of {registered_tasks()}.")
    check = _CHECKS.get(task_config.name)
    if check is not None:
        check(task_config, tokenizer, placement)


def registered_tasks() -> list[str]:
    return sorted(_TASKS)


def build_task(
    task_config: ml_collections.ConfigDict,
    workdir: str,
    tokenizer: Tokenizer | None = None,
    placement: Placement | None = None,
    engine: EngineConfig | None = None,
    *,
    checked: bool = False,
) -> Task:
    """The task `task_config.name`; `tokenizer` (e.g. a checkpoint's) replaces the task's own;
    its frozen role models (reward models, red-team victim and judge) are sharded by
    `placement` (the trainer's: the sampler mesh and rules), or sit whole on the default
    device without one; those that generate (the red-team victim) do so through the slot
    engine with `engine`'s settings (the run's `search.engine=slots`: its slots are the
    role's own batch size), or in fixed batches without. The task's cheap checks
    (`check_task`) come first, before the builder prepares any data, unless `checked`
    says the caller made them with these arguments (`train.check_run`)."""
    if task_config.name not in _TASKS:
        raise ValueError(f"task.name={task_config.name!r} is not one of {registered_tasks()}.")
    if not checked:
        check_task(task_config, tokenizer, placement)
    builder = _TASKS[task_config.name]
    accepted = inspect.signature(builder).parameters
    roles = {"placement": placement, "engine": engine}  # builders of tasks with role models
    return builder(
        task_config, workdir, tokenizer, **{k: v for k, v in roles.items() if k in accepted}
    )


# Where data is cached or read from, not what it is: not part of a task's identity.
LOCATION_KEYS = ("data_dir", "manual_dir")


# A frozen role's attention kernel (`models.frozen`): how its model is computed, not what.
ROLE_EXECUTION_KEYS = ("attention",)


def task_identity(task_config: ml_collections.ConfigDict) -> dict:
    """The task settings that define the training data and reward: not where data is cached
    or read from, nor the task's evaluation-only keys (`register_task`), nor the attention
    kernel its role models run with (a run may resume on other hardware)."""
    excluded = (*LOCATION_KEYS, *_EVALUATION_KEYS.get(task_config.name, ()))
    kept = {k: v for k, v in task_config.to_dict().items() if k not in excluded}
    for _, role in role_attentions(kept):  # the dicts of `kept`, at any depth
        for key in ROLE_EXECUTION_KEYS:
            del role[key]
    return kept


def task_data_dir(task_config: ml_collections.ConfigDict, workdir: str) -> str:
    """`task.data_dir`, or `<workdir>/data` when it is empty."""
    return task_config.data_dir or os.path.join(workdir, "data")


# ------------------------------------------------------------------------------ tokenizers

# The tiny stand-in policies' alphabet: printable ASCII (space to "~") and newline.
# `task.tokenizer` values: the checkpoint's (model.hf_path is then required) or the chars.
CHECKPOINT_TOKENIZER = "checkpoint"
CHAR_TOKENIZER = "char"


def task_tokenizer(
    task_config: ml_collections.ConfigDict, tokenizer: Tokenizer | None, checkpoint_hint: str
) -> Tokenizer:
    """The checkpoint's tokenizer when given, else the one `task.tokenizer` names.

    `checkpoint_hint` names the checkpoint the config expects (for the error when
    `task.tokenizer="checkpoint"` but `model.hf_path` is empty).
    """
    if tokenizer is not None:
        return tokenizer
    if task_config.tokenizer == CHAR_TOKENIZER:
        return CharTokenizer.for_text()
    if task_config.tokenizer == CHECKPOINT_TOKENIZER:
        raise ConfigError(
            "model.hf_path is empty but this config starts from a checkpoint; pass "
            f"--config.model.hf_path=/path/to/{checkpoint_hint} (a local Hugging Face folder)."
        )
    raise ConfigError(
        f"task.tokenizer={task_config.tokenizer!r} is not one of "
        f"{[CHECKPOINT_TOKENIZER, CHAR_TOKENIZER]}."
    )


def token_count(tokenizer: Tokenizer, text: str) -> int | None:
    """Tokens of `text` as prompts are encoded, or None when the tokenizer cannot encode it
    (a CharTokenizer raises ValueError for characters outside its alphabet)."""
    try:
        return len(tokenizer.encode(text))
    except ValueError:
        return None


def fits(tokenizer: Tokenizer, text: str, max_tokens: int) -> bool:
    """`text` encodes to at most `max_tokens` tokens."""
    count = token_count(tokenizer, text)
    return count is not None and count <= max_tokens


def keep_fitting(
    examples: list[dict], keep: Callable[[dict], bool], limit: int, description: str
) -> list[dict]:
    """The first `limit` examples (0: all) for which `keep` holds, logging how many fit.

    A ConfigError when none does: the length settings leave nothing to train or test on.
    """
    kept = [example for example in examples if keep(example)]
    logging.info("%s: %d of %d examples fit.", description, len(kept), len(examples))
    if not kept:
        raise ConfigError(f"{description}: no example fits; raise these limits.")
    return kept[:limit] if limit else kept


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """What `evaluate_policy` measures and how (see experiments/evaluate.py for the flags)."""

    max_prompt_len: int
    max_new_tokens: int
    num_examples: int  # the first N test problems; 0: all of them
    batch_size: int  # response rows per generate call
    num_samples: int  # sampled responses per problem for pass@k; 0: greedy only
    ks: tuple[int, ...]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    # The slot engine with batch_size slots (the run's search.engine=slots); None: batches.
    engine: EngineConfig | None = None


_WARNED_SHORT_TEST_SPLITS: set[tuple[str, int, int]] = set()


def first_test_examples(name: str, test: Sequence[dict], num_examples: int) -> list[dict]:
    """The first `num_examples` of the `name` task's test split (0: all of it); asking for
    more than it holds evaluates all of them, with a warning (once per count) saying so."""
    if (
        num_examples > len(test)
        and (name, num_examples, len(test)) not in _WARNED_SHORT_TEST_SPLITS
    ):
        _WARNED_SHORT_TEST_SPLITS.add((name, num_examples, len(test)))
        logging.warning(
            "num_examples=%d is more than the %d test examples of the %s task; evaluating all %d.",
            num_examples,
            len(test),
            name,
            len(test),
        )
    return list(test[: num_examples or len(test)])


def check_sequence_fits(model: Model, settings: EvalSettings) -> None:
    """ValueError when prompts plus new tokens overrun a learned position table."""
    total = settings.max_prompt_len + settings.max_new_tokens
    if model.config.position_embedding == "learned" and total > model.config.max_seq_len:
        raise ValueError(
            f"max_prompt_len={settings.max_prompt_len} + max_new_tokens="
            f"{settings.max_new_tokens} is more than the model's {model.config.max_seq_len} "
            "learned positions; lower max_new_tokens."
        )


def evaluation_generate_fns(model: Model, tokenizer: Tokenizer, settings: EvalSettings):
    """(greedy, sampling) generate functions with the settings' lengths (and engine)."""
    common = dict(max_new_tokens=settings.max_new_tokens, vocab_limit=tokenizer.vocab_size)
    greedy = SamplingConfig(greedy=True, **common)
    sampling = SamplingConfig(
        temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p, **common
    )
    generator = dict(
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        max_prompt_len=settings.max_prompt_len,
        engine=settings.engine,
    )
    return make_generator(model, greedy, **generator), make_generator(model, sampling, **generator)
