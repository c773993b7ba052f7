"""The supervised warm start on the learner mesh: one compiled step program per run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import SMALL_DECODER as CFG

from configs.common import learner_rules
from tba_jax import mesh as mesh_lib
from tba_jax import warmstart
from tba_jax.models import abstract_model
from tba_jax.models.tokenizers import CharTokenizer

PROMPT_LEN, RESPONSE_LEN = 8, 8
WARM_START = warmstart.WarmStartConfig(steps=3, batch_size=4, learning_rate=1e-3, warmup_steps=1)


@pytest.fixture(scope="module")
def setup():
    """A small decoder's params placed on a one-device learner mesh, as a run places them."""
    model, abstract = abstract_model(CFG)
    mesh = mesh_lib.make_mesh(jax.devices()[:1], {})
    shardings = mesh_lib.param_shardings(model.logical_axes, abstract, mesh, learner_rules())
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda a: jnp.asarray(rng.normal(0.0, CFG.init_std, a.shape).astype(np.float32)),
        abstract,
    )
    examples = [{"prompt": f"{a}+{b}=", "solution": str(a + b)} for a in range(4) for b in range(4)]
    return dict(
        model=model,
        params=jax.device_put(params, shardings),
        mesh=mesh,
        examples=examples,
        tokenizer=CharTokenizer.for_arithmetic(),
    )


def warm_start_steps(setup, monkeypatch, progress=None, steps=WARM_START.steps):
    """Runs the warm start up to `steps`; returns its progress and its step function."""
    made = []
    original = warmstart.make_supervised_step

    def recorded(*args, **kwargs):
        made.append(original(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(warmstart, "make_supervised_step", recorded)
    result = warmstart.warm_start(
        setup["model"],
        setup["params"],
        setup["examples"],
        setup["tokenizer"],
        WARM_START,
        max_prompt_len=PROMPT_LEN,
        max_response_len=RESPONSE_LEN,
        mesh=setup["mesh"],
        seed=0,
        progress=progress,
        should_stop=lambda: False,
    )
    (step_fn,) = made
    return result, step_fn


def test_a_warm_start_compiles_its_step_once(setup, monkeypatch):
    # Fresh optimiser state comes uncommitted from init, the steps' outputs placed on the
    # mesh: unless the first step's inputs are placed as its outputs are, JAX compiles
    # the step a second time for the second call.
    progress, step_fn = warm_start_steps(setup, monkeypatch)
    assert progress.steps_done == WARM_START.steps
    assert step_fn._cache_size() == 1


def test_going_on_from_saved_progress_compiles_its_step_once(setup, monkeypatch):
    progress, _ = warm_start_steps(setup, monkeypatch)
    halfway = progress._replace(steps_done=1)
    going_on, step_fn = warm_start_steps(setup, monkeypatch, progress=halfway)
    assert going_on.steps_done == WARM_START.steps
    assert step_fn._cache_size() == 1


def test_the_caller_keeps_its_params(setup, monkeypatch):
    # the steps donate their inputs: the warm start trains a copy
    before = jax.device_get(setup["params"])
    warm_start_steps(setup, monkeypatch)
    after = jax.device_get(setup["params"])
    assert all(
        np.array_equal(x, y)
        for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
    )
