"""The persistent compilation cache a config sets (tba_jax/compile_cache.py)."""

import logging

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from configs.arithmetic import get_config
from configs.reward_model import get_config as reward_model_config
from tba_jax import compile_cache, train, train_reward_model

CACHE_HITS = "/jax/compilation_cache/cache_hits"
SETTINGS = (  # the JAX settings compile_cache.use changes
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_compilation_cache_max_size",
)


@pytest.fixture(autouse=True)
def restore_jax_cache_settings(monkeypatch):
    """Each test starts without the session's JAX_COMPILATION_CACHE_DIR (tests/conftest.py)
    and leaves JAX's cache settings as it found them."""
    monkeypatch.delenv(compile_cache.ENVIRONMENT_VARIABLE, raising=False)
    before = {name: jax.config.values[name] for name in SETTINGS}
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


@pytest.fixture
def cache_hits():
    hits = []

    def listener(event, **kwargs):
        if event == CACHE_HITS:
            hits.append(event)

    jax.monitoring.register_event_listener(listener)
    yield hits
    jax.monitoring.unregister_event_listener(listener)


def cache_config(folder, min_compile_seconds=0.0) -> ml_collections.ConfigDict:
    config = get_config("smoke")
    config.compile_cache.dir = str(folder)
    config.compile_cache.min_compile_seconds = min_compile_seconds
    return config


def compile_a_new_program(scale: float) -> float:
    """A program no other test compiles (`scale` is baked into its HLO)."""
    return float(jax.jit(lambda x: jnp.tanh(x * scale).sum())(np.arange(8, dtype=np.float32)))


def cache_entries(folder) -> list[str]:
    return sorted(path.name for path in folder.glob("*-cache"))


def test_a_program_compiled_once_is_loaded_from_the_folder_afterwards(tmp_path, cache_hits):
    folder = tmp_path / "cache"
    assert compile_cache.use(cache_config(folder)) == str(folder)
    first = compile_a_new_program(1.25)
    assert len(cache_entries(folder)) == 1 and not cache_hits
    jax.clear_caches()  # as a new process would start: nothing compiled in memory
    assert compile_a_new_program(1.25) == first
    assert len(cache_hits) == 1 and len(cache_entries(folder)) == 1


def test_programs_quicker_to_compile_than_the_threshold_are_not_written(tmp_path):
    folder = tmp_path / "cache"
    compile_cache.use(cache_config(folder, min_compile_seconds=60.0))
    compile_a_new_program(2.5)
    assert cache_entries(folder) == []


def test_a_second_config_in_the_same_process_caches_in_its_own_folder(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    compile_cache.use(cache_config(first))
    compile_a_new_program(3.75)
    compile_cache.use(cache_config(second))
    compile_a_new_program(4.5)
    assert len(cache_entries(first)) == len(cache_entries(second)) == 1


def test_no_folder_leaves_jax_settings_alone(tmp_path):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "set_by_the_user"))
    config = cache_config("")
    assert compile_cache.use(config) == ""
    with config.unlocked():
        del config["compile_cache"]  # a config.json saved before the key existed
    assert compile_cache.use(config) == ""
    assert jax.config.values["jax_compilation_cache_dir"] == str(tmp_path / "set_by_the_user")


def test_no_folder_after_a_folder_turns_the_cache_off_again(tmp_path):
    # a notebook: a run that caches, then one with compile_cache.dir=""
    own = {name: jax.config.values[name] for name in SETTINGS}
    compile_cache.use(cache_config(tmp_path / "first"))
    assert jax.config.values["jax_compilation_cache_dir"] == str(tmp_path / "first")
    assert compile_cache.use(cache_config("")) == ""
    assert {name: jax.config.values[name] for name in SETTINGS} == own
    compile_a_new_program(6.5)
    assert cache_entries(tmp_path / "first") == []


def test_a_folder_that_cannot_be_written_after_one_that_could_caches_nothing(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    compile_cache.use(cache_config(tmp_path / "first"))
    assert compile_cache.use(cache_config(a_file)) == ""
    compile_a_new_program(7.25)
    assert cache_entries(tmp_path / "first") == []


def test_the_environment_variable_wins_over_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_cache.ENVIRONMENT_VARIABLE, str(tmp_path / "from_the_env"))
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "from_the_env"))
    assert compile_cache.use(cache_config(tmp_path / "from_the_config")) == str(
        tmp_path / "from_the_env"
    )
    assert jax.config.values["jax_compilation_cache_dir"] == str(tmp_path / "from_the_env")
    compile_a_new_program(5.25)
    assert not (tmp_path / "from_the_config").exists()


def test_a_folder_that_cannot_be_written_is_a_warning_not_a_failed_run(tmp_path, caplog):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    with caplog.at_level(logging.WARNING):
        assert compile_cache.use(cache_config(a_file)) == ""
    assert "compile_cache.dir" in caplog.text and "is a file" in caplog.text
    assert a_file.read_text() == "not a folder"


def test_the_default_folder_is_under_the_users_cache():
    assert compile_cache.cache_dir(get_config("smoke")).endswith(".cache/tba_jax/jax")


class CacheSet(Exception):
    """Raised where a launcher sets the cache, to see when it does."""


@pytest.mark.parametrize(
    "module, run, config",
    [
        (train, train.train_and_evaluate, lambda: get_config("smoke")),
        (
            train_reward_model,
            train_reward_model.train_reward_model,
            lambda: reward_model_config("tiny"),
        ),
    ],
    ids=["train", "train_reward_model"],
)
def test_runs_set_the_cache_after_checking_the_config_and_before_writing(
    tmp_path, monkeypatch, module, run, config
):
    def cache_set(config):
        raise CacheSet(config.compile_cache.dir)

    monkeypatch.setattr(module.compile_cache, "use", cache_set)
    workdir = tmp_path / "workdir"
    with pytest.raises(CacheSet, match=r"~/\.cache/tba_jax/jax"):
        run(config(), str(workdir))
    assert not workdir.exists()
