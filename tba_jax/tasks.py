"""Tasks by name: what a run trains on (data, tokenizer, reward), built from `config.task`.

A task builder returns a `Task`; `config.task.name` picks one. The built-in
task is `arithmetic` (tba_jax/data/arithmetic.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import ml_collections
import numpy as np

from tba_jax.data import arithmetic
from tba_jax.models.tokenizers import CharTokenizer, Tokenizer
from tba_jax.rewards import arithmetic as arithmetic_reward

# (examples, response texts) -> rewards float32 [N]; examples[i] is response i's prompt.
BatchRewardFn = Callable[[Sequence[dict], Sequence[str]], np.ndarray]


def per_sample_rewards(reward_fn: Callable[[str, str], float]) -> BatchRewardFn:
    """A batch reward from a per-sample `reward_fn(response_text, example["answer"])`."""

    def rewards(examples: Sequence[dict], responses: Sequence[str]) -> np.ndarray:
        return np.array(
            [reward_fn(text, ex["answer"]) for ex, text in zip(examples, responses, strict=True)],
            dtype=np.float32,
        )

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


def task_identity(task_config: ml_collections.ConfigDict) -> dict:
    """The task settings that define the data (not where it is cached)."""
    return {k: v for k, v in task_config.to_dict().items() if k != "data_dir"}


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
    data_dir = task_config.data_dir or os.path.join(workdir, "data")
    return Task(
        name="arithmetic",
        train=arithmetic.load_split(spec, "train", data_dir),
        test=arithmetic.load_split(spec, "test", data_dir),
        tokenizer=tokenizer or CharTokenizer.for_arithmetic(task_config.ops),
        rewards=per_sample_rewards(arithmetic_reward.reward),
        identity=task_identity(task_config),
    )
