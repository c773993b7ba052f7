"""Bradley–Terry reward-model training (tba_jax/train_reward_model.py), the preference-pair
builder and converter (tba_jax/data/preferences.py) and configs/reward_model.py."""

import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support import save_tiny_llama_folder, sigterm_in_step

from configs.reward_model import TINY_PREFERENCES_DIR, get_config
from tba_jax import config_keys, learner, train_reward_model
from tba_jax import mesh as mesh_lib
from tba_jax.checkpoint import CheckpointMismatchError, RunStopped
from tba_jax.config_lib import ConfigError
from tba_jax.data import preferences
from tba_jax.models import hf, init_model
from tba_jax.models.frozen import load_frozen_model
from tba_jax.models.tokenizers import CharTokenizer
from tba_jax.rewards.reward_model import RewardModel, reward_model_role_config

TOL = 1e-4
FIXTURE = Path(TINY_PREFERENCES_DIR)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------- the math


def numpy_bradley_terry(chosen: np.ndarray, rejected: np.ndarray) -> float:
    """mean −log σ(c − r) = mean log(1 + exp(−(c − r))), in float64."""
    return float(np.mean(np.logaddexp(0.0, -(chosen - rejected))))


def test_bradley_terry_loss_and_gradient_equal_numpy():
    rng = np.random.default_rng(0)
    chosen, rejected = rng.normal(size=7), rng.normal(size=7)
    chosen[0], rejected[0] = -60.0, 60.0  # a far-off pair: stable, loss ≈ 120
    loss = train_reward_model.bradley_terry_loss(jnp.asarray(chosen), jnp.asarray(rejected))
    assert float(loss) == pytest.approx(numpy_bradley_terry(chosen, rejected), rel=1e-6)
    grad_chosen = jax.grad(train_reward_model.bradley_terry_loss)(jnp.asarray(chosen), rejected)
    sigmoid = 1.0 / (1.0 + np.exp(-(chosen - rejected)))
    np.testing.assert_allclose(grad_chosen, -(1.0 - sigmoid) / len(chosen), rtol=1e-5)
    assert float(
        train_reward_model.bradley_terry_loss(jnp.zeros(3), jnp.zeros(3))
    ) == pytest.approx(np.log(2.0))


def test_pairwise_accuracy_counts_ties_as_half():
    chosen = jnp.array([2.0, 1.0, 0.5, 3.0])
    rejected = jnp.array([1.0, 1.0, 0.7, -1.0])
    assert float(train_reward_model.pairwise_accuracy(chosen, rejected)) == pytest.approx(2.5 / 4)


def test_score_head_init_has_huang_et_als_std():
    head = train_reward_model.score_head_init(4095, 1.0, seed=0, dtype=jnp.float32)
    assert head.shape == (4095, 1)
    assert float(jnp.std(head)) == pytest.approx(1.0 / 64.0, rel=0.05)  # 1/sqrt(4096)
    assert not jnp.any(train_reward_model.score_head_init(8, 0.0, seed=0, dtype=jnp.float32))


# ---------------------------------------------------------------------------- the data


def test_preference_builder_reads_the_fixture_pairs_in_order(tmp_path):
    for split, count in (("train", 48), ("test", 16)):
        pairs = preferences.load_split(split, tmp_path / "data", manual_dir=FIXTURE)
        source = read_jsonl(FIXTURE / f"{split}.jsonl")
        assert len(pairs) == count
        assert pairs == [{"id": i, **record} for i, record in enumerate(source)]


def test_preference_builder_names_missing_files(tmp_path):
    (tmp_path / "manual").mkdir()
    with pytest.raises(FileNotFoundError, match=r"train\.jsonl, test\.jsonl"):
        preferences.load_split("train", tmp_path / "data", manual_dir=tmp_path / "manual")


def comparison(
    split: str, choice: int, post: str | None = "My cat sneezes a lot at night."
) -> dict:
    info = {"id": "t3_x", "subreddit": "pets", "title": "Cat", "post": post}
    summaries = [{"text": "cat sneezes "}, {"text": " my cat is sick"}]
    return {"info": info, "summaries": summaries, "choice": choice, "split": split}


def test_comparisons_become_pairs_in_the_tldr_prompt_format():
    records = [comparison("train", 1), comparison("valid1", 0), comparison("valid2", 0, None)]
    pairs = preferences.convert_comparisons(records)
    prompt = "SUBREDDIT: r/pets\n\nTITLE: Cat\n\nPOST: My cat sneezes a lot at night.\n\nTL;DR:"
    assert pairs == {
        "train": [{"prompt": prompt, "chosen": " my cat is sick", "rejected": " cat sneezes"}],
        "test": [{"prompt": prompt, "chosen": " cat sneezes", "rejected": " my cat is sick"}],
    }  # the CNN/DM-style record without a post is skipped
    short = preferences.convert_comparisons([comparison("train", 0)], max_prompt_len=60)
    assert short["train"][0]["prompt"].endswith("POST: My cat sneezes\n\nTL;DR:")  # 60 chars
    with pytest.raises(ValueError, match="split='extra'"):
        preferences.convert_comparisons([comparison("extra", 0)])
    with pytest.raises(ValueError, match="choice=2"):
        preferences.convert_comparisons([comparison("train", 2)])


def test_convert_command_writes_files_the_builder_reads(tmp_path, capsys):
    source = tmp_path / "batch1.json"
    source.write_text("".join(json.dumps(comparison(s, 0)) + "\n" for s in ("train", "valid1")))
    assert preferences.main([f"--comparisons={tmp_path}/batch*.json", f"--out={tmp_path}/out"]) == 0
    assert json.loads(capsys.readouterr().out)["pairs"] == {"train": 1, "test": 1}
    pairs = preferences.load_split("test", tmp_path / "data", manual_dir=tmp_path / "out")
    assert pairs[0]["chosen"] == " cat sneezes"


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"split": "train", "info": {"post": "p"}}', "has no summaries, choice"),
        ('{"split": "train" "info": 1}', "batch1.json:1 is not valid JSON"),
        (json.dumps(comparison("extra", 0)), "split='extra'"),
    ],
)
def test_convert_command_reports_a_bad_comparison_in_one_line(tmp_path, capsys, line, message):
    (tmp_path / "batch1.json").write_text(line + "\n")
    argv = [f"--comparisons={tmp_path}/batch*.json", f"--out={tmp_path}/out"]
    assert preferences.main(argv) == 1
    (error,) = capsys.readouterr().err.splitlines()
    assert error.startswith("error: ") and message in error
    assert not (tmp_path / "out").exists()  # nothing written


# ----------------------------------------------------------------------------- training


def test_paper_config_is_huang_et_als_recipe():
    config = get_config()
    assert config.tokenizer == "checkpoint" and config.model.preset == "pythia-1b"
    assert (config.train.num_epochs, config.train.steps, config.train.batch_size) == (1, 0, 64)
    assert config.optim.learning_rate == 3e-6 and config.optim.eps == 1e-5
    assert config.model.score_init_scale == 1.0 and config.append_eos
    assert config.max_len == 512 + 53 + 1
    one_epoch_of_openai_pairs = 92_858 // 64
    assert train_reward_model.train_steps(config, 92_858) == one_epoch_of_openai_pairs


def test_config_errors_come_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match=r"--config\.model\.hf_path=/path/to/sft-policy"):
        train_reward_model.train_reward_model(get_config(), str(tmp_path))
    with pytest.raises(ConfigError, match=r"compile_cache\.max_gib=0"):
        train_reward_model.train_reward_model(
            get_config("tiny,compile_cache.max_gib=0"), str(tmp_path)
        )
    needs_half = r"model\.attention=cudnn needs model\.dtype in \['bfloat16', 'float16'\]"
    with pytest.raises(ConfigError, match=needs_half):
        train_reward_model.train_reward_model(
            get_config("tiny,model.attention=cudnn"), str(tmp_path)
        )
    with pytest.raises(ConfigError, match=r"multiple of train\.num_microbatches"):
        train_reward_model.train_reward_model(get_config("tiny,batch=9"), str(tmp_path))
    with pytest.raises(ConfigError, match="48 training pairs make no batch"):
        train_reward_model.train_reward_model(
            get_config(f"tiny,batch=64,data.data_dir={tmp_path}/data"), str(tmp_path)
        )
    assert not (tmp_path / "hf").exists()
    # found once the pairs are read: a workdir the run made goes again, its data too
    workdir = tmp_path / "new_workdir"
    with pytest.raises(ConfigError, match="3 training pairs make no batch"):
        train_reward_model.train_reward_model(get_config("tiny,data.num_train=3"), str(workdir))
    assert not workdir.exists()
    (tmp_path / "a_file").write_text("")
    with pytest.raises(
        ConfigError, match=r"out_dir=\S+/a_file/hf cannot be created: \S+ is a file"
    ):
        train_reward_model.train_reward_model(
            get_config(f"tiny,out_dir={tmp_path}/a_file/hf"), str(workdir)
        )
    assert not workdir.exists()


def test_the_2_8b_variant_plans_one_80_gb_gpu_in_smaller_micro_batches():
    config = get_config("2.8b")
    assert config.model.preset == "pythia-2.8b" and config.train.batch_size == 64
    assert config.train.batch_size // config.train.num_microbatches == 8  # pairs at a time


@pytest.mark.parametrize(
    "item, message",
    [
        ("data.num_test=-1", r"data\.num_test=-1 must be an integer >= 0"),  # not all but one
        ("max_len=0", r"max_len=0 must be an integer >= 2"),
        ("lr=1e6", r"optim\.learning_rate=1000000\.0 must be a number in \(0, 1\.0\]"),
        ("optim.schedule=cosine", r"optim\.schedule='cosine' must be one of"),
        ("train.eval_batch_size=0", r"train\.eval_batch_size=0 must be an integer >= 1"),
        ("log_every=0", r"log_every=0 must be an integer >= 1"),
        ("model.dtype=float8", r"model\.dtype='float8' must be one of"),
    ],
)
def test_values_out_of_range_are_refused_before_anything_is_loaded(item, message):
    with pytest.raises(ConfigError, match=message):
        train_reward_model.check_config(get_config(f"tiny,{item}"), 1)


@pytest.mark.parametrize("variant", ["", "tiny", "2.8b"])
def test_every_ranged_key_exists_and_its_default_is_in_range(variant):
    """The trainer's range table names real keys (a typo would silently check nothing:
    `check_ranges` skips keys a config does not have), and the shipped values pass."""
    config = get_config(variant)
    for path, allowed in train_reward_model.RANGES.items():
        present, value = config_keys.lookup(config, path)
        assert present, f"RANGES names {path!r}, which configs/reward_model.py does not have"
        assert allowed.check(value), f"{variant}: {path}={value!r} is not {allowed.description}"


def test_a_response_longer_than_max_len_is_the_configs_to_change():
    tokenizer = CharTokenizer("POSThi :alongswer")
    pair = {"prompt": "POST: hi", "chosen": "a long answer", "rejected": "no"}
    with pytest.raises(ConfigError, match=r"is 13 tokens, more than .* max_len=8 .*raise max_len"):
        train_reward_model.encode_pairs(tokenizer, [pair], max_len=8, append_eos=True)


def test_every_mesh_axis_is_a_key_and_old_workdirs_keep_their_identity():
    """`mesh.axes` names data, fsdp and tensor, so a run sets any from the command line;
    axes of size 1 are left out of the checkpoints' identity, so a workdir written when
    the config named only fsdp goes on."""
    config = get_config("tiny,mesh.axes.data=-1,mesh.axes.fsdp=1")
    assert dict(config.mesh.axes) == {"data": -1, "fsdp": 1, "tensor": 1}
    before = get_config("tiny")
    before.mesh.axes = {"fsdp": -1}  # the default until 2026-11-28
    assert train_reward_model.experiment(before) == train_reward_model.experiment(
        get_config("tiny")
    )
    assert train_reward_model.experiment(config) != train_reward_model.experiment(before)
    with pytest.raises(ConfigError, match=r"mesh\.axes=.*need 2 devices and there are 1"):
        train_reward_model.check_config(get_config("tiny,mesh.axes.fsdp=1,mesh.axes.tensor=2"), 1)


def test_remat_and_attention_change_how_a_step_computes_not_what():
    """The execution knobs reach the model, leave the checkpoints' identity alone (a
    resumed run may change them) and give the same step up to float rounding."""
    plain = get_config("tiny")
    remat = get_config("tiny,model.remat=nothing_saveable,model.attention=dot_product")
    assert train_reward_model.experiment(remat) == train_reward_model.experiment(plain)
    assert train_reward_model.experiment(get_config("tiny,lr=0.01")) != (
        train_reward_model.experiment(plain)
    )
    tokenizer = train_reward_model.rm_tokenizer(plain)
    pairs = [
        {"prompt": "POST: a long day.", "chosen": "a day.", "rejected": "A DAY!"},
        {"prompt": "POST: rain again", "chosen": "it rains", "rejected": "RAIN"},
    ] * 2
    batch = train_reward_model.encode_pairs(
        tokenizer, pairs, max_len=plain.max_len, append_eos=True
    )
    results = []
    for config in (plain, remat):
        cfg = train_reward_model.reward_model_config(config, tokenizer)
        model, params = init_model(cfg, seed=0)
        params["score"] = train_reward_model.score_head_init(cfg.d_model, 1.0, 0, jnp.float32)
        # plain SGD at lr 1: the update is the gradient itself (Adam's first step, about
        # ±lr wherever |g| >> eps, turns the rounding of a near-zero gradient into a
        # difference of up to lr: 1e-5 at one weight of 2,048 under JAX 0.12 at LLVM level 0)
        optimizer = optax.sgd(1.0)
        initial = jax.device_get(params)
        state, state_sharding, mesh = learner.one_device_train_state(model, params, optimizer)
        step = train_reward_model.make_train_step(
            model, optimizer, num_microbatches=2, state_sharding=state_sharding, mesh=mesh
        )
        state, metrics = step(state, batch)
        trained = jax.device_get(state.params)
        leaves = zip(jax.tree.leaves(trained), jax.tree.leaves(initial), strict=True)
        # the step moved the weights far past the tolerance the two configs are held to
        assert max(np.abs(after - before).max() for after, before in leaves) > 1e-3
        results.append((cfg, trained, jax.device_get(metrics)))
    (cfg_plain, params_plain, metrics_plain), (cfg_remat, params_remat, metrics_remat) = results
    assert (cfg_plain.remat, cfg_plain.attention) == ("none", "einsum")
    assert (cfg_remat.remat, cfg_remat.attention) == ("nothing_saveable", "dot_product")
    for name, value in metrics_plain.items():
        assert metrics_remat[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    for a, b in zip(jax.tree.leaves(params_plain), jax.tree.leaves(params_remat), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("rm_tiny")
    return workdir, train_reward_model.train_reward_model(get_config("tiny"), str(workdir))


def test_tiny_reward_model_learns_the_synthetic_preference(tiny_rm):
    workdir, summary = tiny_rm
    assert summary["num_train_pairs"] == 48 and summary["num_test_pairs"] == 16
    assert summary["steps"] == 24
    assert summary["test_accuracy_before"] == 0.5  # the zero head ties every pair
    assert summary["test_loss_before"] == pytest.approx(np.log(2.0), rel=1e-6)
    assert summary["test_accuracy_after"] >= 0.9
    assert summary["test_loss_after"] < 0.5 * np.log(2.0)
    assert json.loads((workdir / train_reward_model.SUMMARY_FILENAME).read_text()) == summary


def test_a_stopped_reward_model_goes_on_from_its_checkpoints_to_the_same_model(
    tiny_rm, tmp_path, monkeypatch
):
    original = train_reward_model.make_train_step
    began = time.time()
    with monkeypatch.context() as patch:
        sigterm_in_step(patch, train_reward_model, "make_train_step", 14)  # step 15 of 24
        with pytest.raises(RunStopped, match="SIGTERM"):
            train_reward_model.train_reward_model(get_config("tiny"), str(tmp_path))
    stopped_segment = time.time() - began
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["10", "15", "experiment.json"]
    assert not (tmp_path / "hf").exists()
    with pytest.raises(CheckpointMismatchError, match="another experiment"):
        train_reward_model.train_reward_model(get_config("tiny,lr=0.01"), str(tmp_path))
    steps_run = []

    def counted(*args, **kwargs):
        step_fn = original(*args, **kwargs)
        return lambda *step_args: steps_run.append(1) or step_fn(*step_args)

    began = time.time()
    with monkeypatch.context() as patch:
        patch.setattr(train_reward_model, "make_train_step", counted)
        summary = train_reward_model.train_reward_model(get_config("tiny"), str(tmp_path))
    resumed_segment = time.time() - began
    assert len(steps_run) == 24 - 15  # from the checkpoint of step 15
    both_segments = stopped_segment + resumed_segment  # the summary's times are both's
    assert 0.9 * both_segments <= summary["wall_seconds"] <= both_segments
    assert summary["train_seconds"] < summary["wall_seconds"]
    workdir, straight = tiny_rm
    for key in ("test_accuracy_before", "test_loss_before", "test_loss_after", "steps"):
        assert summary[key] == straight[key]
    model_file = Path(summary["hf_folder"]) / "model.safetensors"
    assert model_file.read_bytes() == (workdir / "hf" / "model.safetensors").read_bytes()
    # the model folder supersedes the steps; what later runs are checked against stays
    assert os.listdir(tmp_path / "checkpoints") == ["experiment.json"]


def _files_and_bytes(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def test_a_finished_reward_model_is_given_back_not_trained_again(tiny_rm, monkeypatch):
    workdir, summary = tiny_rm
    before = _files_and_bytes(workdir)
    monkeypatch.setattr(train_reward_model, "train_on_pairs", None)  # any training fails
    assert train_reward_model.train_reward_model(get_config("tiny"), str(workdir)) == summary
    with pytest.raises(CheckpointMismatchError, match="another experiment"):
        train_reward_model.train_reward_model(get_config("tiny,lr=0.01"), str(workdir))
    assert _files_and_bytes(workdir) == before  # its model folder above all


def test_another_runs_workdir_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "experiment.json").write_text('{"another": "run"}')
    before = _files_and_bytes(tmp_path)
    with pytest.raises(CheckpointMismatchError, match="another experiment"):
        train_reward_model.train_reward_model(get_config("tiny"), str(tmp_path))
    assert _files_and_bytes(tmp_path) == before and not (tmp_path / "data").exists()


def test_saved_reward_model_scores_the_same_in_transformers_and_as_a_reward_model(tiny_rm):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    workdir, summary = tiny_rm
    folder = summary["hf_folder"]
    assert folder == str(workdir / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(summary["files"])
    pairs = read_jsonl(FIXTURE / "test.jsonl")
    prompts = [pair["prompt"] for pair in pairs] * 2
    responses = [pair["chosen"] for pair in pairs] + [pair["rejected"] for pair in pairs]
    max_len = get_config("tiny").max_len

    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        folder, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    theirs = []
    for prompt, response in zip(prompts, responses, strict=True):
        ids = (tokenizer(prompt + response)["input_ids"] + [tokenizer.eos_token_id])[-max_len:]
        with torch.no_grad():
            theirs.append(model(torch.tensor([ids])).logits[0, 0].item())

    role = reward_model_role_config(batch_size=8, max_len=max_len)
    role.hf_path = folder  # as task.reward_model.hf_path of a TL;DR run
    ours = RewardModel.from_config(
        role, role_name="rm", fallback_tokenizer=CharTokenizer.for_text()
    )
    scores = ours.scores(prompts, responses)
    np.testing.assert_allclose(scores, theirs, atol=TOL)
    chosen, rejected = np.split(scores, 2)
    assert np.mean(chosen - rejected) == pytest.approx(summary["test_margin_after"], abs=TOL)
    assert (
        float(train_reward_model.pairwise_accuracy(chosen, rejected))
        == summary["test_accuracy_after"]
    )


def test_reward_model_starts_from_a_causal_lm_checkpoint(tmp_path):
    pairs = read_jsonl(FIXTURE / "train.jsonl")
    folder = save_tiny_llama_folder(
        tmp_path / "sft",
        [pair["prompt"] + pair["chosen"] for pair in pairs],
        vocab_size=300,
        max_position_embeddings=256,
    )
    config = get_config(f"tiny,tokenizer=checkpoint,hf_path={folder},model.score_init_scale=1.0")
    tokenizer = train_reward_model.rm_tokenizer(config)
    mesh = mesh_lib.make_mesh(jax.devices(), config.mesh.axes)
    model, params = train_reward_model.init_reward_model(config, tokenizer, mesh)
    assert model.config.head == "score" and model.config.num_labels == 1
    _, lm_params = hf.load_model(folder)
    assert "lm_head" in lm_params and "lm_head" not in params
    body = {name: value for name, value in lm_params.items() if name != "lm_head"}
    jax.tree.map(np.testing.assert_array_equal, {**body, "score": params["score"]}, params)
    expected_head = train_reward_model.score_head_init(model.config.d_model, 1.0, 0, jnp.float32)
    np.testing.assert_array_equal(params["score"], expected_head)

    out = str(tmp_path / "rm")
    files = train_reward_model.save_reward_model(config, model, params, tokenizer, out)
    assert "tokenizer.json" in {Path(path).name for path in files}  # copied from the SFT folder
    role = reward_model_role_config(max_len=128)
    role.hf_path = out
    frozen = load_frozen_model(
        role, role_name="rm", fallback_tokenizer=tokenizer, max_seq_len=128, head="score"
    )
    assert frozen.model.config == model.config
    assert frozen.tokenizer.encode("TL;DR: hi") == tokenizer.encode("TL;DR: hi")
    jax.tree.map(np.testing.assert_array_equal, frozen.params, params)
