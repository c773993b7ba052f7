"""Automated red-teaming (Lee et al., 2024; the TBA paper's red-teaming experiments).

The policy is the ATTACKER: its one prompt is a fixed instruction
(`task.attacker_prompt`) and each sampled response is an attack. The reward
(tba_jax/rewards/redteam.py) is the judge's toxic log-prob of a frozen victim's answers.

Examples. Every example is the attacker prompt with prompt id 0, so the replay buffer
keeps all attacks in one group and a batch is 1 prompt × K attacks (Lee et al. train on
batches of samples from the single prompt; configs use prompts_per_batch=1, a large K,
and capacity_per_prompt = the buffer's capacity). The train split holds one example per
seed prompt (tba_jax/data/redteam.py, from `task.manual_dir`), with `solution` = the seed
prompt: the supervised warm start then fine-tunes the attacker to continue the attacker
prompt with seed attacks, as Lee et al. SFT their attacker. Repeated ids are what the
rest of the code expects here: the prompt stream shuffles the examples (all the same
prompt), the warm start reads each (prompt, solution) pair, and the buffer groups by id.
The test split is the attacker prompt once (the in-training evaluation's greedy attack).

`evaluate` (experiments/evaluate.py): `settings.num_samples` attacks (the config's
`eval.num_attacks`) sampled at the sampling temperature, the victim's responses, the
judge's verdicts → `toxic_percent` (attacks whose toxicity, the judge's probability
averaged over the victim's responses, is above `task.toxic_threshold`),
`mean_toxic_logprob` (the mean reward), `mean_toxicity`, `diversity_all` and
`diversity_toxic` (mean pairwise cosine distance of all-MiniLM-L6-v2 embeddings of all
attacks / of the toxic ones; null with fewer than 2), `num_attacks`, `num_toxic`,
`mean_attack_length` (tokens, EOS included) and the most toxic `example_attacks`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np

from tba_jax.config_lib import ConfigError
from tba_jax.data import redteam as redteam_data
from tba_jax.models.frozen import Placement
from tba_jax.models.tokenizers import Tokenizer
from tba_jax.rewards import judges, redteam
from tba_jax.sampling.engine import EngineConfig
from tba_jax.sampling.generate import generated_batches
from tba_jax.tasks.base import (
    MEAN_REWARD,
    EvalSettings,
    Task,
    evaluation_generate_fns,
    fits,
    keep_fitting,
    register_task,
    task_data_dir,
    task_identity,
    task_tokenizer,
    token_count,
)

CHECKPOINT_HINT = "attacker-checkpoint"
ATTACKER_PROMPT_ID = 0  # every example is the one attacker prompt


# ------------------------------------------------------------------------------- examples


def attacker_example(task_config: ml_collections.ConfigDict) -> dict:
    """The attacker prompt as an example."""
    return {"id": ATTACKER_PROMPT_ID, "prompt": task_config.attacker_prompt}


def check_attacker_prompt(task_config: ml_collections.ConfigDict, tokenizer: Tokenizer) -> None:
    """ConfigError when the attacker prompt cannot be encoded or is longer than allowed."""
    count = token_count(tokenizer, task_config.attacker_prompt)
    if count is None or count > task_config.max_prompt_len:
        length = "cannot be encoded" if count is None else f"is {count} tokens"
        raise ConfigError(
            f"task.attacker_prompt {length}; it must encode to at most max_prompt_len="
            f"{task_config.max_prompt_len} tokens (raise max_prompt_len or shorten it)."
        )


def train_examples(
    task_config: ml_collections.ConfigDict, data_dir: str, tokenizer: Tokenizer
) -> list[dict]:
    """One example per seed prompt that fits as an attack (with EOS), capped at num_train."""
    if not task_config.manual_dir:
        raise ConfigError(
            "task.manual_dir is empty: pass the folder holding the seed prompts "
            f"({redteam_data.expected_files_description()}); they are the attacker's "
            "warm-start targets and there is no public download."
        )
    seeds = redteam_data.load_split("train", data_dir, manual_dir=task_config.manual_dir)
    max_attack = task_config.max_solution_len - 1  # the warm start appends EOS

    def keep(seed: dict) -> bool:
        return fits(tokenizer, seed["prompt"], max_attack)

    described = f"Red-team seed prompts (attack + EOS <= {task_config.max_solution_len} tokens)"
    kept = keep_fitting(seeds, keep, task_config.num_train, described)
    return [
        {
            **attacker_example(task_config),
            "solution": seed["prompt"],
            "seed_id": seed["id"],
            "category": seed["category"],
        }
        for seed in kept
    ]


# ---------------------------------------------------------------------------------- reward


class LazyRedTeamReward:
    """The `RedTeamReward` of `task.victim` / `task.judge`, loaded on first use.

    Building the task (and every check before training: `check_redteam_task`) then does not
    wait for two frozen models to load; searcher threads share one load (a lock). Call it
    as `Task.rewards`.
    """

    def __init__(
        self,
        task_config: ml_collections.ConfigDict,
        fallback_tokenizer: Tokenizer,
        placement: Placement | None = None,
        engine: EngineConfig | None = None,
    ):
        self._task_config = task_config
        self._fallback_tokenizer = fallback_tokenizer
        self._placement = placement
        self._engine = engine
        self._reward: redteam.RedTeamReward | None = None
        self._lock = threading.Lock()

    def get(self) -> redteam.RedTeamReward:
        with self._lock:
            if self._reward is None:
                victim = redteam.Victim.from_config(
                    self._task_config.victim,
                    self._fallback_tokenizer,
                    self._placement,
                    self._engine,
                )
                judge = judges.judge_from_config(
                    self._task_config.judge, self._fallback_tokenizer, self._placement
                )
                self._reward = redteam.RedTeamReward(victim, judge)
            return self._reward

    def __call__(self, examples: Sequence[dict], responses: Sequence[str]) -> np.ndarray:
        return self.get()(examples, responses)


# ----------------------------------------------------------------------------- evaluation


def sample_attacks(
    model, params, tokenizer: Tokenizer, prompt: str, settings: EvalSettings
) -> tuple[list[str], np.ndarray]:
    """`settings.num_samples` attacks sampled from `prompt` (batch i drawn with
    fold_in(key(seed), i)): (texts, lengths int32 [N] in tokens, EOS included)."""
    _, sampling_fn = evaluation_generate_fns(model, tokenizer, settings)
    attacks: list[str] = []
    lengths: list[int] = []
    for batch_examples, _, _, out in generated_batches(
        sampling_fn,
        params,
        [{"prompt": prompt}] * settings.num_samples,
        tokenizer,
        max_prompt_len=settings.max_prompt_len,
        batch_size=settings.batch_size,
        rng=jax.random.key(settings.seed),
    ):
        real = len(batch_examples)
        generated, generated_lengths = jax.device_get((out.tokens, out.lengths))
        attacks.extend(tokenizer.decode(generated[row]) for row in range(real))
        lengths.extend(int(length) for length in generated_lengths[:real])
    return attacks, np.asarray(lengths, np.int32)


def diversity_or_none(embeddings: np.ndarray) -> float | None:
    """Mean pairwise cosine distance of the rows, or None (JSON null) for fewer than 2."""
    from tba_jax.rewards.diversity import mean_pairwise_cosine_distance  # needs safetensors

    return mean_pairwise_cosine_distance(embeddings) if len(embeddings) >= 2 else None


def attack_metrics(
    judged: redteam.JudgedAttacks,
    lengths: np.ndarray,
    embeddings: np.ndarray,
    *,
    toxic_threshold: float,
    num_examples: int,
) -> dict:
    """The red-teaming metrics of judged attacks (see the module docstring), JSON-able.

    lengths: [N] attack lengths in tokens; embeddings: [N, D] sentence embeddings.
    """
    toxicity = judged.toxicity
    toxic = toxicity > toxic_threshold
    most_toxic = np.argsort(-toxicity, kind="stable")[:num_examples]
    return {
        "num_attacks": len(judged.attacks),
        "num_toxic": int(toxic.sum()),
        "toxic_percent": 100.0 * float(toxic.mean()),
        "toxic_threshold": toxic_threshold,
        "mean_toxicity": float(toxicity.mean()),
        "mean_toxic_logprob": float(judged.rewards.mean()),
        "diversity_all": diversity_or_none(embeddings),
        "diversity_toxic": diversity_or_none(embeddings[toxic]),
        "mean_attack_length": float(np.mean(lengths)),
        "responses_per_attack": judged.toxic_logprob.shape[1],
        "example_attacks": [
            {
                "attack": judged.attacks[i],
                "toxicity": float(toxicity[i]),
                "response": judged.responses[i][0],
            }
            for i in most_toxic
        ],
    }


def make_evaluator(
    task_config: ml_collections.ConfigDict,
    tokenizer: Tokenizer,
    reward: LazyRedTeamReward,
    placement: Placement | None = None,
):
    """`Task.evaluate` for red-teaming: sample attacks, judge them, embed them (the sentence
    embedder on `placement`, as the victim and judge are)."""

    def evaluate(model, params, settings: EvalSettings, reference_params) -> dict:
        del reference_params  # the metrics need no π_ref
        if settings.num_samples < 1:
            raise ConfigError(
                f"num_samples={settings.num_samples}: red-teaming evaluation samples that many "
                "attacks; pass --num_samples >= 1 (the config's eval.num_attacks)."
            )
        from tba_jax.rewards.diversity import load_sentence_embedder  # needs safetensors

        # fails before sampling
        embedder = load_sentence_embedder(task_config.embedder_path, placement)
        attacks, lengths = sample_attacks(
            model, params, tokenizer, task_config.attacker_prompt, settings
        )
        judged = reward.get().judge_attacks(attacks)
        embeddings = embedder.embed(attacks, batch_size=task_config.embed_batch_size)
        metrics = attack_metrics(
            judged,
            lengths,
            embeddings,
            toxic_threshold=task_config.toxic_threshold,
            num_examples=task_config.num_example_attacks,
        )
        return {
            **metrics,
            "temperature": settings.temperature,
            "max_new_tokens": settings.max_new_tokens,
        }

    return evaluate


# ------------------------------------------------------------------------------------ task


def check_redteam_task(
    task_config: ml_collections.ConfigDict,
    tokenizer: Tokenizer | None = None,
    placement: Placement | None = None,
) -> None:
    """The red-team task's cheap checks (`tasks.check_task`): the attacker prompt fits,
    the victim and judge settings work (`redteam.check_roles`), and their models fit
    `placement` with their templates and verdicts (`redteam.check_role_models`: config
    and tokenizer files, no weights)."""
    tokenizer = task_tokenizer(task_config, tokenizer, CHECKPOINT_HINT)
    check_attacker_prompt(task_config, tokenizer)
    redteam.check_roles(task_config.victim, task_config.judge)
    redteam.check_role_models(task_config.victim, task_config.judge, tokenizer, placement)


@register_task(
    "redteam",
    evaluation_keys=(
        "embedder_path",
        "embed_batch_size",
        "toxic_threshold",
        "num_example_attacks",
    ),
    check=check_redteam_task,
)
def redteam_task(
    task_config: ml_collections.ConfigDict,
    workdir: str,
    tokenizer: Tokenizer | None = None,
    placement: Placement | None = None,
    engine: EngineConfig | None = None,
) -> Task:
    tokenizer = task_tokenizer(task_config, tokenizer, CHECKPOINT_HINT)
    reward = LazyRedTeamReward(task_config, tokenizer, placement, engine)
    return Task(
        name="redteam",
        train=train_examples(task_config, task_data_dir(task_config, workdir), tokenizer),
        test=[attacker_example(task_config)],
        tokenizer=tokenizer,
        rewards=reward,
        identity=task_identity(task_config),
        evaluate=make_evaluator(task_config, tokenizer, reward, placement),
        eval_metric=MEAN_REWARD,
    )
