"""What every training config (experiments/train.py) shares, as big_vision's configs/common.py.

A training config starts from `base_config(name)`, sets its own values and returns
`finalize(config, arg, SHORTCUTS, NAMED_VARIANTS)`:

    from configs import common

    SHORTCUTS = {**common.SHORTCUTS, "manual_dir": "task.manual_dir"}
    NAMED_VARIANTS = {"tiny": {**common.TINY_RUN, "batch.samples_per_prompt": 4, ...}}

    def get_config(arg=None):
        config = common.base_config("my_task")
        config.learner_steps = 1000
        ...
        return common.finalize(config, arg, SHORTCUTS, NAMED_VARIANTS)

`base_config` holds every key the trainer reads. Values every experiment shares (the
mesh, Adam's betas, logging, ...) are set there; the experiment's own numbers (steps, K,
S, m, k, β, learning rate, lengths, ...) are None there, and `finalize` stops with the
keys a config left unset. A config adds its `task` keys and any evaluation-only keys.

The reward-model trainer (configs/reward_model.py) is a different program; it takes the
optimiser (`optimizer()`) and the learner's sharding rules (`learner_rules()`) from here.
"""

import ml_collections

from tba_jax.config_lib import apply_variant

# Variant shortcuts every training config understands (`configs/arithmetic.py:steps=200,k=4`);
# a config adds its own (manual_dir, ...).
SHORTCUTS = {
    "steps": "learner_steps",
    "k": "sync_period",
    "m": "replay.recency_prob",
    "beta": "loss.beta_start",
    "model": "model.preset",
    "hf_path": "model.hf_path",
    "K": "batch.samples_per_prompt",
    "S": "batch.samples_generated_per_prompt",
    "searchers": "search.num_searchers",
}


def halfway_checkpoint(config: ml_collections.ConfigDict) -> ml_collections.FieldReference:
    """`checkpoint_every` of a CPU variant: max(2, learner_steps // 2), so one save
    halfway through the run (step 2 of 4; none before the end of a 2-step run, which
    keeps its step 0), still one when `steps=` raises `learner_steps` (step 75 of 150,
    not 74 saves every 2 steps); a `checkpoint_every=` item sets it outright."""
    half = config.get_ref("learner_steps") // 2
    return half + 2 // (half + 1)  # max(2, half): the second term is 0 once half >= 2


# What every seconds-long CPU variant (`smoke`, `tiny`) sets: a few learner steps, logged
# often and checkpointed halfway, no progress bar.
CPU_RUN = {
    "learner_steps": 4,
    "log_every": 2,
    "checkpoint_every": halfway_checkpoint,
    "progress_bar": False,
}

# A paper config's `tiny` variant on top of CPU_RUN: a random micro policy over
# printable-ASCII characters (the task's char tokenizer) with CPU-sized learning rates.
TINY_RUN = {
    **CPU_RUN,
    "model.preset": "micro",
    "model.dtype": "float32",
    "task.tokenizer": "char",
    "warm_start.learning_rate": 3e-3,
    "warm_start.warmup_steps": 1,
    "loss.beta_anneal_steps": 4,
    "optim.learning_rate": 1e-3,
    "optim.warmup_steps": 1,
}


def learner_rules() -> list[tuple[str, str]]:
    """Logical axis → mesh axis rules of the learner (and the reward-model trainer)."""
    return [("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"), ("kv_heads", "tensor")]


def optimizer() -> ml_collections.ConfigDict:
    """AdamW with a warmup and a schedule (`learner.OptimConfig`'s fields). The caller sets
    learning_rate, schedule and warmup_steps."""
    optim = ml_collections.ConfigDict()
    optim.learning_rate = None
    optim.schedule = None  # constant | linear | wsd (after the linear warmup)
    optim.warmup_steps = None
    optim.decay_fraction = 0.1  # wsd: the decaying share of the steps (only read by wsd)
    optim.end_lr_fraction = 0.0  # linear / wsd end at this × learning_rate
    optim.weight_decay = 0.0
    optim.b1 = 0.9
    optim.b2 = 0.999
    optim.eps = 1e-8
    optim.grad_clip_norm = 1.0
    return optim


def compile_cache() -> ml_collections.ConfigDict:
    """Compiled programs kept on disk and loaded by later runs, resumes and ablations of
    the same shapes (tba_jax/compile_cache.py): the programs that took at least
    min_compile_seconds to compile, in at most max_gib (least recently used go first).
    dir "": compile every program in every run."""
    cache = ml_collections.ConfigDict()
    cache.dir = "~/.cache/tba_jax/jax"
    cache.min_compile_seconds = 0.2  # JAX's default is 1 (for remote folders)
    cache.max_gib = 10.0
    return cache


def base_config(name: str) -> ml_collections.ConfigDict:
    """Every key of a training run, with the shared values; None: the config sets it."""
    config = ml_collections.ConfigDict()
    config.name = name
    config.seed = 0
    config.mode = "async"  # async (TBA) | sync (on-policy lockstep baseline)
    config.method = "tb"  # a registered loss: tb | rloo | online_dpo | grpo | ppo | vineppo
    config.learner_steps = None
    config.sync_period = None  # k: publish params to the searchers every k learner steps
    config.max_prompt_len = None  # policy tokens (characters with a char tokenizer)
    config.max_response_len = None

    config.task = ml_collections.ConfigDict()  # the config adds the task's own keys
    config.task.name = None
    config.task.data_dir = ""  # empty: <workdir>/data

    config.model = ml_collections.ConfigDict()
    config.model.preset = None  # a tba_jax.models preset (the shape when hf_path is empty)
    # A local folder in Hugging Face layout (config.json, *.safetensors, tokenizer):
    # the policy's architecture, starting weights and tokenizer (preset is then unused).
    config.model.hf_path = ""
    config.model.dtype = None  # compute
    # A preset's embedding rows; 0: the tokenizer's ids. Set to a real checkpoint's count
    # (32,000 for rho-1b, 50,304 for pythia) to run a random policy of its full shape; the
    # sampler still draws only the tokenizer's ids.
    config.model.vocab_size = 0
    config.model.param_dtype = "float32"  # stored params and Adam state
    # How the policy is computed (README, "Accelerator throughput"): blocks stacked and run
    # in one lax.scan (compile time flat in depth; changes the checkpoint's params layout),
    # decode scanning them too over a stacked KV cache (needs scan_layers; off: decode
    # unstacks the params once per call), a jax.checkpoint policy per block (none |
    # nothing_saveable | dots_saveable | dots_with_no_batch_dims_saveable), the attention
    # kernel (einsum | dot_product | cudnn), a decode step's attention (same: as attention;
    # pallas: one flash-decoding kernel over the KV cache, GPU), and how many response
    # slots the log-probs' head runs on at a time (0: all).
    config.model.scan_layers = False
    config.model.scan_decode = False
    config.model.remat = "none"
    config.model.attention = "einsum"
    config.model.decode_attention = "same"
    # the Pallas decode kernel's settings, k_splits:block_k:num_warps:num_stages ("": its
    # defaults; benchmarks/decode_attention_kernel.py times others on a GPU)
    config.model.decode_kernel = ""
    # a decode step's gated MLP hidden layer (same: XLA's matmuls; pallas: both products
    # and the activation in one kernel, GPU) and that kernel's settings,
    # block_m:block_n:block_k:num_warps:num_stages ("": its defaults;
    # benchmarks/gated_mlp_kernel.py times others on a GPU)
    config.model.decode_mlp = "same"
    config.model.decode_mlp_kernel = ""
    # a decode step's output projections, attention's W_o and the MLP's W_down (same: XLA's
    # matmuls; pallas: one kernel that splits the contraction between programs, GPU) and
    # that kernel's settings, block_m:block_n:block_k:k_splits:num_warps:num_stages ("":
    # its defaults; benchmarks/decode_projection_kernel.py times others on a GPU)
    config.model.decode_projection = "same"
    config.model.decode_projection_kernel = ""
    # a decode step's attention input: the RMSNorm, the Q, K and V projections, the rotary
    # embedding and the KV cache write (same: XLA's kernels; pallas: all in one kernel,
    # GPU) and that kernel's settings, block_m:block_k:num_warps:num_stages ("": its
    # defaults)
    config.model.decode_qkv = "same"
    config.model.decode_qkv_kernel = ""
    config.model.logprob_chunk = 0

    # π_ref: empty = the policy after the warm start; or a Hugging Face folder of the
    # same architecture (see reference_follows_policy).
    config.reference = ml_collections.ConfigDict()
    config.reference.hf_path = ""

    # Supervised fine-tuning on the task's solutions before RL. steps=0 skips it: the
    # policy's checkpoint is then the supervised model.
    config.warm_start = ml_collections.ConfigDict()
    config.warm_start.steps = 0
    config.warm_start.batch_size = 64
    config.warm_start.learning_rate = 1e-5
    config.warm_start.warmup_steps = 0

    config.sampling = ml_collections.ConfigDict()
    config.sampling.temperature = None
    config.sampling.top_k = 0
    config.sampling.top_p = 1.0
    # The batch generator's decode loop in this many segments, each attending over only the
    # cache slots its steps can have filled (fewer cache reads on long responses, one more
    # compiled loop body each; README, "Accelerator throughput").
    config.sampling.decode_segments = 1

    config.loss = ml_collections.ConfigDict()
    config.loss.beta_schedule = "linear"  # constant | linear
    config.loss.beta_start = None
    config.loss.beta_end = None
    config.loss.beta_anneal_steps = None
    # > 0: β jumps to beta_end at the N-th learner update wherever the anneal has got to
    # (the TBA authors' "stop" iteration); 0: no cut.
    config.loss.beta_cut_steps = 0
    # GRPO's options (method=grpo): the ratio's clip range ε, whether advantages are
    # divided by the group's reward std, and the mean over all tokens of the batch
    # ("token") or over each response's tokens, then responses ("sequence").
    config.loss.grpo = ml_collections.ConfigDict()
    config.loss.grpo.clip_epsilon = 0.2
    config.loss.grpo.scale_rewards = True
    config.loss.grpo.aggregation = "token"  # token | sequence
    # PPO's options (method=ppo; tba_jax.ppo, Huang et al. 2024's TL;DR defaults): the
    # critic's layout (its own model, or a value head on the policy's trunk) and where its
    # own model starts (the policy with a zero head, or the task's reward model: tasks with
    # one, e.g. TL;DR, whose reward model must share the policy's tokenizer), GAE's γ and
    # λ, the policy and value clip ranges, the value loss's weight (shared trunk only),
    # epochs × mini-batches of optimiser updates per learner step (the optimiser's
    # schedule counts updates), advantage whitening, one compiled program for actor and
    # critic (RLHFuse's fusion), and the critic's learning rate (0: optim.learning_rate).
    config.loss.ppo = ml_collections.ConfigDict()
    config.loss.ppo.critic = "separate"  # separate | shared
    config.loss.ppo.critic_init = "policy"  # policy | reward_model (separate critic only)
    config.loss.ppo.gamma = 1.0
    config.loss.ppo.lam = 0.95
    config.loss.ppo.clip_epsilon = 0.2
    config.loss.ppo.value_clip = 0.2
    config.loss.ppo.vf_coef = 0.1
    config.loss.ppo.epochs = 4
    config.loss.ppo.minibatches = 1
    config.loss.ppo.whiten_advantages = True
    config.loss.ppo.fused_step = True
    config.loss.ppo.critic_learning_rate = 0.0
    # VinePPO's options (method=vineppo; tba_jax.vineppo): GRPO's clip range and
    # aggregation, the continuations per step start, the characters that end a step, the
    # step starts per response, and rollout rows per generate call (0: batch × rollouts).
    config.loss.vineppo = ml_collections.ConfigDict()
    config.loss.vineppo.clip_epsilon = 0.2
    config.loss.vineppo.aggregation = "token"  # token | sequence
    config.loss.vineppo.rollouts = 4
    config.loss.vineppo.step_delimiters = "\n"
    config.loss.vineppo.max_steps = 8
    config.loss.vineppo.rows_per_call = 0

    config.batch = ml_collections.ConfigDict()
    config.batch.prompts_per_batch = None  # B
    config.batch.samples_per_prompt = None  # K
    config.batch.samples_generated_per_prompt = None  # S (sync mode generates exactly K)
    config.batch.num_microbatches = 1  # micro-batches hold whole prompts

    config.replay = ml_collections.ConfigDict()
    config.replay.capacity = None
    config.replay.capacity_per_prompt = None
    config.replay.recency_prob = None  # m
    config.replay.priority = "softmax"  # uniform | softmax | rank
    config.replay.priority_inverse_temperature = 1.0
    # Which prompts and samples a draw takes and which samples eviction drops (README
    # "The replay buffer"): "authors", the TBA authors' rules (online prompts without
    # replacement per sync window, K uniform of a prompt's online samples, offline prompts
    # in epochs, eviction by policy version); "newest", the newest prompts' newest samples
    # and eviction by insertion order.
    config.replay.draw_rule = "authors"
    config.replay.min_prompts = None  # buffer fill before the learner starts

    # Async staleness bound: before each draw, samples more than this many policy versions
    # behind the learner are dropped from the buffer (the learner then waits for
    # replay.min_prompts prompts); 0: no bound.
    config.replay.max_policy_lag = 0

    config.search = ml_collections.ConfigDict()
    config.search.num_searchers = 1
    config.search.prompts_per_call = None
    # π_ref scoring of a call's rows this many at a time (bounds the [rows, length, vocab]
    # logits); 0: all rows at once. Must divide prompts_per_call × S.
    config.search.score_rows_per_chunk = 0
    # How responses are generated (README "The generation engine"): batch decodes each
    # search call's rows to its longest, then scores them; slots keeps `slots` decode slots
    # busy (a finished sample's slot is refilled while the others decode) and scores
    # finished samples in groups of `score_rows` while decoding goes on.
    config.search.engine = "batch"  # batch | slots
    config.search.slots = 0  # decode width; 0: the rows of one call (async) or batch (sync)
    # Decode steps per host round trip, at most: a chunk also ends as soon as a refill or a
    # compaction can start, so this bounds the chunks in which none can, and how late a
    # publish or a stop is noticed. 64: on this 2-core CPU, 16 cost a round trip (a few
    # programs and a wait) every 3 ms of decoding.
    config.search.chunk_steps = 64
    # ...once no prompt is waiting (end of a sync batch, an evaluation, a publish); 0: until
    # the slots are empty or a compaction can start (nothing left to refill, and the
    # caller waits for every sample anyway).
    config.search.tail_chunk_steps = 0
    # Prompts per prefill call (a fixed shape); 0: every waiting prompt the free slots
    # hold, in one call of 4^i rows (or as many rows as slots).
    config.search.prefill_prompts = 0
    # A decode chunk returns for a refill once this share of the slots is free (and the
    # next prompt's samples fit); 0: as soon as they fit.
    config.search.refill_free = 0.0
    # Prompts are prefilled at the smallest of this many lengths (max_prompt_len × i / N)
    # that holds a refill's longest prompt; 1: always at max_prompt_len.
    config.search.prefill_buckets = 4
    # With no prompt waiting (end of a sync batch, an evaluation, a publish), live samples
    # at most this share of the width move to a halved width (down to min_width); 0: off.
    config.search.compact_below = 0.5
    config.search.min_width = 8
    # ...and only while the live samples may still run this many steps (max_response_len
    # less the fewest tokens any has): a short tail does not repay a compaction.
    config.search.compact_min_steps = 32
    # π_ref scoring calls take score_rows × 4^i finished samples (the most that are
    # ready, up to the decode width); 0: samples per prompt.
    config.search.score_rows = 0
    # ...their responses padded to the smallest of this many lengths (max_response_len
    # × i / N) that holds a group's longest: a scoring program for each (times the row
    # shapes); 1: always at max_response_len.
    config.search.score_length_buckets = 4
    # Length buckets (prefill and scoring) are never closer than this many tokens: short
    # limits get fewer buckets (the demo's 10 + 12 tokens: one each), since a program's
    # compile outweighs a few tokens of padding; 1: exactly the N buckets above.
    config.search.bucket_min_tokens = 32
    # Async searchers read newly published params between decode chunks instead of
    # finishing their samples on the params they started with.
    config.search.in_flight_updates = False
    # ...or, without in-flight updates, start the live prompts over on the new params at a
    # publish (each at most once; their decoded tokens are given up) instead of finishing
    # them on the old ones before any prompt of the new version starts. Only while prompts
    # take less time to finish than the gap between publishes (both measured as the run
    # goes): otherwise a prompt started over would end a version behind anyway.
    config.search.restart_on_publish = True
    # Async searchers start a prompt only while the samples they have started stay under
    # this many per sample the learner has drawn (and will draw in its next step), beyond
    # the buffer's first fill; the learner never waits on it. 0: they decode without
    # pause, as TBA's do, taking compute the learner could use when they share devices.
    config.search.max_samples_per_draw = 0.0

    config.optim = optimizer()

    config.mesh = ml_collections.ConfigDict()
    config.mesh.colocate = False  # one device: always colocated
    # A count >= 1 or a fraction of the devices: 0.7 → 3 of 4 devices sample, 6 of 8, 1 of 2.
    config.mesh.sampler_devices = 0.7
    # Each role's mesh: sizes of the data, fsdp and tensor axes, one of them -1 (the rest).
    # Every axis is listed so that each can be set from the command line, e.g. a
    # data-parallel learner (replicated params: one gradient all-reduce per step instead
    # of gathers per layer, cheaper across processes on CPUs):
    # --config.mesh.learner_axes.data=-1 --config.mesh.learner_axes.fsdp=1
    config.mesh.sampler_axes = {"data": -1, "fsdp": 1, "tensor": 1}
    config.mesh.learner_axes = {"data": 1, "fsdp": -1, "tensor": 1}
    # Logical axis -> mesh axis. The sampler's rules also shard the task's frozen role
    # models (reward models, red-team victim and judge), whose batches split over data.
    config.mesh.sampler_rules = [("mlp", "tensor"), ("heads", "tensor"), ("kv_heads", "tensor")]
    config.mesh.learner_rules = learner_rules()

    # Over several JAX processes (python -m tba_jax.launch, a TPU pod, SLURM; README
    # "Multi-host"): roles_within_host splits every process's devices into sampler and
    # learner devices (mesh.sampler_devices); roles_by_process makes processes
    # 0..learner_processes-1 learners and the others searchers. One process: unused.
    config.distributed = ml_collections.ConfigDict()
    config.distributed.topology = "roles_within_host"  # roles_within_host | roles_by_process
    config.distributed.learner_processes = 1  # roles_by_process only

    config.eval = ml_collections.ConfigDict()
    config.eval.num_examples = None
    config.eval.batch_size = 128  # response rows per generate call
    config.eval.every_steps = 0  # 0: only at the start and the end
    # With search.engine=slots, evaluation decodes in eval.batch_size slots and refills
    # once this share of them is free: greedy responses do not depend on it, and refills
    # of several prompts compile fewer prefill shapes and take fewer round trips.
    config.eval.refill_free = 0.25

    config.compile_cache = compile_cache()

    config.log_every = 10
    # A learner step whose loss or gradient is not finite is skipped (params and optimiser
    # state unchanged); this many skipped in a row stop the run with an error.
    config.max_nonfinite_steps = 10
    config.checkpoint_every = None
    config.keep_checkpoints = 2
    config.progress_bar = True

    # Replayable runs (README "Replaying a run's learner"): record every learner step's
    # batch, its rows' provenance and a fingerprint of the params under
    # <workdir>/learner_batches/, and keep the step-0 checkpoint, so that
    # experiments/replay_learner.py re-runs the learner alone bit for bit. One process only.
    config.record_learner_batches = False
    return config


def reference_follows_policy(config: ml_collections.ConfigDict) -> None:
    """π_ref is the policy's starting checkpoint (an SFT model): reference.hf_path follows
    model.hf_path unless set itself (a one-way link); empty = the warm-started policy."""
    config.reference.hf_path = config.model.get_ref("hf_path") + ""


def unset_keys(config: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    """The dotted paths of `config`'s values that are still None."""
    unset = []
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            unset += unset_keys(value, f"{prefix}{key}.")
        elif value is None:
            unset.append(prefix + key)
    return unset


def finalize(
    config: ml_collections.ConfigDict,
    arg: str | None,
    shortcuts: dict[str, str],
    named: dict[str, dict],
) -> ml_collections.ConfigDict:
    """Checks that the config file set every value the base left to it, then applies the
    variant string (`config_lib.apply_variant`). The config comes back locked, as
    `--config` locks it: a misspelt key set from Python (`config.learner_step = 2`) is an
    AttributeError naming the nearest key, not a new key the run never reads."""
    unset = unset_keys(config)
    if unset:
        raise ValueError(f"Config {config.name!r} leaves these keys unset: {', '.join(unset)}.")
    config = apply_variant(config, arg, shortcuts, named)
    config.lock()
    return config
