"""Config variants and the clear errors a bad config gets before any long work."""

import glob
import os
import re
import subprocess
import sys

import ml_collections
import pytest

from configs import (
    arithmetic,
    common,
    gsm8k_rho1b,
    redteam_gpt2,
    redteam_llama,
    reward_model,
    tldr_pythia,
)
from configs.arithmetic import get_config
from tba_jax import config_keys, config_lib
from tba_jax.config_lib import ConfigError, apply_variant, parse_variant, validate

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINING_CONFIGS = [arithmetic, gsm8k_rho1b, tldr_pythia, redteam_gpt2, redteam_llama]


def test_default_config_is_valid_on_one_and_on_eight_devices():
    validate(get_config(), num_devices=1)
    validate(get_config(), num_devices=8)


def test_variant_string_sets_fields_and_shortcuts():
    config = get_config("mode=sync,method=rloo,steps=200,optim.learning_rate=3e-4,m=0.25")
    assert (config.mode, config.method, config.learner_steps) == ("sync", "rloo", 200)
    assert config.optim.learning_rate == pytest.approx(3e-4)
    assert config.replay.recency_prob == pytest.approx(0.25)
    assert config.variant == "mode=sync,method=rloo,steps=200,optim.learning_rate=3e-4,m=0.25"


def test_named_variant_then_overrides():
    config = get_config("smoke,steps=7")
    assert config.model.preset == "micro" and config.learner_steps == 7


@pytest.mark.parametrize(
    "variant, steps, checkpoint_every",
    [
        ("smoke", 4, 2),
        ("smoke,steps=150", 150, 75),  # once halfway, not every 2 steps
        ("smoke,steps=2", 2, 2),  # no save before the end: the run keeps its step 0
        ("smoke,steps=7", 7, 3),
        ("smoke,steps=150,checkpoint_every=10", 150, 10),  # an item sets it outright
        ("smoke,checkpoint_every=3,steps=9", 9, 3),
    ],
)
def test_cpu_variants_checkpoint_halfway_through_the_steps_they_run(
    variant, steps, checkpoint_every
):
    config = get_config(variant)
    assert (config.learner_steps, config.checkpoint_every) == (steps, checkpoint_every)


def test_cpu_variants_checkpoint_follows_steps_set_after_the_config_is_built():
    config = get_config("smoke")  # as --config.learner_steps=40 sets it after get_config
    config.learner_steps = 40
    assert config.copy_and_resolve_references().checkpoint_every == 20
    assert gsm8k_rho1b.get_config("tiny,steps=150").checkpoint_every == 75


def test_parse_variant():
    assert parse_variant("smoke, a=1 ,b.c=x") == (["smoke"], {"a": "1", "b.c": "x"})
    assert parse_variant("") == ([], {})


@pytest.mark.parametrize(
    "variant, message",
    [
        ("bogus=1", "unknown config key 'bogus'"),
        ("optim.bogus=1", r"unknown config key 'optim\.bogus'"),
        (
            "learning_rat=1",
            r"unknown config key 'learning_rat'; did you mean 'optim\.learning_rate'\?",
        ),
        ("step=3", r"did you mean 'steps' \(learner_steps\)\?"),  # a shortcut, not warm_start's
        ("stpes=3", r"did you mean 'steps' \(learner_steps\)\?"),
        ("optim=1", r"unknown config key 'optim'"),
        ("nosuchvariant", "Unknown config variant 'nosuchvariant'"),
        ("steps=many", "not an integer"),
        ("progress_bar=maybe", "not a boolean"),
    ],
)
def test_bad_variants_are_clear_errors(variant, message):
    with pytest.raises(ConfigError, match=message):
        get_config(variant)


@pytest.mark.parametrize(
    "variant, num_devices, message",
    [
        ("K=8,S=4", 1, r"K \(batch\.samples_per_prompt=8\) is larger than"),
        ("m=1.5", 1, r"replay\.recency_prob=1\.5 must be a number in \[0, 1\]"),
        ("m=-0.1", 1, r"must be a number in \[0, 1\]"),
        ("mode=ahead", 1, "mode='ahead'"),
        ("method=sac", 1, "method='sac' is not one of"),
        ("method=rloo", 1, "on-policy loss; run it with mode=sync"),
        ("K=3,S=3,batch.prompts_per_batch=3", 4, "does not divide over the learner"),
        ("batch.num_microbatches=3", 1, "does not divide into"),
        ("mesh.sampler_devices=4", 4, "leaves no device for the learner"),
        (
            "mesh.learner_axes.fsdp=1,mesh.learner_axes.tensor=4",
            4,
            r"mesh\.learner_axes=.*need 4 devices and the learner has 2",
        ),
        ("mesh.sampler_axes.tensor=3", 4, r"mesh\.sampler_axes=.*the sampler's 2 devices do not"),
        ("mesh.learner_axes.data=-1", 1, r"mesh\.learner_axes=.*at most one mesh axis may be -1"),
        ("search.score_rows_per_chunk=7", 1, r"does not divide the 128 rows a search call"),
        ("mode=sync,search.score_rows_per_chunk=48", 1, r"does not divide the 128 rows"),
        ("search.score_rows_per_chunk=-1", 1, "must be an integer >= 0"),
        ("search.score_length_buckets=0", 1, r"score_length_buckets=0 must be an integer >= 1"),
        ("search.score_length_buckets=13", 1, r"=13 must be in \[1, max_response_len=12\]"),
        ("search.prefill_buckets=11", 1, r"prefill_buckets=11 must be in \[1, max_prompt_len=10\]"),
        ("search.bucket_min_tokens=0", 1, r"bucket_min_tokens=0 must be an integer >= 1"),
        ("batch.prompts_per_batch=0", 1, r"batch\.prompts_per_batch=0 must be an integer >= 1"),
        ("batch.prompts_per_batch=-4", 1, r"batch\.prompts_per_batch=-4 must be an integer >= 1"),
        ("batch.num_microbatches=0", 1, r"batch\.num_microbatches=0 must be an integer >= 1"),
        ("warm_start.batch_size=0", 1, r"warm_start\.batch_size=0 must be an integer >= 1"),
        ("eval.batch_size=0", 1, r"eval\.batch_size=0 must be an integer >= 1"),
        ("sampling.temperature=0.0", 1, r"sampling\.temperature=0\.0 must be a finite number > 0"),
        ("sampling.temperature=-1.0", 1, r"sampling\.temperature=-1\.0 must be"),
        ("checkpoint_every=0", 1, r"checkpoint_every=0 must be an integer >= 1"),
        ("beta=0.0", 1, r"loss\.beta_start=0\.0 must be a finite number > 0"),
        ("optim.learning_rate=1e6", 1, r"optim\.learning_rate=1000000\.0 must be a number in \(0"),
        ("optim.learning_rate=nan", 1, r"optim\.learning_rate=nan must be"),
        ("optim.schedule=cosine", 1, r"optim\.schedule='cosine' must be one of"),
        ("model.dtype=float8", 1, r"model\.dtype='float8' must be one of"),
        ("model.scan_decode=True", 1, r"model\.scan_decode=True scans the stacked blocks"),
        ("sampling.decode_segments=13", 1, r"decode_segments=13 is more than max_response_len"),
        ("sampling.decode_segments=0", 1, r"sampling\.decode_segments=0 must be an integer >= 1"),
        ("loss.beta_anneal_steps=0", 1, r"beta_anneal_steps=0 must be >= 1 for a linear"),
        ("max_nonfinite_steps=0", 1, r"max_nonfinite_steps=0 must be an integer >= 1"),
        ("method=ppo,loss.ppo.critic=twin", 1, r"loss\.ppo\.critic='twin' must be one of"),
        ("method=ppo,loss.ppo.minibatches=3", 1, r"into loss\.ppo\.minibatches=3 × batch"),
        ("method=ppo,loss.ppo.minibatches=128", 4, r"does not divide over the learner"),
        ("replay.capacity=10", 1, r"replay\.capacity=10 is smaller than replay\.capacity_per"),
        (
            "model.attention=cudnn,model.dtype=bfloat16",
            1,
            r"attention=cudnn is a GPU kernel, and this run's JAX platform is cpu",
        ),
        (
            "model.decode_attention=pallas",
            1,
            r"decode_attention=pallas is a GPU kernel.*use model\.decode_attention=same",
        ),
        ("model.decode_kernel=2:128:4", 1, r"model\.decode_kernel='2:128:4' must be '' or k_s"),
        ("model.decode_kernel=2:96:4:2", 1, r"model\.decode_kernel='2:96:4:2' must be"),
        (
            "model.decode_mlp=pallas",
            1,
            r"decode_mlp=pallas is a GPU kernel.*use model\.decode_mlp=same here",
        ),
        ("model.decode_mlp_kernel=64:64", 1, r"decode_mlp_kernel='64:64' must be '' or block_m"),
        (
            "model.decode_projection=pallas",
            1,
            r"decode_projection=pallas is a GPU kernel.*use model\.decode_projection=same here",
        ),
        (
            "model.decode_projection_kernel=64:64:64:3:4:3",
            1,
            r"decode_projection_kernel='64:64:64:3:4:3' must be '' or block_m:block_n:block_k:k_s",
        ),
        (
            "model.decode_qkv=pallas",
            1,
            r"decode_qkv=pallas is a GPU kernel.*use model\.decode_qkv=same here",
        ),
        ("model.decode_qkv_kernel=64:64", 1, r"decode_qkv_kernel='64:64' must be '' or block_m"),
        ("search.max_samples_per_draw=-1.0", 1, r"max_samples_per_draw=-1\.0 must be"),
        (
            "search.max_samples_per_draw=1.0,distributed.topology=roles_by_process",
            1,
            r"max_samples_per_draw is built for searchers beside their learner",
        ),
    ],
)
def test_invalid_configs_are_rejected_before_any_work(variant, num_devices, message):
    with pytest.raises(ConfigError, match=message):
        validate(get_config(variant), num_devices=num_devices)


def test_model_vocab_size_gives_a_preset_policy_a_real_checkpoints_rows():
    """`model.vocab_size` sizes a random preset policy's embeddings (a paper shape's
    32,000 rows over a char tokenizer's ids); 0 keeps the tokenizer's; fewer rows than
    the tokenizer's ids, or beside a checkpoint, is a clear error."""
    from tba_jax import runs

    assert runs.model_config(get_config("model.vocab_size=0"), 40).vocab_size == 40
    assert runs.model_config(get_config("model.vocab_size=512"), 40).vocab_size == 512
    with pytest.raises(ValueError, match=r"model\.vocab_size=32 is smaller than the tokenizer"):
        runs.model_config(get_config("model.vocab_size=32"), 40)
    with pytest.raises(ValueError, match=r"model\.hf_path='/ckpt' has its own"):
        runs.model_config(get_config("model.vocab_size=512,model.hf_path=/ckpt"), 40)
    older_run = get_config()  # a config.json written before the key existed
    with older_run.unlocked():
        del older_run.model["vocab_size"]
    assert runs.model_config(older_run, 40).vocab_size == 40


@pytest.mark.parametrize("config_module", TRAINING_CONFIGS, ids=lambda m: m.__name__)
def test_every_ranged_key_exists_and_its_default_is_in_range(config_module):
    """The range table names real keys (a typo would silently check nothing), and the
    shipped defaults are inside it."""
    config = config_module.get_config()
    for path, allowed in config_lib.RANGES.items():
        node = config
        for part in path.split("."):
            assert part in node, f"RANGES names {path!r}, which {config.name} does not have"
            node = node[part]
        assert allowed.check(node), f"{config.name}: {path}={node!r} is not {allowed.description}"


def test_a_config_of_the_other_launcher_is_named_so_in_one_line():
    """experiments/train.py given the reward-model config (or the other way round) says so
    before it reads a key the config lacks (it was an AttributeError traceback)."""
    for module in TRAINING_CONFIGS:
        config_lib.check_config_kind(module.get_config())
    config_lib.check_config_kind(reward_model.get_config(), reward_model=True)
    with pytest.raises(ConfigError, match=r"'reward_model' is not a training config .*"
                       r"trains with experiments/train_reward_model\.py"):  # fmt: skip
        config_lib.check_config_kind(reward_model.get_config())
    with pytest.raises(ConfigError, match=r"'arithmetic' is not a reward-model config"):
        config_lib.check_config_kind(get_config(), reward_model=True)


def test_every_task_range_names_a_key_some_training_config_has_and_defaults_pass():
    """The task ranges are checked on the keys a config has (tasks differ), so a typo
    would silently check nothing: each must name a key of at least one training config."""
    named = set()
    for module in TRAINING_CONFIGS:
        config = module.get_config()
        config_lib.check_ranges(config, config_lib.TASK_RANGES)  # the shipped values pass
        named |= {key for key in config_lib.TASK_RANGES if config_keys.lookup(config, key)[0]}
    assert named == set(config_lib.TASK_RANGES)


@pytest.mark.parametrize(
    "module, variant, message",
    [
        # as a slice's end, -1 would leave out the last example
        (tldr_pythia, "tiny,task.num_test=-1", r"task\.num_test=-1 must be an integer >= 0"),
        (tldr_pythia, "tiny,task.reward_model.batch_size=0", r"reward_model\.batch_size=0 must"),
        (tldr_pythia, "tiny,task.reward_model.dtype=float8", r"reward_model\.dtype='float8' must"),
        (redteam_gpt2, "tiny,task.toxic_threshold=2", r"task\.toxic_threshold=2\.0 must be a"),
        (redteam_gpt2, "tiny,task.judge.num_labels=1", r"judge\.num_labels=1 must be an integer"),
        (redteam_gpt2, "tiny,task.embed_batch_size=0", r"task\.embed_batch_size=0 must be"),
    ],
)
def test_task_values_out_of_range_are_rejected_before_any_work(module, variant, message):
    with pytest.raises(ConfigError, match=message):
        validate(module.get_config(variant), num_devices=1)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config.nonexistent=1"], "unknown config key 'nonexistent'"),
        ([":smoke,bogus=1"], "unknown config key 'bogus'"),
        ([":smoke,K=8"], "is larger than the samples generated per prompt"),
        ([":smoke,m=1.5"], r"must be a number in [0, 1]"),
        ([":smoke,warm_start.batch_size=500"], "is more than the 200 training examples"),
    ],
)
def test_launcher_reports_bad_config_in_one_line(tmp_path, args, message):
    config_path = os.path.join(REPO_ROOT, "configs", "arithmetic.py")
    if args[0].startswith(":"):
        flags = ["--config=" + config_path + args[0]]
    else:
        flags = ["--config=" + config_path + ":smoke", *args]
    workdir = tmp_path / "workdir"
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO_ROOT, "experiments", "train.py"),
            *flags,
            f"--workdir={workdir}",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        timeout=120,
    )
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: ") and message in last_line, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not workdir.exists()  # a refused run leaves no workdir it made (data included)


def flat(config: ml_collections.ConfigDict, prefix: str = "") -> dict:
    """{dotted path: value} of a config's leaves."""
    out = {}
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


# Base values no training config changes: the mesh, Adam's betas and clipping, logging...
NEVER_OVERRIDDEN = [
    "seed",
    "mode",
    "method",
    "task.data_dir",
    "model.hf_path",
    "model.param_dtype",
    "sampling.top_k",
    "sampling.top_p",
    "loss.beta_schedule",
    "replay.priority",
    "search.num_searchers",
    "optim.b1",
    "optim.eps",
    "optim.grad_clip_norm",
    "mesh.colocate",
    "mesh.sampler_axes.data",
    "mesh.learner_axes.fsdp",
    "mesh.sampler_rules",
    "mesh.learner_rules",
    "eval.batch_size",
    "eval.every_steps",
    "log_every",
    "keep_checkpoints",
    "progress_bar",
]


@pytest.mark.parametrize("module", TRAINING_CONFIGS, ids=lambda m: m.__name__)
def test_training_configs_have_every_base_key_and_the_shared_values(module):
    base, config = flat(common.base_config("base")), flat(module.get_config())
    for path, value in base.items():
        assert path in config, path
        if value is not None:
            assert type(config[path]) is type(value), path
    for path in NEVER_OVERRIDDEN:
        assert config[path] == base[path], path
    assert not common.unset_keys(module.get_config())
    assert set(common.SHORTCUTS.items()) <= set(module.SHORTCUTS.items())


def test_a_key_added_to_the_base_reaches_every_training_config(monkeypatch):
    original = common.base_config

    def with_new_keys(name):
        config = original(name)
        config.new_key = "base"
        config.optim.new_key = 0.5
        return config

    monkeypatch.setattr(common, "base_config", with_new_keys)
    for module in TRAINING_CONFIGS:
        assert module.get_config().new_key == "base", module.__name__
        assert module.get_config("optim.new_key=0.25").optim.new_key == 0.25, module.__name__


def test_reward_model_config_takes_the_optimiser_and_rules_from_the_base():
    config = reward_model.get_config()
    assert list(config.optim.keys()) == list(common.optimizer().keys())
    assert config.mesh.rules == common.learner_rules() == arithmetic.get_config().mesh.learner_rules


def test_a_config_that_leaves_a_base_value_unset_fails_when_built():
    with pytest.raises(ValueError, match=r"'base' leaves these keys unset: .*learner_steps"):
        common.finalize(common.base_config("base"), None, common.SHORTCUTS, {})


def documented_commands():
    """(source, config file name, variant, --config.path=value overrides) of every config
    command in README.md and the config docstrings, with `\\` continuations joined."""
    sources = [os.path.join(REPO_ROOT, "README.md")]
    sources += sorted(glob.glob(os.path.join(REPO_ROOT, "configs", "*.py")))
    for source in sources:
        with open(source) as f:
            text = f.read().replace("\\\n", " ")
        for line in text.splitlines():
            overrides = re.findall(r"--config\.([\w.]+)=(\S+)", line)
            for name, variant in re.findall(r"configs/(\w+)\.py(?::([^\s`\])]*))?", line):
                yield os.path.basename(source), name, variant, overrides


def test_documented_config_commands_still_parse():
    commands = list(documented_commands())
    assert len(commands) > 20 and {c[1] for c in commands} >= {
        m.__name__[8:] for m in TRAINING_CONFIGS
    }
    for source, name, variant, overrides in commands:
        where = f"{source}: configs/{name}.py:{variant} {overrides}"
        assert os.path.isfile(os.path.join(REPO_ROOT, "configs", f"{name}.py")), where
        if name in ("common", "redteam_common"):  # helpers, not config files
            continue
        config = __import__(f"configs.{name}", fromlist=["get_config"]).get_config(variant)
        for path, value in overrides:
            apply_variant(config, f"{path}={value}", shortcuts={})  # raises for unknown keys


def test_config_files_load_by_path_without_the_repo_on_sys_path(tmp_path):
    """As `python experiments/train.py --config=configs/x.py` loads them (configs/ is not
    an installed package, and the script's folder is experiments/)."""
    variants = {"arithmetic": "smoke", "reward_model": "tiny"}
    names = [m.__name__.split(".")[1] for m in [*TRAINING_CONFIGS, reward_model]]
    lines = ["from absl import flags", "from ml_collections import config_flags"]
    lines += [f"config_flags.DEFINE_config_file({name!r})" for name in names]
    argv = [f"--{n}={REPO_ROOT}/configs/{n}.py:{variants.get(n, 'tiny')}" for n in names]
    lines.append(f"flags.FLAGS(['python', *{argv!r}])")
    lines.append(f"print(' '.join(flags.FLAGS[n].value.name for n in {names!r}))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", "\n".join(lines)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == names


@pytest.mark.parametrize(
    "variant, key, reason",
    [
        ("", "loss.grpo.clip_epsilon", "only method=grpo reads loss.grpo.* (this run: method=tb)"),
        ("method=grpo", "loss.grpo.clip_epsilon", None),
        ("method=ppo", "loss.vineppo.rollouts", "only method=vineppo reads"),
        ("", "search.refill_free", "only search.engine=slots reads it"),
        ("", "eval.refill_free", "only search.engine=slots reads it"),
        ("search.engine=slots", "search.refill_free", None),
        ("search.engine=slots", "search.restart_on_publish", None),
        ("search.engine=slots,mode=sync", "search.restart_on_publish", "only mode=async"),
        (
            "search.engine=slots,search.in_flight_updates=True",
            "search.restart_on_publish",
            "search.in_flight_updates=True never restarts",
        ),
        ("mode=sync", "replay.recency_prob", "only mode=async reads it (this run: mode=sync)"),
        ("mode=sync", "sync_period", "only mode=async reads it"),
        ("mode=sync", "search.max_samples_per_draw", "only mode=async reads it"),
        ("", "search.max_samples_per_draw", None),
        ("mode=sync", "batch.samples_per_prompt", None),
        ("", "replay.recency_prob", None),
        ("", "optim.learning_rate", None),
        ("", "loss.beta_start", None),
        ("", "model.decode_kernel", "only model.decode_attention=pallas reads it"),
        ("model.decode_attention=pallas", "model.decode_kernel", None),
        ("", "model.decode_mlp_kernel", "only model.decode_mlp=pallas reads it"),
        ("model.decode_mlp=pallas", "model.decode_mlp_kernel", None),
        ("", "model.decode_projection_kernel", "only model.decode_projection=pallas reads it"),
        ("model.decode_projection=pallas", "model.decode_projection_kernel", None),
        ("", "model.decode_qkv_kernel", "only model.decode_qkv=pallas reads it"),
        ("model.decode_qkv=pallas", "model.decode_qkv_kernel", None),
    ],
)
def test_unread_key_reason(variant, key, reason):
    found = config_lib.unread_key_reason(get_config(variant), key)
    assert found == reason if reason is None else found.startswith(reason)


@pytest.mark.parametrize("config_module", [*TRAINING_CONFIGS, reward_model])
def test_a_misspelt_key_set_from_python_is_refused_naming_the_nearest(config_module):
    config = config_module.get_config("tiny" if config_module is reward_model else None)
    with pytest.raises(AttributeError, match=r'Did you mean "seed"'):
        config.sed = 3  # a new key would be silently ignored by the run
    config.seed = 3  # the config's own keys are set as before
