r"""A scalar TL;DR reward model trained with the Bradley–Terry loss on preference pairs.

    # pairs from OpenAI's summarize-from-feedback comparisons (see tba_jax/data/preferences.py)
    python -m tba_jax.data.preferences --comparisons=/data/comparisons/batch*.json \
        --out=/data/tldr_preferences --tokenizer=/ckpt/pythia-1b-sft --max_prompt_len=512
    python experiments/train_reward_model.py --config=configs/reward_model.py \
        --workdir=/ckpt/rm_1b --config.model.hf_path=/ckpt/pythia-1b-sft \
        --config.data.manual_dir=/data/tldr_preferences
    # -> /ckpt/rm_1b/hf: use it as --config.task.reward_model.hf_path of configs/tldr_pythia.py
    # the same code path on a CPU in seconds: a random micro model, char tokenizer, fixture pairs
    python experiments/train_reward_model.py --config=configs/reward_model.py:tiny \
        --workdir=/tmp/rm_tiny

The recipe of Huang et al. 2024 ("The N+ implementation details of RLHF with PPO"),
which Noukhovitch et al. 2024 and the TBA paper's TL;DR reward models follow: start from
the SFT policy (`model.hf_path`, a *ForCausalLM folder: its body, a new scalar head with
std 1/sqrt(d_model + 1)), one epoch over the preference pairs, batches of 64 pairs,
lr 3e-6, AdamW (eps 1e-5), the score read at the EOS after each summary. Decaying the
learning rate linearly to 0 and clipping gradients at norm 1 are this repository's
choices. Inputs are prompt + " " + summary + EOS, at most 512 + 53 + 1 tokens (the
TL;DR run's prompt and response limits), the prompt truncated from the left beyond that.

Variant keys: any dotted path or a shortcut (steps, lr, batch, hf_path, manual_dir,
model); named variants: `2.8b` (a Pythia-2.8B reward model on one 80 GB GPU) and `tiny`.
The optimiser's fields and defaults and the learner's sharding rules are
configs/common.py's.
"""

import os
import pathlib
import sys

import ml_collections

try:
    from configs import common
except ImportError:  # loaded by path (--config=<file>): the repo root is not on sys.path
    sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))
    from configs import common

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_PREFERENCES_DIR = os.path.join(REPO_ROOT, "tests", "data", "tldr_tiny", "preferences")

SHORTCUTS = {
    "steps": "train.steps",
    "lr": "optim.learning_rate",
    "batch": "train.batch_size",
    "hf_path": "model.hf_path",
    "manual_dir": "data.manual_dir",
    "model": "model.preset",
}

NAMED_VARIANTS = {
    # A Pythia-2.8B SFT policy's reward model on one 80 GB GPU: 8 micro-batches of 8 pairs.
    # XLA plans the step at 67 GiB on an H100 this way, 106 GiB in the default 4 (python
    # benchmarks/static_profile.py --target=h100 --program=reward_model --shape=pythia-2.8b;
    # README, "Reward models on one GPU"). model.remat=nothing_saveable in 4 plans 59 GiB.
    "2.8b": {
        "model.preset": "pythia-2.8b",
        "train.num_microbatches": 8,
    },
    # A random micro model over printable-ASCII characters learns the fixture's synthetic
    # preference (lower-case summaries over SHOUTED ones) in a few dozen CPU steps. Its
    # zero score head ties every pair, so held-out accuracy starts at exactly 1/2.
    "tiny": {
        "tokenizer": "char",
        "model.preset": "micro",
        "model.dtype": "float32",
        "model.score_init_scale": 0.0,
        "data.manual_dir": TINY_PREFERENCES_DIR,
        "max_len": 256,  # characters: longer fixture prompts lose their start
        "train.steps": 24,
        "train.batch_size": 16,
        "train.num_microbatches": 2,
        "train.eval_batch_size": 16,
        "optim.learning_rate": 3e-3,
        "log_every": 10,
        "progress_bar": False,
        "checkpoint_every": 10,
    },
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.name = "reward_model"
    config.seed = 0
    # "checkpoint": model.hf_path's tokenizer; "char": printable ASCII (random presets).
    config.tokenizer = "checkpoint"
    config.max_len = 512 + 53 + 1  # prompt + summary + EOS tokens
    config.append_eos = True  # score at an EOS after the response, as RewardModel does
    config.out_dir = ""  # empty: <workdir>/hf

    config.model = ml_collections.ConfigDict()
    # REQUIRED at paper scale: the SFT policy (*ForCausalLM) the reward model starts from.
    config.model.hf_path = ""
    config.model.preset = "pythia-1b"  # the random stand-in's shape when hf_path is empty
    config.model.dtype = "bfloat16"  # compute
    config.model.param_dtype = "float32"  # stored params, Adam state and the saved folder
    config.model.score_init_scale = 1.0  # head std = scale / sqrt(d_model + 1); 0: zeros
    # How the passes are computed, not what (a resumed run may change them): a
    # jax.checkpoint policy per block (none | nothing_saveable | dots_saveable |
    # dots_with_no_batch_dims_saveable) and the attention kernel (einsum | dot_product | cudnn).
    config.model.remat = "none"
    config.model.attention = "einsum"

    config.data = ml_collections.ConfigDict()
    config.data.manual_dir = ""  # train.jsonl and test.jsonl of {prompt, chosen, rejected}
    config.data.data_dir = ""  # the prepared TFDS data; empty: <workdir>/data
    config.data.num_train = 0  # the first N pairs; 0: all
    config.data.num_test = 0

    config.train = ml_collections.ConfigDict()
    config.train.num_epochs = 1
    config.train.steps = 0  # > 0 overrides num_epochs
    config.train.batch_size = 64  # pairs per step
    config.train.num_microbatches = 4  # gradient accumulation: 16 pairs (32 rows) at a time
    config.train.eval_batch_size = 64  # pairs per forward when measuring held-out accuracy

    config.optim = common.optimizer()
    config.optim.learning_rate = 3e-6
    config.optim.schedule = "linear"  # to end_lr_fraction × lr at the last step
    config.optim.warmup_steps = 0
    config.optim.eps = 1e-5

    config.mesh = ml_collections.ConfigDict()
    # every device; params and the batch split over fsdp. Each axis is a key, so a run
    # sets any: --config.mesh.axes.data=-1 --config.mesh.axes.fsdp=1 (data parallel).
    config.mesh.axes = {"data": 1, "fsdp": -1, "tensor": 1}
    config.mesh.rules = common.learner_rules()

    config.compile_cache = common.compile_cache()

    config.log_every = 10
    config.progress_bar = True
    # The train state is saved every this many steps (and on SIGTERM / Ctrl-C); a rerun
    # goes on from the newest. The newest keep_checkpoints are kept until the model is saved.
    config.checkpoint_every = 200
    config.keep_checkpoints = 2

    return common.finalize(config, arg, SHORTCUTS, NAMED_VARIANTS)
