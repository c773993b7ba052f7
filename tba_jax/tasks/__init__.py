"""Tasks by name: what a run trains on (data, tokenizer, reward, metrics), from `config.task`.

A task builder returns a `Task`; `config.task.name` picks one:

- `arithmetic`: the built-in task (tasks/arithmetic.py).
- `gsm8k`: GSM8K math word problems with the last-number reward (tasks/gsm8k.py).
- `tldr`: Reddit TL;DR summaries scored by a reward model; win rate under a gold reward
  model (tasks/tldr.py).
- `redteam`: an attacker policy against a frozen victim and a toxicity judge; % toxic and
  diversity (tasks/redteam.py).

Importing this package registers every task module below.
"""

from tba_jax.tasks import arithmetic, gsm8k, redteam, tldr  # noqa: F401  (registers them)
from tba_jax.tasks.base import (
    CHAR_TOKENIZER,
    CHECKPOINT_TOKENIZER,
    LOCATION_KEYS,
    BatchRewardFn,
    EvalSettings,
    Task,
    TaskBuilder,
    TaskEvaluator,
    build_task,
    check_task,
    fits,
    keep_fitting,
    per_sample_rewards,
    register_task,
    registered_tasks,
    task_data_dir,
    task_identity,
    task_tokenizer,
    token_count,
)

__all__ = [
    "CHAR_TOKENIZER",
    "CHECKPOINT_TOKENIZER",
    "LOCATION_KEYS",
    "BatchRewardFn",
    "EvalSettings",
    "Task",
    "TaskBuilder",
    "TaskEvaluator",
    "build_task",
    "check_task",
    "fits",
    "keep_fitting",
    "per_sample_rewards",
    "register_task",
    "registered_tasks",
    "task_data_dir",
    "task_identity",
    "task_tokenizer",
    "token_count",
]
