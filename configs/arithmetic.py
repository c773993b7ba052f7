"""The built-in task: multi-step arithmetic, a tiny char-level policy, TBA on CPU.

    python experiments/train.py --config=configs/arithmetic.py --workdir=/tmp/tba_demo
    python experiments/train.py --config=configs/arithmetic.py:mode=sync,method=rloo ...

Variant keys: any dotted path (`optim.learning_rate=3e-4`) or a shortcut:
mode, method, steps, seed, k (sync period), m (recency prob), beta, model, hf_path,
K (samples per prompt in a batch), S (samples generated per prompt), searchers
(search.num_searchers).
The keys and values every training config shares are in configs/common.py.
"""

import pathlib
import sys

try:
    from configs import common
except ImportError:  # loaded by path (--config=<file>): the repo root is not on sys.path
    sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))
    from configs import common

SHORTCUTS = common.SHORTCUTS

# Named variants: `configs/arithmetic.py:smoke` (combine with key=value items).
NAMED_VARIANTS = {
    # The same code path in seconds: used by the test suite.
    "smoke": {
        **common.CPU_RUN,
        "model.preset": "micro",
        "task.num_train": 200,
        "task.num_test": 16,
        "warm_start.steps": 3,
        "warm_start.batch_size": 16,
        "batch.prompts_per_batch": 4,
        "batch.samples_per_prompt": 4,
        "batch.samples_generated_per_prompt": 4,
        "replay.min_prompts": 4,
        "search.prompts_per_call": 4,
        "eval.num_examples": 16,
        "eval.batch_size": 16,
    },
}


def get_config(arg: str | None = None):
    config = common.base_config("arithmetic")
    config.learner_steps = 300
    config.sync_period = 2
    config.max_prompt_len = 10
    config.max_response_len = 12

    config.task.name = "arithmetic"
    config.task.num_terms_min = 2
    config.task.num_terms_max = 3
    config.task.max_operand = 9
    config.task.max_result = 20
    config.task.ops = "+-"
    config.task.num_train = 2300
    config.task.num_test = 256
    config.task.seed = 1234
    # Imperfect demonstrations: this fraction of warm-start solutions ends with the
    # total before the last step. SFT imitates the slip; the reward teaches TBA not to.
    config.task.demo_error_rate = 0.6

    config.model.preset = "tiny"
    config.model.dtype = "float32"

    config.warm_start.steps = 500
    config.warm_start.learning_rate = 3e-3
    config.warm_start.warmup_steps = 10

    config.sampling.temperature = 1.0

    config.loss.beta_start = 0.1
    config.loss.beta_end = 0.05
    config.loss.beta_anneal_steps = 100

    # VinePPO's steps: the running totals ("68,61>61" is 68, | 61> | 61)
    config.loss.vineppo.step_delimiters = ",>"

    config.batch.prompts_per_batch = 16  # B
    config.batch.samples_per_prompt = 8  # K
    config.batch.samples_generated_per_prompt = 8  # S

    config.replay.capacity = 8000
    config.replay.capacity_per_prompt = 16
    config.replay.recency_prob = 0.8  # m
    config.replay.min_prompts = 32

    config.search.prompts_per_call = 16

    config.optim.learning_rate = 1e-4
    config.optim.schedule = "wsd"
    config.optim.warmup_steps = 10
    config.optim.decay_fraction = 0.2
    config.optim.b2 = 0.95

    config.mesh.sampler_devices = 0.5

    config.eval.num_examples = 256

    config.checkpoint_every = 50

    return common.finalize(config, arg, SHORTCUTS, NAMED_VARIANTS)
