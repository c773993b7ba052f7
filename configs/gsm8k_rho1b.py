r"""TBA on GSM8K from the Rho-1B SFT checkpoint: the paper's GSM8K experiment.

    python experiments/train.py --config=configs/gsm8k_rho1b.py --workdir=/ckpt/tba_gsm8k \
        --config.model.hf_path=/path/to/rho-1b-sft \
        --config.task.manual_dir=/path/to/gsm8k    # the folder of train.jsonl and test.jsonl
    python experiments/evaluate.py --workdir=/ckpt/tba_gsm8k
    # the same code path on a CPU in seconds: micro policy, char tokenizer, a data subset
    python experiments/train.py --config=configs/gsm8k_rho1b.py:tiny,manual_dir=/path/to/gsm8k \
        --workdir=/tmp/gsm8k_tiny

Hyper-parameters are what the authors ran (bbartoldson/TBA: launch_training_gsm8k.sh
over configs/tba_rho1b_gsm8k.yml and src/tba_trainer_gsm8k.py; ../shared/reference):
K=20 samples per prompt in a batch out of S=24 generated (rloo_k × buffer multiplier
1.2), m=0.95, sync period k=2, batches of 7 prompts × 20 (7 accumulated micro-batches of
20), temperature 0.7, prompts up to 256 tokens and responses up to 512, uniform replay
over a prompt's samples (inverse temperature 0), at most 100 samples per prompt, and
about 500 samples in the buffer before training starts, and their replay rules
(`replay.draw_rule="authors"`, from their src/buffer_utils.py: online prompts without
replacement per sync window, K of a prompt's online samples uniformly, offline prompts in
epochs, eviction by policy version). From the launch script: 700
learner steps (98,000 episodes at 140 per step; "accuracy barely changes from 700 to
1000"), β from 0.014 linearly towards 0.004 at update 500 (their target and stop
iteration), and lr 1e-5 warmup-stable-decay with 50 warmup and 350 stable steps and a
600-step decay that the run cuts at step 700, halfway: here a linear decay to half the
peak over the last 300 steps, the same line (the reference does not say whether their
decay was linear or cosine). Where the paper's text and the authors' yml differ (β₀
0.012, 1000 steps, 450 stable and 500 decay steps), this config follows the launch
script. π_ref is the SFT checkpoint itself (no
warm start: it *is* the supervised model).

The policy needs `model.hf_path`: a local Hugging Face folder of the Rho-1B SFT model
(realtreetune/rho-1b-sft-GSM8K, the `rho-1b` preset's shape); its tokenizer is the
task's. Without it the run stops with an error saying so.

Variant keys: any dotted path or a shortcut (mode, method, steps, seed, k, m, beta,
model, hf_path, K, S, manual_dir); named variant: `tiny`. The keys and values every training
config shares are in configs/common.py.
"""

import pathlib
import sys

try:
    from configs import common
except ImportError:  # loaded by path (--config=<file>): the repo root is not on sys.path
    sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))
    from configs import common

SHORTCUTS = {**common.SHORTCUTS, "manual_dir": "task.manual_dir"}

# Named variants: `configs/gsm8k_rho1b.py:tiny` (combine with key=value items).
NAMED_VARIANTS = {
    # The paper's code path on a CPU in seconds: a random micro policy over printable-ASCII
    # characters, a few steps on the first problems short enough for char-level lengths.
    # Give it the GSM8K files with `manual_dir=/path/to/gsm8k` (or a network).
    "tiny": {
        **common.TINY_RUN,
        "task.num_train": 32,
        "task.num_test": 8,
        "task.max_solution_len": 128,  # = max_response_len: the warm start needs them to fit
        "max_prompt_len": 160,  # characters: about one training problem in eight fits
        "max_response_len": 128,
        "warm_start.steps": 2,
        "warm_start.batch_size": 8,
        "batch.prompts_per_batch": 2,
        "batch.samples_per_prompt": 4,
        "batch.samples_generated_per_prompt": 4,
        "batch.num_microbatches": 2,
        "replay.min_prompts": 2,
        "search.prompts_per_call": 2,
        "eval.num_examples": 8,
        "eval.batch_size": 8,
        "eval.max_new_tokens": 128,
        "eval.num_samples": 4,
        "eval.ks": (1, 2, 4),
    },
}


def get_config(arg: str | None = None):
    config = common.base_config("gsm8k_rho1b")
    config.learner_steps = 700  # 98,000 episodes / (7 prompts × 20) per step
    config.sync_period = 2  # k

    # Tokens (or characters, for the tiny variant's char tokenizer).
    config.max_prompt_len = 256  # the paper's limit (its code asserts every prompt fits)
    config.max_response_len = 512

    config.task.name = "gsm8k"
    # A folder holding train.jsonl and test.jsonl; empty: download them (needs a network).
    config.task.manual_dir = ""
    config.task.num_train = 0  # the first N problems that fit; 0: all of them
    config.task.num_test = 0
    # The task's own tokenizer when model.hf_path is empty: "checkpoint" (none: hf_path is
    # required) or "char" (printable ASCII + newline, for the tiny stand-in policy).
    config.task.tokenizer = "checkpoint"
    # Problems whose prompt is longer than this are dropped (tied to max_prompt_len).
    config.task.max_prompt_len = config.get_ref("max_prompt_len")
    # > 0: also drop training problems whose worked solution + EOS is longer than this
    # (a supervised warm start needs them to fit max_response_len); 0: keep all.
    config.task.max_solution_len = 0

    # REQUIRED at paper scale: model.hf_path, the Rho-1B SFT checkpoint (a local Hugging
    # Face folder). No warm start (warm_start.steps=0): the checkpoint is the SFT model.
    config.model.preset = "rho-1b"  # documents the architecture; hf_path's config.json rules
    config.model.dtype = "bfloat16"  # compute, as the paper's bf16 runs
    # π_ref: the SFT model. Follows model.hf_path unless set; empty = the warm-started policy.
    common.reference_follows_policy(config)

    config.sampling.temperature = 0.7

    config.loss.beta_start = 0.014  # the launch script's (the yml's default: 0.012)
    config.loss.beta_end = 0.004
    config.loss.beta_anneal_steps = 500  # their target iteration
    config.loss.beta_cut_steps = 500  # and stop iteration

    config.batch.prompts_per_batch = 7  # B
    config.batch.samples_per_prompt = 20  # K
    config.batch.samples_generated_per_prompt = 24  # S = 1.2 K
    config.batch.num_microbatches = 7  # the paper's gradient accumulation: one prompt each

    config.replay.capacity = 200_000  # host memory bound (~2 GB); the paper caps per prompt
    config.replay.capacity_per_prompt = 100
    config.replay.recency_prob = 0.95  # m
    config.replay.priority_inverse_temperature = 0.0  # the paper's uniform choice
    config.replay.draw_rule = "authors"  # their src/buffer_utils.py (../shared/reference)
    config.replay.min_prompts = 21  # ≈ the paper's 500 initial samples at S=24

    # The paper searches on 3 GPUs beside 1 training GPU; here those devices form the
    # sampler mesh (mesh.sampler_devices) and one thread drives it data-parallel.
    config.search.prompts_per_call = 3  # the paper's 72 rollouts per call = 3 prompts × S

    config.optim.learning_rate = 1e-5
    config.optim.schedule = "wsd"
    config.optim.warmup_steps = 50  # their warmup ratio 0.0714 of 700
    # 350 stable steps, then the first half of their 600-step linear decay to 0: 300
    # steps from the peak to half of it.
    config.optim.decay_fraction = 300 / 700
    config.optim.end_lr_fraction = 0.5
    # AdamW as Hugging Face's Trainer defaults: no weight decay, the base's betas and eps.
    config.optim.weight_decay = 0.0

    # 0.7 of a host's devices sample: 3 of 4 (the paper's split), 6 of 8, 1 of 2.
    config.mesh.sampler_devices = 0.7

    config.eval.num_examples = 1319  # the whole GSM8K test split
    # experiments/evaluate.py: greedy pass@1 with up to 512 new tokens, and pass@k from
    # num_samples responses per problem at the sampling temperature.
    config.eval.max_new_tokens = 512
    config.eval.num_samples = 16
    config.eval.ks = (1, 4, 16)

    config.checkpoint_every = 175  # every quarter of the run

    return common.finalize(config, arg, SHORTCUTS, NAMED_VARIANTS)
