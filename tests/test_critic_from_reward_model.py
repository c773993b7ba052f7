"""PPO's critic started as the task's reward model (`loss.ppo.critic_init=reward_model`,
Huang et al. 2024's TL;DR recipe): the tiny TL;DR run's critic at step 0 is the reward
model, and a reward-model checkpoint the critic cannot read the policy's tokens with is
refused before any work."""

import jax
import numpy as np
import pytest
from support import save_tiny_llama_folder

from configs.tldr_pythia import TINY_DATA_DIR
from configs.tldr_pythia import get_config as tldr_config
from tba_jax import runs
from tba_jax.config_lib import ConfigError
from tba_jax.models import hf
from tba_jax.models.tokenizers import CharTokenizer, tokenizer_mismatch
from tba_jax.train import check_critic_reward_model

TINY_PPO = "tiny,mode=sync,method=ppo,warm_start.steps=0,eval.num_examples=2"
CORPUS = ["TL;DR: my cat ignores the new food", "the rice burns at the bottom of the pot"]


def test_tokenizers_that_encode_alike_match_and_others_say_where_they_differ():
    text = CharTokenizer.for_text()
    assert tokenizer_mismatch(text, CharTokenizer.for_text()) == ""
    assert "vocab_size" in tokenizer_mismatch(text, CharTokenizer.for_arithmetic())
    other_order = CharTokenizer("".join(reversed(text.alphabet)))
    assert "encodes to" in tokenizer_mismatch(text, other_order)


def test_the_tiny_tldr_ppo_run_starts_its_critic_as_the_reward_model(tmp_path):
    from tba_jax import tasks
    from tba_jax.train import train_and_evaluate

    config = tldr_config(TINY_PPO + ",learner_steps=1")
    config.task.manual_dir = TINY_DATA_DIR
    workdir = str(tmp_path / "run")
    train_and_evaluate(config, workdir)
    reward_model = tasks.build_task(config.task, workdir).rewards.frozen
    at_start = runs.restore_run(config, workdir, step=0)
    critic, critic_params = at_start.critic
    assert critic.model.config == reward_model.model.config  # float32 both, tiny
    for want, got in zip(
        jax.tree.leaves(reward_model.params), jax.tree.leaves(critic_params), strict=True
    ):
        np.testing.assert_array_equal(want, got)
    _, trained_params = runs.restore_run(config, workdir, step=1).critic
    moved = [
        not np.array_equal(a, b)
        for a, b in zip(
            jax.tree.leaves(critic_params), jax.tree.leaves(trained_params), strict=True
        )
    ]
    assert any(moved)  # and the step trained it


def test_a_critic_the_learner_mesh_cannot_split_is_refused_before_the_task_is_built():
    """The critic starts as micro's reward model (one KV head): over tensor 2 (abstract
    devices, as one CPU will do) `check_run`'s mesh check names it, before the TL;DR data
    are prepared (until 2026-11-29 an error naming no model, after them)."""
    from jax.sharding import AbstractMesh

    from tba_jax.mesh import RoleMeshes
    from tba_jax.train import check_policy_shardings

    mesh = AbstractMesh((1, 1, 2), ("data", "fsdp", "tensor"))
    meshes = RoleMeshes(sampler=AbstractMesh((1, 1, 1), mesh.axis_names), learner=mesh)
    config = tldr_config(TINY_PPO + ",model.preset=tiny")
    with pytest.raises(ConfigError, match=r"^PPO's critic on the learner mesh: .* 'tensor'"):
        check_policy_shardings(config, meshes)
    check_policy_shardings(
        tldr_config(TINY_PPO + ",model.preset=tiny,task.reward_model.preset=tiny"), meshes
    )


def test_a_shared_critic_or_a_task_without_a_reward_model_cannot_start_from_one():
    from configs.arithmetic import get_config as arithmetic_config
    from tba_jax.config_lib import validate

    shared = tldr_config(TINY_PPO + ",loss.ppo.critic=shared")
    with pytest.raises(ConfigError, match="critic=separate"):
        validate(shared, 1)
    arithmetic = arithmetic_config("mode=sync,method=ppo,loss.ppo.critic_init=reward_model")
    with pytest.raises(ConfigError, match=r"has no task\.reward_model"):
        validate(arithmetic, 1)


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """A tiny Llama policy, a one-label reward model with its tokenizer, one with a
    tokenizer trained on other text, and a two-label classifier, in Hugging Face layout."""
    transformers = pytest.importorskip("transformers")
    base = tmp_path_factory.mktemp("hf")

    def classifier(name: str, tokenizer_corpus: list[str], num_labels: int = 1) -> str:
        folder = save_tiny_llama_folder(
            base / name, tokenizer_corpus, vocab_size=300, max_position_embeddings=512
        )
        llama = transformers.AutoConfig.from_pretrained(folder)
        llama.num_labels = num_labels
        transformers.LlamaForSequenceClassification(llama).save_pretrained(folder)
        return folder

    policy = save_tiny_llama_folder(
        base / "policy", CORPUS, vocab_size=300, max_position_embeddings=512
    )
    return {
        "policy": policy,
        "reward": classifier("reward", CORPUS),
        "other_tokenizer": classifier("other", ["entirely different words", "zebra quartz"]),
        "two_labels": classifier("two", CORPUS, num_labels=2),
    }


def hf_config(folders, reward: str, with_policy: bool = True):
    config = tldr_config(TINY_PPO)
    if with_policy:
        config.model.hf_path = folders["policy"]
    config.task.reward_model.hf_path = folders[reward]
    return config


def test_a_reward_model_checkpoint_on_the_policys_tokenizer_is_the_critics_start(hf_folders):
    config = hf_config(hf_folders, "reward")
    tokenizer = runs.policy_tokenizer(config)
    check_critic_reward_model(config, tokenizer)
    policy_cfg = runs.model_config(config, tokenizer.vocab_size)
    value_cfg = runs.critic_start_config(config, policy_cfg)
    assert (value_cfg.head, value_cfg.num_labels) == ("score", 1)
    assert value_cfg.param_dtype == policy_cfg.param_dtype
    start = runs.critic_start_params(config, tokenizer)
    _, want = hf.load_model(hf_folders["reward"], dtype="float32")
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(start), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "reward, with_policy, message",
    [
        ("other_tokenizer", True, "is not the policy's"),
        ("two_labels", True, "num_labels=2"),
        ("reward", False, r"needs the policy from model\.hf_path"),
    ],
)
def test_a_reward_model_the_critic_cannot_start_as_is_refused(
    hf_folders, reward, with_policy, message
):
    config = hf_config(hf_folders, reward, with_policy)
    with pytest.raises(ConfigError, match=message):
        check_critic_reward_model(config, runs.policy_tokenizer(config))
