"""Bradley–Terry reward-model training on preference pairs (`train_reward_model`).

The paper's reward models (Huang et al. 2024, "The N+ implementation details of RLHF with
PPO"; Noukhovitch et al. 2024) start from the SFT policy: its decoder body, with the
language-model head replaced by a fresh scalar head drawn from N(0, 1/(d_model + 1))
(`model.score_init_scale` scales that std; 0 gives a zero head). They are trained for
one epoch with the loss

    L = mean_pairs −log σ(r(x, y_chosen) − r(x, y_rejected))

where r is the score at the EOS after the response, on inputs encoded exactly as
`tba_jax.rewards.reward_model.RewardModel` encodes them when it scores samples.

`train_reward_model(config, workdir)` (configs/reward_model.py, experiments/
train_reward_model.py) reads pairs with `tba_jax.data.preferences`, reports the held-out
pairwise accuracy (ties count 1/2) before and after training, and saves the model as a
Hugging Face folder (`<workdir>/hf`, or `config.out_dir`) that a TL;DR run uses as
`task.reward_model.hf_path` and transformers loads as *ForSequenceClassification. The
tokenizer files go with it: copied from `model.hf_path`, or, for the char tokenizer of
the tiny variant, written as an equivalent tokenizer.json (`CharTokenizer.save_pretrained`), so
the folder is complete either way. `<workdir>/rm_summary.json` holds the numbers.

Training runs on one mesh over all devices (`mesh.axes`, `mesh.rules`: FSDP by default),
with micro-batch gradient accumulation; `model.remat` and `model.attention` set how the
forward and backward passes are computed (`ModelConfig`'s execution fields), not what, so
a resumed run may change them. Every `checkpoint_every` steps, and when SIGTERM or
Ctrl-C stops it, the train state is saved in `<workdir>/checkpoints` (the newest
`keep_checkpoints`); rerunning the same command goes on from the newest one that restores
(one that does not is set aside) and ends where an unstopped run would. A workdir whose
checkpoints another config wrote is refused. Once the model folder and the summary are
written, the checkpoints (the params with their Adam state, about 12 bytes a parameter)
are removed: the folder supersedes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

from tba_jax import compile_cache, config_lib, learner
from tba_jax import mesh as mesh_lib
from tba_jax.batching import fixed_size_batches
from tba_jax.checkpoint import (
    CHECKPOINTS_SUBDIR,
    EXPERIMENT_FILENAME,
    Checkpointer,
    check_experiment,
    claimed_workdir,
    holds_saved_steps,
    newest_restorable,
    remove_saved_steps,
    stop_on_signals,
)
from tba_jax.config_lib import ConfigError
from tba_jax.data import preferences
from tba_jax.metrics import MetricsWriter, write_json_atomically
from tba_jax.models import Model, ModelConfig, Params, abstract_model, init_model, preset
from tba_jax.models import sequence_scores as model_sequence_scores
from tba_jax.models.config import ATTENTIONS, DTYPES, REMAT_POLICIES
from tba_jax.models.tokenizers import CharTokenizer, Tokenizer, pad_sequences_with_mask
from tba_jax.rewards.reward_model import (
    SCORE_LABEL,
    bucket_for,
    bucket_lengths,
    encode_scored_text,
)
from tba_jax.tasks.base import CHAR_TOKENIZER, CHECKPOINT_TOKENIZER

SUMMARY_FILENAME = "rm_summary.json"
HF_SUBDIR = "hf"
PAIR_ARRAYS = ("chosen_tokens", "chosen_mask", "rejected_tokens", "rejected_mask")
# Config keys that do not change the trained model: a resumed run may change them.
RUN_ONLY_KEYS = (
    "variant",
    "out_dir",
    "log_every",
    "progress_bar",
    "checkpoint_every",
    "keep_checkpoints",
    "compile_cache",
)
# config.model keys that set how the model is computed, not what: a resumed run may too.
EXECUTION_KEYS = ("remat", "attention")
RANGES = {
    **config_lib.COMPILE_CACHE_RANGES,
    **config_lib.OPTIM_RANGES,
    "seed": config_lib.integer_at_least(0),
    "max_len": config_lib.integer_at_least(2),  # a token of text and the EOS at least
    "append_eos": config_lib.BOOLEAN,
    "data.num_train": config_lib.integer_at_least(0),  # 0: all (as a slice's end, -1 would
    "data.num_test": config_lib.integer_at_least(0),  # leave out the last pair)
    "train.batch_size": config_lib.integer_at_least(1),
    "train.num_microbatches": config_lib.integer_at_least(1),
    "train.eval_batch_size": config_lib.integer_at_least(1),
    "train.num_epochs": config_lib.integer_at_least(0),
    "train.steps": config_lib.integer_at_least(0),
    "log_every": config_lib.integer_at_least(1),
    "progress_bar": config_lib.BOOLEAN,
    "checkpoint_every": config_lib.integer_at_least(1),
    "keep_checkpoints": config_lib.integer_at_least(1),
    "model.dtype": config_lib.one_of(sorted(DTYPES)),
    "model.param_dtype": config_lib.one_of(sorted(DTYPES)),
    "model.remat": config_lib.one_of(REMAT_POLICIES),
    "model.attention": config_lib.one_of(ATTENTIONS),
}


# ---------------------------------------------------------------------------- the math


def bradley_terry_loss(chosen: jax.Array, rejected: jax.Array) -> jax.Array:
    """mean −log σ(chosen − rejected) over pairs. chosen, rejected: [N] scores -> scalar."""
    return jnp.mean(jax.nn.softplus(rejected - chosen))


def pairwise_accuracy(chosen: jax.Array, rejected: jax.Array) -> jax.Array:
    """Fraction of pairs scored chosen > rejected, ties counting 1/2. [N], [N] -> scalar."""
    wins = jnp.where(chosen > rejected, 1.0, jnp.where(chosen == rejected, 0.5, 0.0))
    return jnp.mean(wins)


def pair_scores(model: Model, params: Params, batch: dict) -> tuple[jax.Array, jax.Array]:
    """Scores of chosen and rejected rows ([N] each) from one forward over both."""
    tokens = jnp.concatenate([batch["chosen_tokens"], batch["rejected_tokens"]])
    mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]])
    scores = model_sequence_scores(model, params, tokens, mask)[:, SCORE_LABEL]
    return jnp.split(scores, 2)


def make_train_step(
    model: Model,
    optimizer: optax.GradientTransformation,
    *,
    num_microbatches: int,
    state_sharding: learner.TrainState,
    mesh: jax.sharding.Mesh,
):
    """Jitted `(state, batch) -> (state, metrics)`: the Bradley–Terry loss of B pairs, with
    gradients averaged over `num_microbatches` micro-batches. batch: PAIR_ARRAYS, [B, S]."""

    def microbatch_loss(params, micro):
        chosen, rejected = pair_scores(model, params, micro)
        loss = bradley_terry_loss(chosen, rejected)
        metrics = {
            "loss": loss,
            "accuracy": pairwise_accuracy(chosen, rejected),
            "margin": jnp.mean(chosen - rejected),
        }
        return loss, metrics

    grad_fn = jax.value_and_grad(microbatch_loss, has_aux=True)

    def train_step(state: learner.TrainState, batch: dict):
        micro_batches = learner.split_microbatches(batch, PAIR_ARRAYS, num_microbatches, mesh)
        return learner.accumulated_update(
            state, micro_batches, grad_fn, optimizer, num_microbatches
        )

    return mesh_lib.jit_on_mesh(
        train_step,
        in_shardings=(state_sharding, mesh_lib.batch_sharding(mesh)),
        out_shardings=(state_sharding, mesh_lib.replicated(mesh)),
        donate_argnums=(0,),
    )


# ---------------------------------------------------------------------------- the data


def encode_pairs(
    tokenizer: Tokenizer, pairs: Sequence[dict], *, max_len: int, append_eos: bool
) -> dict[str, np.ndarray]:
    """PAIR_ARRAYS for `pairs` ({prompt, chosen, rejected}): right-padded to the smallest
    bucket of `max_len` that holds every row (one compiled shape). [N, S] each."""
    rows = {}
    try:
        for side in ("chosen", "rejected"):
            rows[side] = [
                encode_scored_text(
                    tokenizer, pair["prompt"], pair[side], max_len=max_len, append_eos=append_eos
                )
                for pair in pairs
            ]
    except ValueError as error:  # a response longer than max_len: the config's to change
        raise ConfigError(str(error)) from None
    longest = max(len(ids) for side_rows in rows.values() for ids in side_rows)
    length = bucket_for(longest, bucket_lengths(max_len))
    arrays = {}
    for side, side_rows in rows.items():
        arrays[f"{side}_tokens"], arrays[f"{side}_mask"] = pad_sequences_with_mask(
            side_rows, length, pad_id=tokenizer.pad_id, left_pad=False
        )
    return arrays


def load_pairs(config: ml_collections.ConfigDict, split: str, workdir: str) -> list[dict]:
    """The first `data.num_{split}` pairs of `split` (0: all)."""
    data_dir = config.data.data_dir or os.path.join(workdir, "data")
    pairs = preferences.load_split(split, data_dir, manual_dir=config.data.manual_dir or None)
    limit = config.data.num_train if split == "train" else config.data.num_test
    pairs = pairs[:limit] if limit else pairs
    if not pairs:
        raise ConfigError(f"The {split} split of the preference data is empty.")
    return pairs


# --------------------------------------------------------------------------- the model


def rm_tokenizer(config: ml_collections.ConfigDict) -> Tokenizer:
    """`model.hf_path`'s tokenizer, or the char tokenizer (`tokenizer="char"`, tiny runs)."""
    if config.tokenizer == CHAR_TOKENIZER:
        return CharTokenizer.for_text()
    from tba_jax.models.hf_tokenizer import HFTokenizer

    return HFTokenizer.from_pretrained(config.model.hf_path)


def score_head_init(d_model: int, scale: float, seed: int, dtype) -> jax.Array:
    """A [d_model, 1] scalar head from N(0, (scale / sqrt(d_model + 1))²)."""
    std = scale / np.sqrt(d_model + 1)
    return (std * jax.random.normal(jax.random.key(seed), (d_model, 1))).astype(dtype)


def scalar_score_config(cfg: ModelConfig) -> ModelConfig:
    """The same decoder with a one-label score head instead of the language-model head."""
    return dataclasses.replace(cfg, head="score", num_labels=1)


def reward_model_config(config: ml_collections.ConfigDict, tokenizer: Tokenizer) -> ModelConfig:
    """The reward model's shape, without loading or drawing any params: `model.hf_path`'s
    decoder with a one-label score head (a one-label classifier as it is), else the
    `model.preset` with one; computed as `model.remat` and `model.attention` say."""
    shape = _reward_model_shape(config, tokenizer)
    # a config written before these keys existed computes as it did then (the defaults)
    execution = {key: config.model.get(key, getattr(shape, key)) for key in EXECUTION_KEYS}
    return dataclasses.replace(shape, **execution)


def _reward_model_shape(config: ml_collections.ConfigDict, tokenizer: Tokenizer) -> ModelConfig:
    if config.model.hf_path:
        source_cfg = _hf_source_config(config)
        if source_cfg.head == "score" and source_cfg.num_labels != 1:
            raise ConfigError(
                f"model.hf_path={config.model.hf_path} is a classifier with "
                f"{source_cfg.num_labels} labels; a scalar reward model needs 1 (or start "
                "from a *ForCausalLM checkpoint)."
            )
        return source_cfg if source_cfg.head == "score" else scalar_score_config(source_cfg)
    return preset(
        config.model.preset,
        vocab_size=tokenizer.vocab_size,
        max_seq_len=config.max_len,
        head="score",
        num_labels=1,
        dtype=config.model.dtype,
        param_dtype=config.model.param_dtype,
    )


def _hf_source_config(config: ml_collections.ConfigDict) -> ModelConfig:
    from tba_jax.models import hf

    dtypes = dict(dtype=config.model.dtype, param_dtype=config.model.param_dtype)
    return dataclasses.replace(hf.config_from_hf(config.model.hf_path), **dtypes)


def init_reward_model(
    config: ml_collections.ConfigDict, tokenizer: Tokenizer, mesh: jax.sharding.Mesh
) -> tuple[Model, Params]:
    """The reward model to train (`reward_model_config`), its params placed on `mesh`
    (`mesh.rules`).

    From `model.hf_path`: a *ForCausalLM checkpoint's body with a new scalar head, or a
    one-label *ForSequenceClassification checkpoint as it is. Else a random `model.preset`.
    """
    rules = config.mesh.rules
    cfg = reward_model_config(config, tokenizer)
    if config.model.hf_path:
        from tba_jax.models import hf

        source_model, source_abstract = abstract_model(_hf_source_config(config))
        source_shardings = mesh_lib.param_shardings(
            source_model.logical_axes, source_abstract, mesh, rules
        )
        params = hf.load_params(config.model.hf_path, source_model, shardings=source_shardings)
        if source_model.config.head == "score":
            return source_model, params
        params = {name: value for name, value in params.items() if name != "lm_head"}
    else:
        _, params = init_model(cfg, config.seed)
    model, abstract = abstract_model(cfg)
    shardings = mesh_lib.param_shardings(model.logical_axes, abstract, mesh, rules)
    params["score"] = score_head_init(
        cfg.d_model, config.model.score_init_scale, config.seed, cfg.storage_dtype
    )
    return model, jax.device_put(params, shardings)


def save_reward_model(
    config: ml_collections.ConfigDict, model: Model, params: Params, tokenizer: Tokenizer, out: str
) -> list[str]:
    """Writes the model as a Hugging Face *ForSequenceClassification folder with its
    tokenizer files and token ids; returns the files written."""
    from tba_jax.models import hf

    token_ids = dict(
        pad_token_id=tokenizer.pad_id, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id
    )
    files = hf.save_hf(out, model.config, params, hf_config_overrides=token_ids)
    if config.model.hf_path:
        files += hf.copy_tokenizer_files(config.model.hf_path, out)
    else:
        files += tokenizer.save_pretrained(out)
    return files


# ----------------------------------------------------------------------------- the run


def check_config(config: ml_collections.ConfigDict, num_devices: int) -> None:
    """ConfigError for settings that cannot work, before anything is loaded."""
    config_lib.check_config_kind(config, reward_model=True)
    config_lib.check_ranges(config, RANGES)
    if config.tokenizer not in (CHECKPOINT_TOKENIZER, CHAR_TOKENIZER):
        raise ConfigError(
            f"tokenizer={config.tokenizer!r} is not one of "
            f"{[CHECKPOINT_TOKENIZER, CHAR_TOKENIZER]}."
        )
    hf_path = config.model.hf_path
    if config.tokenizer == CHECKPOINT_TOKENIZER and not hf_path:
        raise ConfigError(
            "model.hf_path is empty but the reward model starts from a checkpoint; pass "
            "--config.model.hf_path=/path/to/sft-policy (a local Hugging Face folder)."
        )
    if hf_path and not os.path.isfile(os.path.join(hf_path, "config.json")):
        raise ConfigError(f"model.hf_path={hf_path!r} is not a Hugging Face model folder.")
    if hf_path and config.tokenizer == CHAR_TOKENIZER:
        raise ConfigError("tokenizer='char' is for random presets; clear model.hf_path.")
    problem = config.out_dir and config_lib.output_dir_problem(config.out_dir)
    if problem:  # found now, not when the trained model is saved
        raise ConfigError(f"out_dir={config.out_dir} {problem}; pick a folder you can write to.")
    config_lib.check_attention(config)
    train = config.train
    if train.batch_size < 1 or train.batch_size % train.num_microbatches:
        raise ConfigError(
            f"train.batch_size={train.batch_size} must be a positive multiple of "
            f"train.num_microbatches={train.num_microbatches}."
        )
    shards = mesh_lib.row_shards(
        mesh_lib.make_mesh(jax.devices()[:num_devices], config.mesh.axes, key="mesh.axes")
    )
    for name, rows in (
        ("train.batch_size / train.num_microbatches", train.batch_size // train.num_microbatches),
        ("train.eval_batch_size", train.eval_batch_size),
    ):
        if rows % shards:
            raise ConfigError(
                f"{name} = {rows} pairs does not divide over the {shards} batch shards of "
                "mesh.axes; change it or mesh.axes."
            )


def train_steps(config: ml_collections.ConfigDict, num_pairs: int) -> int:
    """`train.steps`, or `train.num_epochs` passes over the pairs in whole batches."""
    if num_pairs < config.train.batch_size:
        raise ConfigError(
            f"{num_pairs} training pairs make no batch of train.batch_size="
            f"{config.train.batch_size}; lower it or add pairs."
        )
    steps = config.train.steps or config.train.num_epochs * (num_pairs // config.train.batch_size)
    if steps < 1:
        raise ConfigError(f"train.steps={steps} must be >= 1 (or train.num_epochs >= 1).")
    return steps


def batch_indices(num_pairs: int, batch_size: int, steps: int, seed: int) -> list[np.ndarray]:
    """Row indices of each step's batch: epochs of shuffled pairs, the last partial batch of
    each epoch dropped."""
    rng = np.random.default_rng(seed)
    batches: list[np.ndarray] = []
    while len(batches) < steps:
        order = rng.permutation(num_pairs)
        batches += [
            order[start : start + batch_size]
            for start in range(0, num_pairs - batch_size + 1, batch_size)
        ]
    return batches[:steps]


def make_eval_fn(model: Model, mesh: jax.sharding.Mesh, param_shardings):
    """Jitted `(params, batch) -> (chosen [N], rejected [N])` scores."""
    return mesh_lib.jit_on_mesh(
        lambda params, batch: pair_scores(model, params, batch),
        in_shardings=(param_shardings, mesh_lib.batch_sharding(mesh)),
    )


def evaluate_pairs(eval_fn, params, data: dict, batch_size: int) -> dict[str, float]:
    """Held-out pairwise accuracy (ties 1/2) and Bradley–Terry loss over every pair."""
    num_pairs = len(data["chosen_tokens"])
    chosen, rejected = np.zeros(0, np.float32), np.zeros(0, np.float32)
    for rows in fixed_size_batches(num_pairs, batch_size):
        real = min(batch_size, num_pairs - len(chosen))  # the last batch repeats row 0
        scores = jax.device_get(eval_fn(params, {name: data[name][rows] for name in PAIR_ARRAYS}))
        chosen = np.concatenate([chosen, np.asarray(scores[0])[:real]])
        rejected = np.concatenate([rejected, np.asarray(scores[1])[:real]])
    return {
        "accuracy": float(pairwise_accuracy(chosen, rejected)),
        "loss": float(bradley_terry_loss(chosen, rejected)),
        "margin": float(np.mean(chosen - rejected)),
    }


def write_summary(workdir: str, summary: dict) -> str:
    return write_json_atomically(os.path.join(workdir, SUMMARY_FILENAME), summary)


def experiment(config: ml_collections.ConfigDict) -> dict:
    """What a workdir's checkpoints are checked against: every key but `RUN_ONLY_KEYS` and
    the model's `EXECUTION_KEYS`. The mesh axes are named without those of size 1, which
    change nothing: {"fsdp": -1}, the only axis configs named until 2026-11-28, is
    {"data": 1, "fsdp": -1, "tensor": 1}, so their workdirs go on."""
    identity = {key: value for key, value in config.to_dict().items() if key not in RUN_ONLY_KEYS}
    model = identity["model"]
    identity["model"] = {key: value for key, value in model.items() if key not in EXECUTION_KEYS}
    axes = identity["mesh"]["axes"]
    identity["mesh"] = {**identity["mesh"], "axes": {k: v for k, v in axes.items() if v != 1}}
    return identity


def train_reward_model(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Trains a scalar reward model on preference pairs; saves it and rm_summary.json.
    Goes on from the workdir's newest checkpoint; raises `checkpoint.RunStopped` when
    SIGTERM or Ctrl-C stopped it (after saving). A finished workdir gives its summary
    back. A workdir of another config, or one another run is training in, is refused
    before anything is written to it."""
    wall_start = time.time()
    check_config(config, jax.device_count())
    check_experiment(workdir, experiment(config))
    compile_cache.use(config)
    tokenizer = rm_tokenizer(config)
    with contextlib.ExitStack() as held:  # the workdir, locked while this run is in it
        with claimed_workdir(workdir, held):
            summary = finished_summary(workdir)
            if summary is not None:
                logging.info(
                    "%s already finished (%d steps); its reward model is in %s.",
                    workdir,
                    summary["steps"],
                    summary["hf_folder"],
                )
                return summary
            encode = dict(max_len=config.max_len, append_eos=config.append_eos)
            train_data = encode_pairs(tokenizer, load_pairs(config, "train", workdir), **encode)
            test_data = encode_pairs(tokenizer, load_pairs(config, "test", workdir), **encode)
            train_steps(config, len(train_data["chosen_tokens"]))  # pairs for one batch
        return train_on_pairs(config, workdir, tokenizer, train_data, test_data, wall_start)


def finished_summary(workdir: str) -> dict | None:
    """The summary of a reward model this workdir finished training (its folder written,
    its steps removed, its experiment.json kept), else None."""
    summary_path = os.path.join(workdir, SUMMARY_FILENAME)
    experiment_path = os.path.join(workdir, CHECKPOINTS_SUBDIR, EXPERIMENT_FILENAME)
    if not os.path.exists(summary_path) or not os.path.exists(experiment_path):
        return None
    if holds_saved_steps(workdir):
        return None  # a step left: the run stopped between its summary and its clean-up
    with open(summary_path) as f:
        return json.load(f)


def train_on_pairs(
    config: ml_collections.ConfigDict,
    workdir: str,
    tokenizer: Tokenizer,
    train_data: dict[str, np.ndarray],
    test_data: dict[str, np.ndarray],
    wall_start: float,
) -> dict:
    """The training of `train_reward_model` on encoded pairs, from the workdir's newest
    checkpoint; exports the model and writes the summary."""
    num_train, num_test = len(train_data["chosen_tokens"]), len(test_data["chosen_tokens"])
    steps = train_steps(config, num_train)
    checkpointer = Checkpointer(
        workdir, experiment=experiment(config), max_to_keep=config.keep_checkpoints
    )

    mesh = mesh_lib.make_mesh(jax.devices(), config.mesh.axes, key="mesh.axes")
    model, abstract = abstract_model(reward_model_config(config, tokenizer))
    shardings = mesh_lib.param_shardings(model.logical_axes, abstract, mesh, config.mesh.rules)
    optimizer = learner.make_optimizer(
        learner.OptimConfig(total_steps=steps, **config.optim.to_dict())
    )
    state_sharding = learner.train_state_shardings(optimizer, abstract, shardings, mesh)
    eval_fn = make_eval_fn(model, mesh, shardings)
    resumed = resumed_progress(checkpointer, optimizer, abstract, state_sharding, steps)
    if resumed is None:  # the checkpoint's params are loaded (or drawn) only when needed
        _, params = init_reward_model(config, tokenizer, mesh)
        state = learner.init_train_state(params, optimizer, state_sharding)
        del params
        before = evaluate_pairs(eval_fn, state.params, test_data, config.train.eval_batch_size)
        progress = {"step": 0, "before": before, "train_seconds": 0.0}
        logging.info("Held-out pairwise accuracy before training: %.3f", before["accuracy"])
    else:
        state, progress = resumed

    train_step = make_train_step(
        model,
        optimizer,
        num_microbatches=config.train.num_microbatches,
        state_sharding=state_sharding,
        mesh=mesh,
    )
    batch_sharding = mesh_lib.batch_sharding(mesh)
    batches = batch_indices(num_train, config.train.batch_size, steps, config.seed)

    seconds_before, segment_start = progress["train_seconds"], time.time()
    wall_before = progress.get("wall_seconds", 0.0)  # a save from before it was kept: 0

    def save(step: int) -> None:  # with the training and wall seconds of every segment so far
        train_seconds = seconds_before + time.time() - segment_start
        wall_seconds = wall_before + time.time() - wall_start
        progress.update(step=step, train_seconds=train_seconds, wall_seconds=wall_seconds)
        checkpointer.save(step, train_state=state, buffer_state={}, metadata=progress, force=True)

    try:
        with (
            stop_on_signals() as stop_signal,
            MetricsWriter(
                workdir,
                log_every=config.log_every,
                total_steps=steps,
                show_progress=config.progress_bar,
            ) as writer,
        ):
            for step in range(progress["step"] + 1, steps + 1):
                rows = batches[step - 1]
                batch = jax.device_put(
                    {k: train_data[k][rows] for k in PAIR_ARRAYS}, batch_sharding
                )
                state, metrics = train_step(state, batch)
                writer.write(step, jax.device_get(metrics))
                if stop_signal.requested and step < steps:
                    save(step)
                    logging.info("Saved the reward model's training at step %d of %d.", step, steps)
                    raise stop_signal.stopped()
                if step % config.checkpoint_every == 0 and step < steps:
                    save(step)
        progress["train_seconds"] = seconds_before + time.time() - segment_start
    finally:
        checkpointer.wait_until_finished()
        checkpointer.close()
    after = evaluate_pairs(eval_fn, state.params, test_data, config.train.eval_batch_size)
    logging.info("Held-out pairwise accuracy after training: %.3f", after["accuracy"])

    out = config.out_dir or os.path.join(workdir, HF_SUBDIR)
    files = save_reward_model(config, model, jax.device_get(state.params), tokenizer, out)
    summary = {
        "config_name": config.name,
        "variant": config.get("variant", ""),
        "init": config.model.hf_path or f"preset:{config.model.preset}:seed={config.seed}",
        "num_train_pairs": num_train,
        "num_test_pairs": num_test,
        "steps": steps,
        "batch_size": config.train.batch_size,
        "sequence_length": int(train_data["chosen_tokens"].shape[1]),
        **{f"test_{name}_before": value for name, value in progress["before"].items()},
        **{f"test_{name}_after": value for name, value in after.items()},
        "train_seconds": progress["train_seconds"],
        "wall_seconds": wall_before + time.time() - wall_start,
        "hf_folder": out,
        "files": sorted(os.path.basename(path) for path in files),
    }
    write_summary(workdir, summary)
    remove_saved_steps(workdir)  # the folder supersedes them; experiment.json stays
    logging.info("Summary: %s", json.dumps(summary, sort_keys=True))
    return summary


def resumed_progress(
    checkpointer: Checkpointer, optimizer, abstract: Params, state_sharding, steps: int
) -> tuple[learner.TrainState, dict] | None:
    """(train state, progress) of the newest checkpoint that restores, or None when the
    workdir holds none. ConfigError when it holds some and none restores."""
    if checkpointer.latest_step() is None:
        return None
    template = learner.abstract_train_state(optimizer, abstract, state_sharding)

    def restore(step: int) -> tuple[learner.TrainState, dict]:
        state, _, progress = checkpointer.restore(train_state_template=template, step=step)
        return state, progress

    restored = newest_restorable(checkpointer, restore)
    logging.info("Resuming from step %d of %d.", restored[1]["step"], steps)
    return restored
