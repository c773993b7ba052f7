"""Three learner steps on a fixed global batch, in one process or as one of several.

    python tests/multiprocess_step_check.py OUT.npz
    python -m tba_jax.launch --num_processes=2 -- tests/multiprocess_step_check.py OUT.npz

Builds the run of `configs/arithmetic.py:smoke,mode=sync` with `train.setup` (over
several processes: the roles_within_host learner mesh spanning them), takes three train
steps from the same random-init params on the same global batch (each process feeds its
own rows, as the training loop does), and has process 0 write the initial and the new
params to OUT.npz.
tests/test_multiprocess.py compares the files.
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
from absl import app

from configs.arithmetic import get_config
from tba_jax import distributed, learner, train
from tba_jax.models import init_model
from tba_jax.trajectories import SampledBatch

distributed.define_flags()
BATCH_SEED = 7
STEPS = 3


def global_batch(config, vocab_size: int) -> dict[str, np.ndarray]:
    """A batch of B×K random rows with every field the train step reads."""
    rng = np.random.default_rng(BATCH_SEED)
    rows = config.batch.prompts_per_batch * config.batch.samples_per_prompt
    prompt_len, response_len = config.max_prompt_len, config.max_response_len
    response_mask = (np.arange(response_len) < rng.integers(1, response_len, rows)[:, None]).astype(
        np.float32
    )
    return {
        "prompt_tokens": rng.integers(1, vocab_size, (rows, prompt_len)).astype(np.int32),
        "prompt_mask": np.ones((rows, prompt_len), bool),
        "response_tokens": rng.integers(1, vocab_size, (rows, response_len)).astype(np.int32),
        "response_mask": response_mask,
        "reward": rng.normal(size=rows).astype(np.float32),
        "logp_behaviour": rng.normal(-5, 1, rows).astype(np.float32),
        "logp_ref": rng.normal(-5, 1, rows).astype(np.float32),
        "token_logp_behaviour": np.zeros((rows, response_len), np.float32),
        "token_logp_ref": np.zeros((rows, response_len), np.float32),
        "policy_version": np.zeros(rows, np.int32),
        "created_at": np.zeros(rows),
        "policy_version_last": np.zeros(rows, np.int32),
    }


def main(argv):
    out = argv[1]
    distributed.initialize_from_flags()
    config = get_config("smoke,mode=sync")
    with tempfile.TemporaryDirectory() as workdir:
        run = train.setup(config, os.path.join(workdir, "run"))
        _, initial = init_model(run.model.config, config.seed)
        params = jax.device_put(initial, run.learner_shardings)
        state = learner.init_train_state(params, run.optimizer, run.state_sharding)
        full = global_batch(config, run.task.tokenizer.vocab_size)
        rank, count = run.topology.learner_rank, run.topology.num_learners
        rows = len(full["reward"]) // count
        mine = {name: value[rank * rows : (rank + 1) * rows] for name, value in full.items()}
        prompts = rows // config.batch.samples_per_prompt
        batch = SampledBatch(
            **mine, prompt_ids=np.arange(prompts), from_recency=np.ones(prompts, bool)
        )
        sharding = train.mesh_lib.batch_sharding(run.meshes.learner)
        for _ in range(STEPS):  # the learning rate warms up from 0 at step 0
            state, _ = run.train_step(state, train.device_batch(run, batch, sharding))
        new_params = jax.device_get(run.group.local_copy(state.params))
        if run.topology.is_primary:
            flat = {
                "initial" + jax.tree_util.keystr(path): np.asarray(leaf)
                for path, leaf in jax.tree_util.tree_leaves_with_path(initial)
            }
            flat |= {
                jax.tree_util.keystr(path): leaf
                for path, leaf in jax.tree_util.tree_leaves_with_path(new_params)
            }
            np.savez(out, **flat)
        run.checkpointer.close()


if __name__ == "__main__":
    app.run(main)
