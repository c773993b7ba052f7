r"""PPO's learner step: the fused actor–critic program (RLHFuse) against the unfused one.

    python benchmarks/ppo_fusion.py                      # tiny policy, the demo's batch shape
    python benchmarks/ppo_fusion.py --preset=small --rows=64 --prompt_len=64 --response_len=128
    python benchmarks/ppo_fusion.py --smoke              # seconds on CPU: it runs, no more

Both steps are `tba_jax.ppo.make_train_step` on the same random-weight policy (`--preset`),
the same separate critic (the policy's trunk with a zero value head) and the same batch of
`--rows` random responses of `--response_len` tokens after `--prompt_len`-token prompts,
with the behaviour log-probs of the policy itself and π_ref's of a second random model:

- fused (`loss.ppo.fused_step=true`): one jitted program per learner step computes the
  critic's values, GAE and, for each of `--epochs` × `--minibatches` updates, the actor's
  and the critic's gradients and Adam updates;
- unfused: three programs back to back (prepare, the actor's updates, the critic's
  updates), the layout of a PPO that trains its two models as two stages.

Each path compiles and runs `--warmup` steps untimed, then `--repeats` timed steps of each
path alternate; a step's time is its wall time until its new params are ready. The
figures are medians in milliseconds, and `fused_speedup` = unfused / fused.

The last stdout line is JSON: {"benchmark": "ppo_fusion", "fused_ms", "unfused_ms",
"fused_speedup", the settings and the device}. Run it on a quiet machine.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import jax
import numpy as np
import optax
from absl import flags

from tba_jax import cli, losses, ppo
from tba_jax import mesh as mesh_lib
from tba_jax.critic import Critic
from tba_jax.models import PRESETS, init_model, preset
from tba_jax.sampling.scoring import make_score_fn

SMOKE = dict(preset="micro", rows=8, prompt_len=6, response_len=6, repeats=1, warmup=1)
VOCAB_SIZE = 64  # random tokens from this many ids (a preset's vocabulary is ours to set)
FIRST_TOKEN = 3  # ids below are pad / bos / eos
BETA = 0.05
LEARNING_RATE = 1e-5

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags, defined only when run as a script (tba_jax.cli's rule)."""
    flags.DEFINE_enum("preset", "tiny", sorted(PRESETS), "Policy and critic shape.")
    flags.DEFINE_integer("rows", 128, "N: responses per learner step.", lower_bound=1)
    flags.DEFINE_integer("prompt_len", 10, "P: prompt tokens.", lower_bound=1)
    flags.DEFINE_integer("response_len", 12, "T: response tokens.", lower_bound=1)
    flags.DEFINE_integer("epochs", 4, "loss.ppo.epochs.", lower_bound=1)
    flags.DEFINE_integer("minibatches", 1, "loss.ppo.minibatches.", lower_bound=1)
    flags.DEFINE_integer(
        "num_microbatches", 1, "batch.num_microbatches (per mini-batch).", lower_bound=1
    )
    flags.DEFINE_integer("warmup", 2, "Untimed steps per path after compiling.")
    flags.DEFINE_integer("repeats", 10, "Timed steps per path.", lower_bound=1)
    flags.DEFINE_integer("seed", 0, "Model init and batch.")
    flags.DEFINE_boolean("smoke", False, f"Tiny sizes: {SMOKE}.")
    flags.adopt_module_key_flags(cli)


@dataclasses.dataclass(frozen=True)
class Settings:
    preset: str
    rows: int
    prompt_len: int
    response_len: int
    epochs: int
    minibatches: int
    num_microbatches: int
    warmup: int
    repeats: int
    seed: int


def read_settings() -> Settings:
    """The flags, with --smoke's sizes for those not given; UsageError on a batch that
    does not split into the updates."""
    names = [field.name for field in dataclasses.fields(Settings)]
    values = {name: getattr(FLAGS, name) for name in names}
    if FLAGS.smoke:
        values.update({k: v for k, v in SMOKE.items() if not FLAGS[k].present})
    settings = Settings(**values)
    if settings.rows % (settings.minibatches * settings.num_microbatches):
        raise cli.UsageError(
            f"--rows={settings.rows} does not split into --minibatches={settings.minibatches}"
            f" × --num_microbatches={settings.num_microbatches} equal parts."
        )
    return settings


def make_batch(model, params, settings: Settings) -> dict[str, np.ndarray]:
    """Random prompts and responses (no padding, no EOS: every token counts), scored by the
    policy (behaviour) and by a second random model (π_ref)."""
    rng = np.random.default_rng(settings.seed)
    n, p, t = settings.rows, settings.prompt_len, settings.response_len
    prompt_tokens = rng.integers(FIRST_TOKEN, VOCAB_SIZE, (n, p)).astype(np.int32)
    response_tokens = rng.integers(FIRST_TOKEN, VOCAB_SIZE, (n, t)).astype(np.int32)
    prompt_mask, response_mask = np.ones((n, p), bool), np.ones((n, t), np.float32)
    score = make_score_fn(model, temperature=1.0)
    _, ref_params = init_model(model.config, settings.seed + 1)
    behaviour = np.asarray(
        score(params, prompt_tokens, prompt_mask, response_tokens, response_mask)
    )
    ref = np.asarray(score(ref_params, prompt_tokens, prompt_mask, response_tokens, response_mask))
    return {
        "prompt_tokens": prompt_tokens,
        "prompt_mask": prompt_mask,
        "response_tokens": response_tokens,
        "response_mask": response_mask,
        "reward": rng.uniform(0.0, 1.0, n).astype(np.float32),
        "logp_ref": ref.sum(-1),
        "logp_behaviour": behaviour.sum(-1),
        "token_logp_ref": ref,
        "token_logp_behaviour": behaviour,
    }


def build_path(model, params, settings: Settings, fused: bool):
    """(fresh PPO state, step) of one path on a one-device learner mesh."""
    mesh = mesh_lib.make_mesh(jax.devices()[:1], {})
    critic = Critic.build("separate", model)
    optimizer, critic_optimizer = optax.adam(LEARNING_RATE), optax.adam(LEARNING_RATE)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    sharding = ppo.train_state_shardings(critic, optimizer, critic_optimizer, abstract, mesh, [])
    state = ppo.init_train_state(params, critic, optimizer, critic_optimizer, sharding)
    options = ppo.PPOConfig(
        epochs=settings.epochs, minibatches=settings.minibatches, fused_step=fused
    )
    step = ppo.make_train_step(
        critic,
        optimizer,
        critic_optimizer,
        losses.make_beta_schedule("constant", BETA, BETA, 1),
        options=options,
        num_microbatches=settings.num_microbatches,
        temperature=1.0,
        state_sharding=sharding,
        mesh=mesh,
    )
    return state, step


def timed_step(state, step, batch) -> tuple[object, float]:
    began = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    return state, time.perf_counter() - began


def main(argv: list[str]) -> None:
    del argv
    settings = read_settings()
    cfg = preset(
        settings.preset,
        vocab_size=VOCAB_SIZE,
        max_seq_len=settings.prompt_len + settings.response_len,
        dtype="float32",
    )
    model, params = init_model(cfg, settings.seed)
    batch = make_batch(model, params, settings)
    paths = {
        name: build_path(model, params, settings, name == "fused") for name in ("fused", "unfused")
    }
    states = {name: state for name, (state, _) in paths.items()}
    compile_seconds = {}
    for name, (_, step) in paths.items():
        began = time.perf_counter()
        for _ in range(1 + settings.warmup):
            states[name], _ = timed_step(states[name], step, batch)
        compile_seconds[name] = time.perf_counter() - began
    seconds = {name: [] for name in paths}
    for _ in range(settings.repeats):
        for name, (_, step) in paths.items():
            states[name], elapsed = timed_step(states[name], step, batch)
            seconds[name].append(elapsed)
    fused_ms = 1e3 * statistics.median(seconds["fused"])
    unfused_ms = 1e3 * statistics.median(seconds["unfused"])
    print(
        f"PPO step ({settings.preset}, {settings.rows} rows × {settings.prompt_len}+"
        f"{settings.response_len} tokens, {settings.epochs} epochs × {settings.minibatches} "
        f"mini-batches): fused {fused_ms:.1f} ms, unfused {unfused_ms:.1f} ms "
        f"({unfused_ms / fused_ms:.2f}× faster fused)",
        flush=True,
    )
    line = {
        "benchmark": "ppo_fusion",
        "fused_ms": round(fused_ms, 2),
        "unfused_ms": round(unfused_ms, 2),
        "fused_speedup": round(unfused_ms / fused_ms, 3),
        "warmup_seconds": {k: round(v, 2) for k, v in compile_seconds.items()},
        **dataclasses.asdict(settings),
        "num_params": cfg.num_params(),
        **cli.machine_fields(),
    }
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
