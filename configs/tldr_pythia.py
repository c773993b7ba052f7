r"""TBA on Reddit TL;DR from a Pythia SFT policy with a Pythia reward model: the paper's
preference-tuning experiment.

    # 1. a reward model from the SFT policy and OpenAI's preference pairs (configs/reward_model.py)
    python experiments/train_reward_model.py --config=configs/reward_model.py \
        --workdir=/ckpt/rm_1b --config.model.hf_path=/ckpt/pythia-1b-sft \
        --config.data.manual_dir=/data/tldr_preferences
    # 2. TBA: policy and π_ref = the SFT folder, reward = step 1's folder, win rate by a gold RM
    python experiments/train.py --config=configs/tldr_pythia.py:1b --workdir=/ckpt/tba_tldr_1b \
        --config.model.hf_path=/ckpt/pythia-1b-sft \
        --config.task.reward_model.hf_path=/ckpt/rm_1b/hf \
        --config.task.gold_reward_model.hf_path=/ckpt/gold_rm \
        --config.task.manual_dir=/data/tldr    # train.jsonl, valid.jsonl, test.jsonl
    # 3. win rate vs the human summaries, reference perplexity, KL -> /ckpt/tba_tldr_1b/eval.json
    python experiments/evaluate.py --workdir=/ckpt/tba_tldr_1b [--num_examples=0]
    # the same code path on a CPU in seconds: micro policy, char tokenizer, random micro
    # reward and gold models, the synthetic posts of tests/data/tldr_tiny
    python experiments/train.py --config=configs/tldr_pythia.py:tiny --workdir=/tmp/tldr_tiny
    python experiments/evaluate.py --workdir=/tmp/tldr_tiny

Hyper-parameters are the paper's (arXiv 2503.18929), following Noukhovitch et al. 2024
("Asynchronous RLHF") and Huang et al. 2024 ("The N+ implementation details of RLHF with
PPO"): K=20 samples per prompt in a batch out of S=20 generated, m=0.5, sync period
k=10, batches of 8 prompts × 20 (8 accumulated micro-batches of one prompt), lr 3e-6
constant after a 20-step linear warmup (the warmup length is our choice), AdamW,
temperature 0.7, β by the authors' rule (bbartoldson/TBA, ../shared/reference): from 1
linearly towards 0.05 as if over 128 updates, cut at update 32 (β ≈ 0.78 at update 31,
0.05 from then on), reward-prioritised replay draws with inverse temperature 1 over the
reward model's score (softmax) under the authors' replay rules
(`replay.draw_rule="authors"`, their src/buffer_utils.py: online prompts without
replacement per sync window, offline prompts in epochs, eviction by policy version),
prompts up to 512 tokens (the post cut at whitespace to fit) and responses up to 53, a
reward of −1.0 for a response that does not end with EOS. Episodes: the paper's 256
updates × 512 = 131,072 episodes at 8 × 20 = 160 episodes per learner step are 819.2
steps; 820 steps cover them (820 × 160 = 131,200). π_ref is the SFT checkpoint itself
(no warm start).

Three local Hugging Face folders are needed at paper scale: `model.hf_path` (the SFT
policy, e.g. Pythia-1B-deduped SFT'd on TL;DR as in Huang et al.; its tokenizer is the
task's), `task.reward_model.hf_path` and `task.gold_reward_model.hf_path` (scalar
*ForSequenceClassification reward models, num_labels=1). Missing ones stop the run with
the flag to pass. The in-training `eval_mean_reward*` are the mean reward-model scores of
greedy summaries of the first `eval.num_examples` test posts; experiments/evaluate.py
reports the win rate (the paper evaluates on a subset of the 6,553 test posts:
`eval.num_examples`, or `--num_examples=0` for all).

Variant keys: any dotted path or a shortcut (mode, method, steps, seed, k, m, beta,
model, hf_path, K, S, manual_dir, rm, gold); named variants: `410m`, `1b`, `2.8b` (the
policy size: preset and the checkpoint named in errors) and `tiny`. The keys and values
every training config shares are in configs/common.py.
"""

import os
import pathlib
import sys

from tba_jax.rewards.reward_model import reward_model_role_config

try:
    from configs import common
except ImportError:  # loaded by path (--config=<file>): the repo root is not on sys.path
    sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))
    from configs import common

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_DATA_DIR = os.path.join(REPO_ROOT, "tests", "data", "tldr_tiny")

SHORTCUTS = {
    **common.SHORTCUTS,
    "manual_dir": "task.manual_dir",
    "rm": "task.reward_model.hf_path",
    "gold": "task.gold_reward_model.hf_path",
}


def policy_size(size: str) -> dict:
    """The named variant of a Pythia policy size: its preset and SFT checkpoint hint."""
    return {"model.preset": f"pythia-{size}", "task.checkpoint_hint": f"pythia-{size}-sft"}


# Named variants: `configs/tldr_pythia.py:2.8b` (combine with key=value items).
NAMED_VARIANTS = {
    "410m": policy_size("410m"),
    "1b": policy_size("1b"),
    "2.8b": policy_size("2.8b"),
    # The paper's code path on a CPU in seconds: a micro policy over printable-ASCII
    # characters, warm-started on the fixture's reference summaries (it is π_ref), random
    # micro reward and gold models, a few TB steps.
    "tiny": {
        **common.TINY_RUN,
        "task.manual_dir": TINY_DATA_DIR,
        "task.max_solution_len": 48,  # = max_response_len: the warm start needs them to fit
        "task.reward_model.preset": "micro",
        "task.reward_model.seed": 1,
        "task.reward_model.dtype": "float32",
        "task.reward_model.batch_size": 16,
        "task.reward_model.min_bucket_len": 512,  # one padded length: one compile on CPU
        "task.gold_reward_model.preset": "micro",
        "task.gold_reward_model.seed": 2,
        "task.gold_reward_model.batch_size": 16,
        "task.gold_reward_model.min_bucket_len": 512,
        "max_prompt_len": 256,  # characters: 14 of the 72 fixture posts are cut to fit
        "max_response_len": 48,
        "warm_start.steps": 20,
        "warm_start.batch_size": 16,
        "batch.prompts_per_batch": 2,
        "batch.samples_per_prompt": 4,
        "batch.samples_generated_per_prompt": 4,
        "batch.num_microbatches": 2,
        "replay.min_prompts": 2,
        "sync_period": 2,  # publishes within the 4 steps
        "search.prompts_per_call": 2,
        "search.score_rows_per_chunk": 0,
        "task.eval_score_rows_per_chunk": 0,
        "eval.num_examples": 8,
        "eval.batch_size": 8,
        "eval.max_new_tokens": 48,
        "eval.num_samples": 2,
        "eval.ks": (1, 2),
    },
}


def scored_length(config):
    """A one-way link to a reward model's row length: prompt + response + EOS tokens."""
    return config.get_ref("max_prompt_len") + config.get_ref("max_response_len") + 1


def get_config(arg: str | None = None):
    config = common.base_config("tldr_pythia")
    config.learner_steps = 820  # ceil(131,072 episodes / (8 prompts × 20) per step)
    config.sync_period = 10  # k

    # Tokens (or characters, for the tiny variant's char tokenizer).
    config.max_prompt_len = 512
    config.max_response_len = 53

    # REQUIRED at paper scale: model.hf_path, the SFT policy (a local Hugging Face folder).
    # No warm start (warm_start.steps=0): the checkpoint is the SFT model.
    config.model.preset = "pythia-1b"  # documents the architecture; hf_path's config.json rules
    config.model.dtype = "bfloat16"  # compute
    # π_ref: the SFT model. Follows model.hf_path unless set; empty = the warm-started policy.
    common.reference_follows_policy(config)

    config.task.name = "tldr"
    # A folder holding train.jsonl, valid.jsonl and test.jsonl of tldr_3_filtered; empty:
    # download them (needs a network).
    config.task.manual_dir = ""
    config.task.num_train = 0  # the first N posts that fit; 0: all of them
    config.task.num_test = 0
    # The task's own tokenizer when model.hf_path is empty: "checkpoint" (none: hf_path is
    # required) or "char" (printable ASCII + newline, for the tiny stand-in policy).
    config.task.tokenizer = "checkpoint"
    config.task.checkpoint_hint = "pythia-1b-sft"  # the policy folder named in errors
    # Posts are cut at whitespace so the prompt fits this many policy tokens.
    config.task.max_prompt_len = config.get_ref("max_prompt_len")
    # > 0: also drop training posts whose " " + summary + EOS is longer (a supervised warm
    # start needs them to fit max_response_len); 0: keep all.
    config.task.max_solution_len = 0
    config.task.non_eos_penalty = -1.0  # the reward of a response that does not end with EOS
    # task.evaluate scores its summaries under π_ref this many rows at a time (a divisor
    # of eval.batch_size); 0: a whole generate batch at once.
    config.task.eval_score_rows_per_chunk = 32
    # π_ref for task.evaluate when it is called without the run's reference params.
    config.task.reference_hf_path = config.reference.get_ref("hf_path") + ""  # one-way link
    # Scalar reward models: hf_path REQUIRED at paper scale (empty preset: no stand-in).
    # Rows are prompt + response + EOS in the model's own tokens (prompt cut from the left).
    config.task.reward_model = reward_model_role_config(dtype="bfloat16", batch_size=80)
    config.task.reward_model.max_len = scored_length(config)
    # Evaluation only (loaded on first use): win rates are judged by this model.
    config.task.gold_reward_model = reward_model_role_config(dtype="float32", batch_size=64)
    config.task.gold_reward_model.max_len = scored_length(config)

    config.sampling.temperature = 0.7
    # method=ppo: the value model starts as the reward model, as Huang et al. 2024 start
    # theirs (their reward model shares the policy's tokenizer, as this needs).
    config.loss.ppo.critic_init = "reward_model"

    config.loss.beta_start = 1.0
    config.loss.beta_end = 0.05
    config.loss.beta_anneal_steps = 128  # the authors' target iteration
    config.loss.beta_cut_steps = 32  # and stop iteration

    config.batch.prompts_per_batch = 8  # B
    config.batch.samples_per_prompt = 20  # K
    config.batch.samples_generated_per_prompt = 20  # S
    config.batch.num_microbatches = 8  # one prompt's 20 samples at a time

    config.replay.capacity = 200_000  # host memory bound
    config.replay.capacity_per_prompt = 100
    config.replay.recency_prob = 0.5  # m
    # softmax (the base's priority) of the reward-model score, as the authors ran it
    config.replay.priority_inverse_temperature = 1.0
    config.replay.draw_rule = "authors"  # their src/buffer_utils.py (../shared/reference)
    config.replay.min_prompts = 8  # one batch of prompts before training starts

    config.search.prompts_per_call = 4  # 80 rollouts per call = 4 prompts × S
    # π_ref scoring of a call's rows this many at a time (Pythia's [rows, 565, 50,304]
    # float32 logits are 2.3 GB per 20 rows); 0: all rows at once. Must divide
    # prompts_per_call × S (async) and prompts_per_batch × K (sync).
    config.search.score_rows_per_chunk = 20

    config.optim.learning_rate = 3e-6
    config.optim.schedule = "constant"  # after the warmup
    config.optim.warmup_steps = 20
    config.optim.decay_fraction = 0.0  # only read by schedule="wsd"

    config.eval.num_examples = 1024  # a subset of the 6,553 test posts; evaluate.py: 0 = all
    # experiments/evaluate.py: greedy summaries and num_samples sampled ones per post at the
    # sampling temperature (the KL estimate needs samples), up to max_new_tokens each.
    config.eval.max_new_tokens = config.get_ref("max_response_len") + 0  # one-way link
    config.eval.num_samples = 1
    config.eval.ks = (1,)  # not used by TL;DR (pass@k is for verifiable rewards)

    config.checkpoint_every = 205  # every quarter of the run

    return common.finalize(config, arg, SHORTCUTS, NAMED_VARIANTS)
