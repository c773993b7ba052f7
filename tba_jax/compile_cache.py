"""A run's compiled programs kept on disk (JAX's persistent compilation cache).

Every run compiles its learner step, generation and π_ref scoring programs when it starts,
and again on each resume or ablation of the same shapes. With `compile_cache.dir` set, a
program XLA compiled before (the same HLO, devices, compiler flags and JAX version: JAX's
cache key) is loaded from disk instead of compiled; any change to a program is a new key,
so a cached program is never a stale one. The demo on a 2-core CPU loads its learner
step in 0.8 s where it compiled in 3.8 s, the second time (README "Running experiments").

Only programs that took at least `min_compile_seconds` to compile are written (most of a
run's are small and quick), and the folder is kept under `max_gib` by evicting the least
recently used entries. Over several processes only process 0 writes (JAX's rule); every
process reads. A JAX_COMPILATION_CACHE_DIR in the environment wins (JAX's own settings are
then left alone: the test suite's session cache is one). `dir` "" compiles every program,
also in a process (a notebook) whose earlier run cached. The folder is trusted code: keep
it private (JAX's warning on `jax.experimental.compilation_cache.set_cache_dir`).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import jax
import ml_collections
from absl import logging
from jax.experimental.compilation_cache import compilation_cache

from tba_jax.config_lib import is_url, output_dir_problem

GIB = 2**30
ENVIRONMENT_VARIABLE = "JAX_COMPILATION_CACHE_DIR"
# JAX writes an entry in place, so a run may read one that another run (a sweep's, or a
# process of the same run) is still writing; JAX then warns and compiles the program
# itself, which is all a cache miss is.
PARTIAL_ENTRY_WARNING = "Error reading persistent compilation cache entry"


def cache_dir(config: ml_collections.ConfigDict) -> str:
    """The folder `config` caches compiled programs in ('' for none). A config saved before
    the key existed (an older run's config.json) caches nothing."""
    settings = config.get("compile_cache")
    if settings is None or not settings.dir:
        return ""
    return os.path.abspath(os.path.expanduser(settings.dir))


# JAX's own values of the settings `use` changed in this process, and the folder it set:
# a later config that caches nothing (a notebook's next run) puts them back.
_jax_own_settings: dict[str, Any] = {}
_folder_set: str | None = None
DIR_SETTING = "jax_compilation_cache_dir"


def use(config: ml_collections.ConfigDict) -> str:
    """Points JAX's compilation cache at `config.compile_cache` before anything compiles;
    returns the folder ('' when the config caches nothing, or when the folder cannot be
    written, with a warning). When JAX_COMPILATION_CACHE_DIR is set, JAX's settings are
    left as they are (its folder is returned). In a process that ran configs before (a
    notebook), a config caching in another folder switches to it, and one caching nothing
    turns off the cache an earlier `use` turned on (JAX's settings go back to their own
    values; a folder the user set in JAX themselves is left alone)."""
    if os.environ.get(ENVIRONMENT_VARIABLE):
        return os.environ[ENVIRONMENT_VARIABLE]
    path = cache_dir(config)
    if not path:
        stop_caching()
        return ""
    problem = None if is_url(path) else output_dir_problem(path)  # JAX writes gs:// itself
    if problem:  # a cache is worth no failed run: say so once and compile as usual
        logging.warning(
            "compile_cache.dir=%s %s: every program is compiled in this run. Set "
            "--config.compile_cache.dir to a folder you can write (or '' for no cache).",
            path,
            problem,
        )
        stop_caching()
        return ""
    global _folder_set
    warnings.filterwarnings("ignore", message=PARTIAL_ENTRY_WARNING)
    settings = config.compile_cache
    current = jax.config.values.get(DIR_SETTING)
    _update("jax_persistent_cache_min_compile_time_secs", settings.min_compile_seconds)
    _update("jax_compilation_cache_max_size", int(settings.max_gib * GIB))
    if current != path:
        _update(DIR_SETTING, path)  # compilation_cache.set_cache_dir
        compilation_cache.reset_cache()  # JAX opens its cache folder once per process
    _folder_set = path
    return path


def _update(name: str, value: Any) -> None:
    _jax_own_settings.setdefault(name, jax.config.values.get(name))
    jax.config.update(name, value)


def stop_caching() -> None:
    """Turns off the cache an earlier `use` in this process turned on, if JAX still caches
    in its folder: JAX's settings go back to what they were before."""
    global _folder_set
    if _folder_set is not None and jax.config.values.get(DIR_SETTING) == _folder_set:
        for name, value in _jax_own_settings.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()
    _jax_own_settings.clear()
    _folder_set = None
