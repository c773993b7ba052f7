"""The TL;DR experiment: configs/tldr_pythia.py, the `tldr` task (prompts, reward model,
non-EOS penalty, metrics), its tiny variant end to end and experiments/evaluate.py on it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from support import save_tiny_llama_folder

import tba_jax.tasks.tldr as tldr_task  # registers the "tldr" task
from configs.tldr_pythia import TINY_DATA_DIR, get_config
from tba_jax import tasks
from tba_jax.config_lib import ConfigError, validate
from tba_jax.data.tldr import whitespace_cut_points
from tba_jax.learner import make_lr_schedule
from tba_jax.metrics import RateMeter, TimeSplit
from tba_jax.models.tokenizers import CharTokenizer
from tba_jax.placement import RolePlacement
from tba_jax.replay import ReplayBuffer
from tba_jax.runs import optim_config, restore_run
from tba_jax.runtime import SearchWorker
from tba_jax.sampling.generate import Generation
from tba_jax.tasks import EvalSettings
from tba_jax.train import train_and_evaluate

REPO_ROOT = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 300
TINY_STEPS = 4
PAPER_EPISODES = 256 * 512
EVALUATE_SCRIPT = str(REPO_ROOT / "experiments" / "evaluate.py")


def fixture_records(filename: str) -> list[dict]:
    lines = (Path(TINY_DATA_DIR) / filename).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


# ------------------------------------------------------------------ the paper's config


def test_paper_config_has_the_papers_hyper_parameters():
    config = get_config()
    assert config.task.name == "tldr" and config.method == "tb" and config.mode == "async"
    assert config.batch.samples_per_prompt == 20  # K
    assert config.batch.samples_generated_per_prompt == 20  # S
    assert config.replay.recency_prob == 0.5  # m
    assert config.replay.draw_rule == "authors"  # their src/buffer_utils.py
    assert config.sync_period == 10  # k
    assert config.batch.prompts_per_batch == 8  # 8 prompts × 20 per step
    assert config.optim.learning_rate == 3e-6 and config.optim.schedule == "constant"
    assert config.sampling.temperature == 0.7
    assert (config.loss.beta_schedule, config.loss.beta_start, config.loss.beta_end) == (
        "linear",
        1.0,
        0.05,
    )
    # the authors' rule: towards 0.05 as if over 128 updates, cut at update 32
    assert (config.loss.beta_anneal_steps, config.loss.beta_cut_steps) == (128, 32)
    assert (config.replay.priority, config.replay.priority_inverse_temperature) == ("softmax", 1.0)
    assert config.max_prompt_len == 512 and config.max_response_len == 53
    assert config.eval.max_new_tokens == 53 and config.task.non_eos_penalty == -1.0
    assert config.model.preset == "pythia-1b" and config.warm_start.steps == 0
    assert config.task.reward_model.max_len == 512 + 53 + 1


def test_learner_steps_cover_the_papers_episodes():
    config = get_config()
    per_step = config.batch.prompts_per_batch * config.batch.samples_per_prompt
    assert config.learner_steps * per_step >= PAPER_EPISODES
    assert (config.learner_steps - 1) * per_step < PAPER_EPISODES


def test_paper_learning_rate_is_constant_after_a_short_warmup():
    config = get_config()
    lr = make_lr_schedule(optim_config(config))
    assert float(lr(0)) == 0.0
    for step in (config.optim.warmup_steps, 400, config.learner_steps):
        assert float(lr(step)) == pytest.approx(3e-6)


@pytest.mark.parametrize("num_devices", [1, 2, 4, 8])
def test_paper_config_validates_on_one_host(num_devices):
    validate(get_config(), num_devices=num_devices)


@pytest.mark.parametrize(
    "variant, refused",
    [
        ("task.reward_model.attention=flash", r"reward_model\.attention='flash' must be one of"),
        ("task.gold_reward_model.attention=cudnn", r"gold_reward_model\.dtype in \["),
        (
            "task.reward_model.attention=cudnn",
            r"reward_model\.attention=cudnn is a GPU kernel.*is cpu",
        ),
    ],
)
def test_a_roles_attention_kernel_is_checked_before_any_work(variant, refused):
    validate(get_config("task.reward_model.attention=dot_product"), num_devices=1)
    with pytest.raises(ConfigError, match=refused):
        validate(get_config(variant), num_devices=1)


def test_a_reward_model_too_short_for_a_whole_response_is_refused_before_any_work():
    """It keeps responses whole, so a max_len below max_response_len + EOS would fail at
    the first long response, mid-run (a traceback until 2026-11-29)."""
    validate(get_config("tiny,task.reward_model.max_len=49"), num_devices=1)
    for role in ("reward_model", "gold_reward_model"):
        with pytest.raises(ConfigError, match=rf"task\.{role}\.max_len=48 cannot .* least 49"):
            validate(get_config(f"tiny,task.{role}.max_len=48"), num_devices=1)


def test_a_policy_the_model_refuses_is_a_config_error_before_any_work():
    """On a GPU (where `validate` lets the Pallas decode kernel through) pythia-2.8b's
    80-wide heads, which Triton has no kernel for, stop the run in `check_run`."""
    from tba_jax.train import check_policy_architecture

    check_policy_architecture(get_config("2.8b"))
    check_policy_architecture(get_config("1b,model.decode_attention=pallas"))  # 256 wide
    with pytest.raises(ConfigError, match=r"power of two .*this model's is 80"):
        check_policy_architecture(get_config("2.8b,model.decode_attention=pallas"))


def test_size_variants_pick_the_preset_and_links_follow():
    for size in ("410m", "1b", "2.8b"):
        config = get_config(size)
        assert config.model.preset == f"pythia-{size}"
        assert config.task.checkpoint_hint == f"pythia-{size}-sft"
    linked = get_config("hf_path=/ckpt/sft,max_prompt_len=300,steps=100")
    assert linked.reference.hf_path == linked.task.reference_hf_path == "/ckpt/sft"
    assert linked.task.max_prompt_len == 300 and linked.task.gold_reward_model.max_len == 354
    one_way = get_config("eval.max_new_tokens=20,task.reward_model.max_len=99")
    assert one_way.max_response_len == 53 and one_way.task.gold_reward_model.max_len == 566


def test_missing_checkpoints_stop_the_run_with_the_flag_to_pass(tmp_path):
    with pytest.raises(ConfigError, match=r"--config\.model\.hf_path=/path/to/pythia-2.8b-sft"):
        train_and_evaluate(get_config("2.8b"), str(tmp_path))
    config = get_config(f"manual_dir={TINY_DATA_DIR}")
    with pytest.raises(ConfigError, match=r"--config\.task\.reward_model\.hf_path=/path/to/"):
        tasks.build_task(config.task, str(tmp_path), tokenizer=CharTokenizer.for_text())
    assert not (tmp_path / "data").exists() and not (tmp_path / "checkpoints").exists()


def test_a_reward_model_the_mesh_cannot_split_is_refused_before_the_data_is_prepared(tmp_path):
    """micro's one KV head over tensor 2 (abstract devices: one CPU will do) is a one-line
    error naming task.reward_model before the posts are read (until 2026-11-29 it came
    after they were prepared); tiny's two KV heads split."""
    config = get_config(f"tiny,task.data_dir={tmp_path / 'data'}")
    mesh = AbstractMesh((1, 1, 2), ("data", "fsdp", "tensor"))
    placement = RolePlacement(mesh, config.mesh.sampler_rules)
    split = r"^task\.reward_model on the sampler mesh: .* mesh axis 'tensor' of size 2"
    with pytest.raises(ConfigError, match=split):
        tasks.build_task(config.task, "/unused", placement=placement)
    assert not (tmp_path / "data").exists()


def test_a_role_folder_that_is_not_there_is_refused_before_the_data_is_prepared(tmp_path):
    workdir = tmp_path / "run"
    missing = tmp_path / "no_such_reward_model"
    with pytest.raises(ConfigError, match=rf"task\.reward_model\.hf_path='{missing}' is not a"):
        train_and_evaluate(get_config(f"tiny,task.reward_model.hf_path={missing}"), str(workdir))
    assert not workdir.exists()


# ---------------------------------------------------------------------------- the task


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """One prepared copy of the fixture posts for every run in this module."""
    return str(tmp_path_factory.mktemp("tldr_data"))


@pytest.fixture(scope="module")
def tiny_task(data_dir):
    return tasks.build_task(get_config(f"tiny,task.data_dir={data_dir}").task, "/unused")


def check_fitted_prompt(example: dict, record: dict, length_fn, budget: int) -> bool:
    """The prompt has the post cut at whitespace to the longest prefix within `budget`:
    True when it had to be cut."""
    header = f"SUBREDDIT: r/{record['subreddit']}\n\nTITLE: {record['title']}\n\nPOST: "
    prompt = example["prompt"]
    assert prompt.startswith(header) and prompt.endswith("\n\nTL;DR:")
    post = prompt[len(header) : -len("\n\nTL;DR:")]
    assert length_fn(prompt) <= budget and record["post"].startswith(post)
    if post == record["post"]:
        return False
    longer = [cut for cut in whitespace_cut_points(record["post"]) if cut > len(post)]
    next_prompt = header + record["post"][: longer[0] if longer else None] + "\n\nTL;DR:"
    assert length_fn(next_prompt) > budget  # one more word would not fit
    return True


def test_tiny_task_fits_prompts_to_the_character_budget(tiny_task):
    records = fixture_records("train.jsonl")
    assert [example["id"] for example in tiny_task.train] == list(range(48))
    cut = [check_fitted_prompt(ex, records[ex["id"]], len, 256) for ex in tiny_task.train]
    assert sum(cut) > 0  # the fixture has posts longer than the budget
    for example in tiny_task.train:
        record = records[example["id"]]
        assert example["post_id"] == record["id"]
        assert example["reference_summary"] == record["summary"]
        assert example["solution"] == " " + record["summary"].strip()
    assert len(tiny_task.test) == 16 and tiny_task.non_eos_penalty == -1.0
    assert tiny_task.identity == tasks.task_identity(get_config("tiny").task)
    # Evaluation-only keys are not part of the identity: a checkpoint can be evaluated
    # under another gold reward model; a different training reward model is another task.
    other_gold = get_config("tiny,task.gold_reward_model.seed=7").task
    assert tasks.task_identity(other_gold) == tiny_task.identity
    other_reward = get_config("tiny,task.reward_model.seed=7").task
    assert tasks.task_identity(other_reward) != tiny_task.identity
    # nor is the kernel a role model runs with (a run may resume on other hardware)
    other_kernel = get_config("tiny,task.reward_model.attention=dot_product").task
    assert tasks.task_identity(other_kernel) == tiny_task.identity


def test_prompts_fit_the_policy_tokenizer_budget(tmp_path, data_dir):
    pytest.importorskip("transformers")
    from tba_jax.models.hf_tokenizer import HFTokenizer

    records = fixture_records("train.jsonl")
    corpus = [record["title"] + " " + record["post"] for record in records]
    folder = save_tiny_llama_folder(
        tmp_path / "sft", corpus, vocab_size=300, max_position_embeddings=128
    )
    tokenizer = HFTokenizer.from_pretrained(folder)
    # Headers are 59-73 of these tokens and whole prompts 102-220.
    config = get_config(f"tiny,task.data_dir={data_dir},max_prompt_len=128")
    task = tasks.build_task(config.task, "/unused", tokenizer=tokenizer)
    assert task.tokenizer is tokenizer and len(task.train) == 48
    length_fn = lambda text: len(tokenizer.encode(text))
    cut = [check_fitted_prompt(ex, records[ex["id"]], length_fn, 128) for ex in task.train]
    assert 0 < sum(cut) < len(cut)


def test_posts_the_tokenizer_cannot_encode_or_fit_are_dropped():
    record = {"subreddit": "pets", "title": "Cat", "post": "My cat sneezes a lot."}
    tokenizer = CharTokenizer.for_text()
    fitted = tldr_task.fitted_prompt(record, tokenizer, 60)
    assert fitted == "SUBREDDIT: r/pets\n\nTITLE: Cat\n\nPOST: My cat sneezes\n\nTL;DR:"
    assert tldr_task.fitted_prompt({**record, "post": "Caf\u00e9 cat."}, tokenizer, 500) is None
    assert tldr_task.fitted_prompt(record, tokenizer, 40) is None  # the header alone is 46


def test_nothing_fitting_is_a_clear_error(data_dir):
    config = get_config(f"tiny,task.data_dir={data_dir},max_prompt_len=20")
    with pytest.raises(ConfigError, match=r"TL;DR train \(prompt <= 20 tokens.*no post fits"):
        tasks.build_task(config.task, "/unused")


def test_non_eos_penalty_reaches_the_replay_buffer(tiny_task):
    tokenizer, example = tiny_task.tokenizer, tiny_task.train[0]
    finished = [*tokenizer.encode(" cat is sick"), tokenizer.eos_id]
    truncated = tokenizer.encode(" cat is sick and")  # stopped at max_new_tokens: no EOS
    width = max(len(finished), len(truncated))
    tokens = np.full((2, width), tokenizer.pad_id, np.int32)
    tokens[0, : len(finished)], tokens[1, : len(truncated)] = finished, truncated
    lengths = np.array([len(finished), len(truncated)], np.int32)
    mask = (np.arange(width)[None] < lengths[:, None]).astype(np.float32)
    generation = Generation(jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(lengths), -mask)

    worker = SearchWorker(
        generate_fn=lambda params, prompts, prompt_mask, rng: generation,
        score_fn=lambda params, prompts, prompt_mask, response, response_mask: -response_mask,
        reference_params=None,
        tokenizer=tokenizer,
        rewards_fn=tiny_task.rewards,
        max_prompt_len=256,
        samples_per_prompt=2,
        time_split=TimeSplit(),
        rates=RateMeter(),
        non_eos_penalty=tiny_task.non_eos_penalty,
    )
    buffer = ReplayBuffer(
        max_prompt_len=256,
        max_response_len=width,
        pad_id=tokenizer.pad_id,
        capacity=10,
        capacity_per_prompt=10,
        recency_prob=1.0,
        priority="uniform",
        priority_inverse_temperature=0.0,
    )
    buffer.add(worker.search(None, 0, [example], jax.random.key(0)))
    batch = buffer.sample(1, 2, np.random.default_rng(0))
    lengths = batch.response_mask.sum(1).astype(int).tolist()
    by_length = dict(zip(lengths, batch.reward.tolist(), strict=True))
    rm_score = tiny_task.rewards([example], [" cat is sick"])[0]
    assert by_length[len(finished)] == pytest.approx(rm_score)  # the reward model's score
    assert by_length[len(truncated)] == -1.0  # the penalty, not the reward model's score
    assert rm_score != -1.0


# ------------------------------------------------------------------------ metric math


def test_win_rate_counts_ties_as_half():
    assert tldr_task.win_rate([3.0, 1.0, 2.0, 0.0], [1.0, 1.0, 5.0, -1.0]) == 0.625
    with pytest.raises(ValueError, match="equally many"):
        tldr_task.win_rate([1.0], [1.0, 2.0])


def test_perplexity_and_kl_by_hand():
    assert tldr_task.perplexity(np.array([-2.0, -4.0]), np.array([2, 3])) == pytest.approx(
        np.exp(6.0 / 5.0)
    )
    assert tldr_task.kl_estimate(np.array([-1.0, -3.0]), np.array([-2.0, -2.0])) == 0.0
    assert tldr_task.kl_estimate(np.array([-1.0, -3.0]), np.array([-4.0, -4.0])) == 2.0


def test_summary_metrics_by_hand():
    summaries = tldr_task.Summaries(
        examples=[{}, {}],
        texts=["a", "b"],
        lengths=np.array([2, 4]),
        ended=np.array([True, False]),
        logp_policy=np.array([-1.0, -2.0]),
        logp_ref=np.array([-2.0, -2.0]),
        logp_ref_at_t1=np.array([-3.0, -3.0]),
    )
    metrics = tldr_task.summary_metrics(
        summaries, np.array([1.0, 0.0]), np.array([0.5, 1.5]), np.array([0.0, 0.0]), with_kl=True
    )
    assert metrics == pytest.approx(
        {
            "win_rate": 0.75,
            "gold_score": 0.5,
            "rm_score": 1.0,
            "length": 3.0,
            "eos_fraction": 0.5,
            "ref_perplexity": np.exp(1.0),
            "kl": 0.5,
        }
    )


# ------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory, data_dir):
    workdir = str(tmp_path_factory.mktemp("tldr_sync"))
    config = get_config(f"tiny,mode=sync,task.data_dir={data_dir}")
    return workdir, config, train_and_evaluate(config, workdir)


def test_tiny_variant_trains_end_to_end(sync_run):
    _, _, summary = sync_run
    assert summary["config_name"] == "tldr_pythia" and summary["learner_steps"] == TINY_STEPS
    assert summary["samples_generated"] == TINY_STEPS * 2 * 4  # steps × prompts × K
    for key in ("eval_mean_reward_start", "eval_mean_reward_end"):  # mean RM scores
        assert np.isfinite(summary[key])


def test_evaluate_writes_the_tldr_metrics(sync_run):
    workdir, _, summary = sync_run
    result = subprocess.run(
        [sys.executable, EVALUATE_SCRIPT, f"--workdir={workdir}"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((Path(workdir) / "eval.json").read_text())
    assert metrics["task"] == "tldr" and metrics["step"] == TINY_STEPS
    assert metrics["num_examples"] == 8 and metrics["num_samples"] == 2
    assert metrics["reward_model"] == "preset:micro:seed=1"
    assert metrics["gold_reward_model"] == "preset:micro:seed=2"
    for prefix, count in (("greedy", 8), ("sampled", 16)):
        win_rate = metrics[f"{prefix}_win_rate"]
        assert 0.0 <= win_rate <= 1.0 and (2 * count * win_rate) % 1 == 0  # halves of 1/count
        assert metrics[f"{prefix}_ref_perplexity"] > 1.0
        assert 0 < metrics[f"{prefix}_length"] <= 48
        assert 0.0 <= metrics[f"{prefix}_eos_fraction"] <= 1.0
    assert np.isfinite(metrics["sampled_kl"]) and "greedy_kl" not in metrics
    # The in-training evaluation is the mean reward of the same greedy summaries.
    assert metrics["greedy_rm_score"] == pytest.approx(summary["eval_mean_reward_end"], abs=1e-5)


def test_kl_of_the_policy_against_itself_is_zero(sync_run, data_dir):
    workdir, config, _ = sync_run
    task = tasks.build_task(config.task, workdir)
    run = restore_run(config, workdir)
    settings = EvalSettings(
        max_prompt_len=config.max_prompt_len,
        max_new_tokens=16,
        num_examples=4,
        batch_size=8,
        num_samples=2,
        ks=(1,),
        temperature=0.7,
        top_k=0,
        top_p=1.0,
        seed=0,
    )
    metrics = task.evaluate(run.model, run.params, settings, run.params)
    assert metrics["sampled_kl"] == pytest.approx(0.0, abs=1e-4)
    assert metrics["num_examples"] == 4 and metrics["sampled_length"] <= 16
    assert task.evaluate.reference(run.model, None) is None  # no π_ref to fall back to
