"""Tasks by name: what a run trains on (data, tokenizer, reward), built from `config.task`.

A task builder returns a `Task`; `config.task.name` picks one:

- `arithmetic`: the built-in task (tba_jax/data/arithmetic.py).
- `gsm8k`: GSM8K math word problems (tba_jax/data/gsm8k.py) with the last-number reward
  (tba_jax/rewards/gsm8k.py); warm-start solutions are the dataset's worked answers.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import ml_collections
import numpy as np
from absl import logging

from tba_jax.config_lib import ConfigError
from tba_jax.data import arithmetic, gsm8k
from tba_jax.models.tokenizers import CharTokenizer, Tokenizer
from tba_jax.rewards import arithmetic as arithmetic_reward
from tba_jax.rewards import gsm8k as gsm8k_reward
from tba_jax.rewards import score_pairs

# (examples, response texts) -> rewards float32 [N]; examples[i] is response i's prompt.
BatchRewardFn = Callable[[Sequence[dict], Sequence[str]], np.ndarray]


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
    """

    name: str
    train: Sequence[dict]
    test: Sequence[dict]
    tokenizer: Tokenizer
    rewards: BatchRewardFn
    identity: dict  # JSON-able: what makes two runs' tasks the same (for checkpoints)


# (task config, workdir, tokenizer or None for the task's own) -> Task
TaskBuilder = Callable[[ml_collections.ConfigDict, str, Tokenizer | None], Task]
_TASKS: dict[str, TaskBuilder] = {}


def register_task(name: str):
    def decorator(builder: TaskBuilder) -> TaskBuilder:
        _TASKS[name] = builder
        return builder

    return decorator


def build_task(
    task_config: ml_collections.ConfigDict, workdir: str, tokenizer: Tokenizer | None = None
) -> Task:
    """The task `task_config.name`; `tokenizer` (e.g. a checkpoint's) replaces the task's own."""
    if task_config.name not in _TASKS:
        raise ValueError(f"task.name={task_config.name!r} is not one of {sorted(_TASKS)}.")
    return _TASKS[task_config.name](task_config, workdir, tokenizer)


# Where data is cached or read from, not what it is: not part of a task's identity.
LOCATION_KEYS = ("data_dir", "manual_dir")


def task_identity(task_config: ml_collections.ConfigDict) -> dict:
    """The task settings that define the data (not where it is cached or read from)."""
    return {k: v for k, v in task_config.to_dict().items() if k not in LOCATION_KEYS}


def task_data_dir(task_config: ml_collections.ConfigDict, workdir: str) -> str:
    """`task.data_dir`, or `<workdir>/data` when it is empty."""
    return task_config.data_dir or os.path.join(workdir, "data")


@register_task("arithmetic")
def arithmetic_task(
    task_config: ml_collections.ConfigDict, workdir: str, tokenizer: Tokenizer | None = None
) -> Task:
    spec = arithmetic.ArithmeticTaskConfig(
        num_terms_min=task_config.num_terms_min,
        num_terms_max=task_config.num_terms_max,
        max_operand=task_config.max_operand,
        max_result=task_config.max_result,
        ops=task_config.ops,
        num_train=task_config.num_train,
        num_test=task_config.num_test,
        seed=task_config.seed,
        demo_error_rate=task_config.demo_error_rate,
    )
    data_dir = task_data_dir(task_config, workdir)
    return Task(
        name="arithmetic",
        train=arithmetic.load_split(spec, "train", data_dir),
        test=arithmetic.load_split(spec, "test", data_dir),
        tokenizer=tokenizer or CharTokenizer.for_arithmetic(task_config.ops),
        rewards=per_sample_rewards(arithmetic_reward.reward),
        identity=task_identity(task_config),
    )


# ------------------------------------------------------------------------------ GSM8K

# The tiny stand-in policy's alphabet: printable ASCII (space to "~") and newline.
PRINTABLE_ASCII = "".join(chr(code) for code in range(ord(" "), ord("~") + 1))
GSM8K_CHAR_ALPHABET = "\n" + PRINTABLE_ASCII
# `task.tokenizer` values: the checkpoint's (model.hf_path is then required) or the chars.
CHECKPOINT_TOKENIZER = "checkpoint"
CHAR_TOKENIZER = "char"


def gsm8k_char_tokenizer() -> CharTokenizer:
    """A CharTokenizer over printable ASCII and newline (GSM8K with a tiny policy)."""
    return CharTokenizer(GSM8K_CHAR_ALPHABET)


def gsm8k_tokenizer(task_config: ml_collections.ConfigDict, tokenizer: Tokenizer | None):
    """The checkpoint's tokenizer when given, else the one `task.tokenizer` names."""
    if tokenizer is not None:
        return tokenizer
    if task_config.tokenizer == CHAR_TOKENIZER:
        return gsm8k_char_tokenizer()
    if task_config.tokenizer == CHECKPOINT_TOKENIZER:
        raise ConfigError(
            "model.hf_path is empty but this GSM8K config starts from a checkpoint; pass "
            "--config.model.hf_path=/path/to/rho-1b-sft (a local Hugging Face folder)."
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


def with_solution(example: dict) -> dict:
    """The example with `solution` = its worked answer (the supervised warm-start target)."""
    return {**example, "solution": example["answer"]}


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


def gsm8k_split(
    task_config: ml_collections.ConfigDict, split: str, data_dir: str, tokenizer: Tokenizer
) -> list[dict]:
    """A GSM8K split without examples too long to encode, capped at num_{split}."""
    examples = gsm8k.load_split(split, data_dir, manual_dir=task_config.manual_dir or None)
    max_prompt, max_solution = task_config.max_prompt_len, task_config.max_solution_len
    check_solution = split == "train" and max_solution > 0

    def keep(example: dict) -> bool:
        if not fits(tokenizer, example["prompt"], max_prompt):
            return False
        # The warm start appends EOS to each solution.
        return not check_solution or fits(tokenizer, example["answer"], max_solution - 1)

    described = f"GSM8K {split} (prompt <= {max_prompt} tokens"
    described += f", solution + EOS <= {max_solution})" if check_solution else ")"
    limit = task_config.num_train if split == "train" else task_config.num_test
    return [with_solution(example) for example in keep_fitting(examples, keep, limit, described)]


@register_task("gsm8k")
def gsm8k_task(
    task_config: ml_collections.ConfigDict, workdir: str, tokenizer: Tokenizer | None = None
) -> Task:
    tokenizer = gsm8k_tokenizer(task_config, tokenizer)
    data_dir = task_data_dir(task_config, workdir)
    return Task(
        name="gsm8k",
        train=gsm8k_split(task_config, "train", data_dir, tokenizer),
        test=gsm8k_split(task_config, "test", data_dir, tokenizer),
        tokenizer=tokenizer,
        rewards=per_sample_rewards(gsm8k_reward.reward),
        identity=task_identity(task_config),
    )
