"""Reddit TL;DR summarisation rewarded by a scalar reward model: the paper's TL;DR task.

- Data: `tba_jax.data.tldr` (train / test splits). Prompts are rebuilt for the POLICY
  tokenizer: the post is cut at whitespace so the prompt is at most `task.max_prompt_len`
  tokens; posts whose text the tokenizer cannot encode, or whose subreddit and title alone
  overrun the budget, are dropped. Example ids are indices in the split's source file
  (the Reddit id is kept as `post_id`); `reference_summary` is the human
  summary and `solution` = " " + that summary (the optional supervised warm start's target).
- Reward: `task.reward_model` (a `RewardModel` role section) on prompt + response; a
  sampled response that does not end with EOS gets `task.non_eos_penalty` instead
  (applied by the searchers, `tba_jax.runtime.SearchWorker`).
- Evaluation (`TldrEvaluator`, what experiments/evaluate.py writes): summaries of the
  first `num_examples` test posts, greedy and (with `num_samples > 0`) sampled at the
  sampling temperature, against the human reference summaries:
  win rate under `task.gold_reward_model` (ties 1/2), mean gold and reward-model scores
  of both, the perplexity of the generated summaries under π_ref at temperature 1, the
  sampled KL estimate mean(log π − log π_ref) per summary at the sampling temperature,
  mean length in tokens and the fraction that end with EOS. π_ref is the run's reference
  params; without them (`reference_params=None`), `task.reference_hf_path`'s weights;
  without that, the π_ref metrics are left out. The gold model is loaded on first use.

A role with an empty `hf_path` is a random `preset` stand-in sharing the policy's
tokenizer (the tiny variant); an empty `preset` means no stand-in, so `hf_path` is
required and its absence stops the run before any long work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import ml_collections
import numpy as np
from absl import logging

from tba_jax.config_lib import ConfigError
from tba_jax.data import tldr
from tba_jax.models import Model, Params
from tba_jax.models.frozen import Placement, frozen_model_layout
from tba_jax.models.tokenizers import Tokenizer
from tba_jax.rewards import ended_with_eos
from tba_jax.rewards.reward_model import RewardModel, reward_model_args
from tba_jax.sampling.generate import generated_batches
from tba_jax.sampling.scoring import make_score_fn
from tba_jax.tasks.base import (
    MEAN_REWARD,
    EvalSettings,
    Task,
    evaluation_generate_fns,
    first_test_examples,
    fits,
    register_task,
    task_data_dir,
    task_identity,
    task_tokenizer,
)

SUMMARY_PREFIX = " "  # summaries follow "TL;DR:" after one space (Huang et al. 2024)
PERPLEXITY_TEMPERATURE = 1.0  # the reference model's own distribution
REWARD_ROLES = {"reward_model": "reward model", "gold_reward_model": "gold reward model"}


# ---------------------------------------------------------------------------- examples


def reference_response(summary: str) -> str:
    """The text a human reference summary is scored as (what the policy writes after "TL;DR:")."""
    return SUMMARY_PREFIX + summary.strip()


def fitted_prompt(record: dict, tokenizer: Tokenizer, max_prompt_len: int) -> str | None:
    """The record's prompt with its post cut to fit `max_prompt_len` tokens, or None when the
    tokenizer cannot encode the text or the subreddit and title alone do not fit."""
    length_fn = lambda text: len(tokenizer.encode(text))
    whole = tldr.format_prompt(record["subreddit"], record["title"], record["post"])
    try:  # ValueError: a character outside a char tokenizer's alphabet, or a header too long
        if length_fn(whole) <= max_prompt_len:
            return whole
        return tldr.build_prompt(
            record["subreddit"], record["title"], record["post"], max_prompt_len, length_fn
        )
    except ValueError:
        return None


def make_example(index: int, record: dict, prompt: str) -> dict:
    """The task example of the `index`-th record of a split (see the module docstring)."""
    return {
        "id": index,
        "post_id": record["id"],
        "prompt": prompt,
        "reference_summary": record["reference_summary"],
        "solution": reference_response(record["reference_summary"]),
    }


def tldr_split(
    task_config: ml_collections.ConfigDict, split: str, data_dir: str, tokenizer: Tokenizer
) -> list[dict]:
    """The first `num_{split}` posts of a split (0: all) that fit the policy's limits."""
    records = tldr.load_split(split, data_dir, manual_dir=task_config.manual_dir or None)
    limit = task_config.num_train if split == "train" else task_config.num_test
    max_solution = task_config.max_solution_len if split == "train" else 0
    examples = []
    for index, record in enumerate(records):
        prompt = fitted_prompt(record, tokenizer, task_config.max_prompt_len)
        if prompt is None:
            continue
        example = make_example(index, record, prompt)
        # The warm start appends EOS to each solution.
        if max_solution and not fits(tokenizer, example["solution"], max_solution - 1):
            continue
        examples.append(example)
        if len(examples) == limit:
            break
    described = f"TL;DR {split} (prompt <= {task_config.max_prompt_len} tokens"
    described += f", summary + EOS <= {max_solution})" if max_solution else ")"
    logging.info("%s: kept %d of %d posts read.", described, len(examples), len(records))
    if not examples:
        raise ConfigError(f"{described}: no post fits; raise these limits.")
    return examples


# ------------------------------------------------------------------------ metric math


def win_rate(policy_scores: np.ndarray, reference_scores: np.ndarray) -> float:
    """Fraction of summaries scored above their reference, ties counting 1/2. [N], [N]."""
    policy, reference = np.asarray(policy_scores), np.asarray(reference_scores)
    if policy.shape != reference.shape or policy.size == 0:
        raise ValueError(
            f"win_rate needs equally many policy and reference scores (at least one), got "
            f"{policy.shape} and {reference.shape}."
        )
    return float(np.mean(np.where(policy > reference, 1.0, np.where(policy == reference, 0.5, 0))))


def perplexity(logp_sums: np.ndarray, token_counts: np.ndarray) -> float:
    """exp(−Σ log p / Σ tokens) over all summaries. logp_sums, token_counts: [N]."""
    total_tokens = float(np.sum(token_counts))
    if total_tokens <= 0:
        raise ValueError("perplexity needs at least one token.")
    return float(np.exp(-float(np.sum(logp_sums)) / total_tokens))


def kl_estimate(logp_policy: np.ndarray, logp_reference: np.ndarray) -> float:
    """mean over sampled summaries of log π(y|x) − log π_ref(y|x) (summed over tokens). [N]."""
    return float(np.mean(np.asarray(logp_policy) - np.asarray(logp_reference)))


# ------------------------------------------------------------------------- evaluation


class ReferenceScorer(NamedTuple):
    """π_ref params and jitted `make_score_fn`s at the sampling temperature and at 1."""

    params: Params
    score_at_temperature: Callable
    score_at_t1: Callable


@dataclasses.dataclass(frozen=True)
class Summaries:
    """Generated summaries of `examples` (one per example, in order), with their log-probs.

    texts: [N]; lengths: int [N] tokens incl. EOS; ended: bool [N]; logp_policy: [N]
    summed behaviour log-probs at the sampling temperature; logp_ref / logp_ref_at_t1:
    [N] summed π_ref log-probs at the sampling temperature / at temperature 1 (None
    without π_ref).
    """

    examples: list[dict]
    texts: list[str]
    lengths: np.ndarray
    ended: np.ndarray
    logp_policy: np.ndarray
    logp_ref: np.ndarray | None
    logp_ref_at_t1: np.ndarray | None


def draw_summaries(
    generate_fn,
    params: Params,
    examples: Sequence[dict],
    tokenizer: Tokenizer,
    settings: EvalSettings,
    rng: jax.Array,
    reference: ReferenceScorer | None,
) -> Summaries:
    """One summary per example (batch i drawn with fold_in(rng, i)), scored under π_ref
    when `reference` is given."""
    columns: dict[str, list] = {name: [] for name in ("texts", "lengths", "ended", "policy")}
    columns.update(ref=[], ref_t1=[])
    for batch_examples, prompts, prompt_mask, out in generated_batches(
        generate_fn,
        params,
        examples,
        tokenizer,
        max_prompt_len=settings.max_prompt_len,
        batch_size=settings.batch_size,
        rng=rng,
    ):
        real = len(batch_examples)
        if reference is not None:
            scored = (reference.params, prompts, prompt_mask, out.tokens, out.mask)
            at_t = reference.score_at_temperature(*scored).sum(-1)
            columns["ref"].append(np.asarray(at_t)[:real])
            columns["ref_t1"].append(np.asarray(reference.score_at_t1(*scored).sum(-1))[:real])
        tokens, lengths, token_logp = jax.device_get((out.tokens, out.lengths, out.token_logp))
        columns["texts"] += [tokenizer.decode(tokens[row]) for row in range(real)]
        columns["lengths"].append(lengths[:real])
        columns["ended"].append(ended_with_eos(tokens, lengths, tokenizer.eos_id)[:real])
        columns["policy"].append(token_logp.sum(-1)[:real])
    joined = lambda name: np.concatenate(columns[name]) if columns[name] else None
    return Summaries(
        examples=list(examples),
        texts=columns["texts"],
        lengths=joined("lengths"),
        ended=joined("ended"),
        logp_policy=joined("policy"),
        logp_ref=joined("ref"),
        logp_ref_at_t1=joined("ref_t1"),
    )


def summary_metrics(
    summaries: Summaries,
    gold_scores: np.ndarray,
    rm_scores: np.ndarray,
    reference_gold_scores: np.ndarray,
    *,
    with_kl: bool,
) -> dict[str, float]:
    """The metrics of one set of summaries (keys without the greedy_/sampled_ prefix)."""
    metrics = {
        "win_rate": win_rate(gold_scores, reference_gold_scores),
        "gold_score": float(np.mean(gold_scores)),
        "rm_score": float(np.mean(rm_scores)),
        "length": float(np.mean(summaries.lengths)),
        "eos_fraction": float(np.mean(summaries.ended)),
    }
    if summaries.logp_ref_at_t1 is not None:
        metrics["ref_perplexity"] = perplexity(summaries.logp_ref_at_t1, summaries.lengths)
        if with_kl:
            metrics["kl"] = kl_estimate(summaries.logp_policy, summaries.logp_ref)
    return metrics


class TldrEvaluator:
    """`Task.evaluate` for TL;DR (see the module docstring). Holds the reward model and,
    once first used, the gold reward model."""

    def __init__(
        self,
        task_config: ml_collections.ConfigDict,
        tokenizer: Tokenizer,
        test: Sequence[dict],
        reward_model: RewardModel,
    ):
        self.task_config = task_config
        self.tokenizer = tokenizer
        self.test = list(test)
        self.reward_model = reward_model
        self._gold: RewardModel | None = None

    def gold_model(self) -> RewardModel:
        if self._gold is None:
            self._gold = RewardModel.from_config(
                self.task_config.gold_reward_model,
                role_name="task.gold_reward_model",
                fallback_tokenizer=self.tokenizer,
                placement=self.reward_model.frozen.placement,  # beside the reward model
            )
        return self._gold

    def reference(self, model: Model, reference_params: Params | None) -> Params | None:
        """π_ref: the given params, else `task.reference_hf_path`'s, else None."""
        if reference_params is not None:
            return reference_params
        if not self.task_config.reference_hf_path:
            logging.warning("No reference params or task.reference_hf_path: no π_ref metrics.")
            return None
        from tba_jax.models import hf  # optional: needs safetensors

        return hf.load_params(self.task_config.reference_hf_path, model)

    def reference_scorer(
        self, model: Model, reference_params: Params | None, settings: EvalSettings
    ) -> ReferenceScorer | None:
        """π_ref (`reference`) with its jitted scorers, or None without π_ref."""
        ref_params = self.reference(model, reference_params)
        if ref_params is None:
            return None
        chunk = dict(rows_per_chunk=self.task_config.eval_score_rows_per_chunk)
        return ReferenceScorer(
            ref_params,
            make_score_fn(model, temperature=settings.temperature, **chunk),
            make_score_fn(model, temperature=PERPLEXITY_TEMPERATURE, **chunk),
        )

    def check_settings(self, settings: EvalSettings) -> None:
        chunk = self.task_config.eval_score_rows_per_chunk
        if chunk and settings.batch_size % chunk:
            raise ConfigError(
                f"task.eval_score_rows_per_chunk={chunk} does not divide eval.batch_size="
                f"{settings.batch_size}; pick a divisor or 0."
            )

    def draw_metrics(
        self,
        prefix: str,
        generate_fn,
        params: Params,
        examples: Sequence[dict],
        settings: EvalSettings,
        scorer: ReferenceScorer | None,
        reference_gold: np.ndarray,
    ) -> dict[str, float]:
        """`summary_metrics` of one summary per example, keys prefixed with `prefix`_."""
        rng = jax.random.key(settings.seed)
        summaries = draw_summaries(
            generate_fn, params, examples, self.tokenizer, settings, rng, scorer
        )
        prompts = [example["prompt"] for example in examples]
        metrics = summary_metrics(
            summaries,
            self.gold_model().scores(prompts, summaries.texts),
            self.reward_model.scores(prompts, summaries.texts),
            reference_gold,
            with_kl=prefix == "sampled",
        )
        return {f"{prefix}_{name}": value for name, value in metrics.items()}

    def __call__(
        self,
        model: Model,
        params: Params,
        settings: EvalSettings,
        reference_params: Params | None,
    ) -> dict:
        self.check_settings(settings)
        examples = first_test_examples("tldr", self.test, settings.num_examples)
        prompts = [example["prompt"] for example in examples]
        references = [reference_response(example["reference_summary"]) for example in examples]
        reference_gold = self.gold_model().scores(prompts, references)
        result = {
            "num_examples": len(examples),
            "max_new_tokens": settings.max_new_tokens,
            "reward_model": self.reward_model.source,
            "gold_reward_model": self.gold_model().source,
            "gold_score_reference": float(np.mean(reference_gold)),
            "rm_score_reference": float(np.mean(self.reward_model.scores(prompts, references))),
        }
        scorer = self.reference_scorer(model, reference_params, settings)
        greedy_fn, sampling_fn = evaluation_generate_fns(model, self.tokenizer, settings)
        common = dict(params=params, settings=settings, scorer=scorer)
        result.update(
            self.draw_metrics(
                "greedy", greedy_fn, examples=examples, reference_gold=reference_gold, **common
            )
        )
        if settings.num_samples:
            n = settings.num_samples
            repeated = [example for example in examples for _ in range(n)]
            result.update(num_samples=n, temperature=settings.temperature)
            result.update(
                self.draw_metrics(
                    "sampled",
                    sampling_fn,
                    examples=repeated,
                    reference_gold=np.repeat(reference_gold, n),
                    **common,
                )
            )
        return result


# ------------------------------------------------------------------------------- task


def check_reward_roles(task_config: ml_collections.ConfigDict) -> None:
    """ConfigError for a reward-model role with neither a checkpoint nor a stand-in preset."""
    for key, described in REWARD_ROLES.items():
        role = task_config[key]
        if not role.hf_path and not role.preset:
            raise ConfigError(
                f"task.{key}.hf_path is empty and task.{key}.preset names no random stand-in; "
                f"pass --config.task.{key}.hf_path=/path/to/{described.replace(' ', '-')} "
                "(a local *ForSequenceClassification folder, e.g. from "
                "experiments/train_reward_model.py)."
            )


def check_tldr_task(
    task_config: ml_collections.ConfigDict,
    tokenizer: Tokenizer | None = None,
    placement: Placement | None = None,
) -> None:
    """The TL;DR task's cheap checks (`tasks.check_task`): each reward-model role names a
    model (`check_reward_roles`), and the reward model fits `placement` (its layout from
    config files, no weights)."""
    tokenizer = task_tokenizer(task_config, tokenizer, task_config.checkpoint_hint)
    check_reward_roles(task_config)
    frozen_model_layout(
        task_config.reward_model,
        fallback_tokenizer=tokenizer,
        placement=placement,
        **reward_model_args(task_config.reward_model, "task.reward_model"),
    )


@register_task(
    "tldr",
    evaluation_keys=("gold_reward_model", "reference_hf_path", "eval_score_rows_per_chunk"),
    check=check_tldr_task,
)
def tldr_task(
    task_config: ml_collections.ConfigDict,
    workdir: str,
    tokenizer: Tokenizer | None = None,
    placement: Placement | None = None,
) -> Task:
    tokenizer = task_tokenizer(task_config, tokenizer, task_config.checkpoint_hint)
    data_dir = task_data_dir(task_config, workdir)
    train = tldr_split(task_config, "train", data_dir, tokenizer)
    test = tldr_split(task_config, "test", data_dir, tokenizer)
    reward_model = RewardModel.from_config(
        task_config.reward_model,
        role_name="task.reward_model",
        fallback_tokenizer=tokenizer,
        placement=placement,
    )
    return Task(
        name="tldr",
        train=train,
        test=test,
        tokenizer=tokenizer,
        rewards=reward_model,
        identity=task_identity(task_config),
        evaluate=TldrEvaluator(task_config, tokenizer, test, reward_model),
        non_eos_penalty=task_config.non_eos_penalty,
        eval_metric=MEAN_REWARD,
    )
