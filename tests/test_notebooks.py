"""The notebooks of experiments/notebooks/, executed at tiny size (nbclient, offline), and
tba_jax.run_view.RunView on the runs the ablation notebook trains.

The ablation notebook trains once per module (two smoke runs of 2 learner steps, the only
training here); the inside-a-run notebook and the RunView tests read its runs. The kernels
share one JAX compilation cache, so only the first run compiles.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbclient
import nbformat
import numpy as np
import pytest

from tba_jax import runs
from tba_jax.checkpoint import Checkpointer
from tba_jax.errors import ConfigError
from tba_jax.run_view import RunView

# Under pytest-xdist (`--dist loadgroup`) the module's tests stay on one worker, which trains
# the ablation's runs once for all of them.
pytestmark = pytest.mark.xdist_group("notebooks")

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO_ROOT / "experiments" / "notebooks"
CELL_TIMEOUT_S = 600
TINY_STEPS = 2
M, K_VALUES = 0.95, (1, 2)


def parameters_cell(notebook) -> nbformat.NotebookNode:
    (cell,) = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    return cell


def execute(name: str, parameters: dict, cache_dir: Path):
    """Runs notebook `name` with its parameters cell replaced by `parameters`, in its own
    folder as Jupyter runs it; returns the executed notebook."""
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    parameters_cell(notebook).source = "\n".join(
        f"{key} = {value!r}" for key, value in parameters.items()
    )
    env = {
        **os.environ,
        # the kernelspec runs `python` from PATH: this interpreter's, with tba_jax's dependencies
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PLATFORMS": "cpu",
    }
    client = nbclient.NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute(env=env)
    return notebook


def outputs(notebook, kind: str) -> list[str]:
    """Every output of `kind` ("text/markdown", "image/png", "stream") in cell order."""
    found = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if kind == "stream" and output.output_type == "stream":
                found.append(output.text)
            elif kind in output.get("data", {}):
                found.append(output.data[kind])
    return found


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jax_cache")


def run_name(m: float, k: int) -> str:
    """The ablation notebook's workdir name of a run of the `smoke` CONFIG, seed 0: the
    CONFIG and SEED are part of it, so another CONFIG never meets these runs."""
    return f"smoke_seed0_m{m:g}_k{k}"


@pytest.fixture(scope="module")
def ablation(tmp_path_factory, cache_dir):
    """(executed notebook, WORKDIR_ROOT) of the ablation notebook at tiny size."""
    root = tmp_path_factory.mktemp("ablation")
    notebook = execute(
        "ablation_m_k.ipynb",
        {
            "CONFIG": "smoke",
            "M_VALUES": (M,),
            "K_VALUES": K_VALUES,
            "STEPS": TINY_STEPS,
            "EVAL_EVERY": 1,
            "SEED": 0,
            "WORKDIR_ROOT": str(root),
            "COMPILATION_CACHE": str(cache_dir),
        },
        cache_dir,
    )
    return notebook, root


@pytest.fixture(scope="module")
def view(ablation) -> RunView:
    """The ablation's k=2 run."""
    return RunView(str(ablation[1] / run_name(M, 2)))


# ------------------------------------------------------------------ the notebooks


def test_the_notebooks_are_stored_without_outputs():
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        nbformat.validate(notebook)
        for cell in notebook.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, path.name
        parameters_cell(notebook)  # exactly one, for tools (and this test) to replace


def test_ablation_notebook_trains_each_m_and_k_plots_and_tabulates(ablation):
    notebook, root = ablation
    for k in K_VALUES:
        summary = RunView(str(root / run_name(M, k))).summary
        assert summary["learner_steps"] == TINY_STEPS
        assert summary["variant"] == f"smoke,steps=2,m={M},k={k},seed=0,eval.every_steps=1"
    assert len(outputs(notebook, "image/png")) == 1  # reward, lag and accuracy against time
    (table,) = outputs(notebook, "text/markdown")
    for k in K_VALUES:
        assert f"| {M:g} | {k} | {TINY_STEPS} |" in table
    printed = "".join(outputs(notebook, "stream"))
    assert f"m={M:g}, k=1: training" in printed
    assert f"step {TINY_STEPS}/{TINY_STEPS} | reward" in printed  # the launcher's progress lines
    assert "Using custom data configuration" not in printed  # libraries' logs left out


def test_ablation_notebook_with_fewer_steps_reads_the_longer_run_back_and_says_so(
    ablation, cache_dir
):
    _, root = ablation
    parameters = dict(CONFIG="smoke", M_VALUES=(M,), K_VALUES=(1,), STEPS=TINY_STEPS - 1, SEED=0)
    notebook = execute(
        "ablation_m_k.ipynb",
        {**parameters, "EVAL_EVERY": 1, "WORKDIR_ROOT": str(root), "COMPILATION_CACHE": ""},
        cache_dir,
    )
    printed = "".join(outputs(notebook, "stream"))
    assert f"holds a run of {TINY_STEPS} learner steps, more than STEPS={TINY_STEPS - 1}" in printed
    assert "training" not in printed
    (table,) = outputs(notebook, "text/markdown")
    assert f"| {M:g} | 1 | {TINY_STEPS} |" in table


def test_inside_a_run_notebook_looks_inside_a_finished_run(ablation, cache_dir):
    # the ablation's k=1 run (training one here, the notebook's default, would cost a run;
    # the ablation notebook trains through the same API)
    workdir = ablation[1] / run_name(M, 1)
    notebook = execute(
        "inside_a_run.ipynb",
        {
            "WORKDIR": str(workdir),
            "TRAIN_VARIANT": "smoke",
            "TRAIN_ROOT": "",
            "NUM_PROMPTS": 2,
            "SAMPLES_PER_PROMPT": 2,
            "TEMPERATURE": 0.7,
            "BATCH_PROMPTS": 2,
        },
        cache_dir,
    )
    printed = "".join(outputs(notebook, "stream"))
    assert f"{workdir}: arithmetic:smoke,steps=2,m={M},k=1" in printed
    assert "checkpoints at steps [0, 2]" in printed
    assert "mean reward: sampled" in printed
    assert "reward=None" in printed  # a prompt of one's own
    assert "drew 2 × 4" in printed.splitlines()[-1]
    assert len(outputs(notebook, "image/png")) == 2  # the metrics; the buffer's histograms
    tables = outputs(notebook, "text/markdown")
    assert len(tables) == 4  # summary, samples, the buffer's prompts, a drawn batch
    assert "| `learner_steps` | 2 |" in tables[0]
    assert len(tables[1].splitlines()) == 2 + 2  # header, rule, one row per prompt
    assert len(tables[-1].splitlines()) == 2 + 2 * 4  # header, rule, B × K rows


# ------------------------------------------------------------------ RunView on a run


def test_run_view_reads_the_config_summary_and_scalars(view):
    assert view.config.replay.recency_prob == M and view.config.sync_period == 2
    assert view.summary["learner_steps"] == TINY_STEPS
    assert view.checkpoint_steps == [0, TINY_STEPS]
    steps, rewards = view.scalar("reward_mean")
    assert steps.tolist() == [1, 2] and rewards.shape == (2,)
    seconds, accuracy = view.against_seconds("eval_accuracy")  # evaluated every step here
    rl_seconds = view.scalar("rl_seconds")[1]
    evaluation_seconds = view.scalar("evaluation_seconds")[1]
    np.testing.assert_allclose(seconds, rl_seconds - np.cumsum(evaluation_seconds))
    assert accuracy.shape == (2,)
    since_first, _ = view.against_seconds("eval_accuracy", since_first_step=True)
    np.testing.assert_allclose(since_first, seconds - seconds[0])
    with pytest.raises(KeyError, match="No scalar 'nope'"):
        view.scalar("nope")


def test_run_view_samples_the_trained_policy_with_rewards(view):
    examples = view.test_examples(view.config.eval.num_examples)
    greedy = view.sample(examples, greedy=True)
    assert [s.prompt for s in greedy] == [example["prompt"] for example in examples]
    rewards = view.task.rewards(examples, [s.response for s in greedy])
    assert [s.reward for s in greedy] == [float(r) for r in rewards]
    # the held-out greedy accuracy the run reported at its end, from the same checkpoint
    assert np.mean([s.reward for s in greedy]) == pytest.approx(view.summary["eval_accuracy_end"])
    sampled = view.sample(2, n=3, temperature=0.5, seed=1)
    assert [s.prompt for s in sampled] == [examples[0]["prompt"]] * 3 + [examples[1]["prompt"]] * 3
    assert [s.response for s in sampled] == [
        s.response for s in view.sample(2, n=3, temperature=0.5, seed=1)
    ]
    assert all(1 <= s.length <= view.config.max_response_len for s in sampled)
    (own,) = view.sample("1+2=", greedy=True, step=0)
    assert own.prompt == "1+2=" and own.reward is None
    with pytest.raises(ValueError, match=r"num=-1 must be >= 0"):  # not all but the last
        view.sample(-1)


def test_run_view_evaluates_as_the_run_and_evaluate_py_do(view):
    metrics = view.evaluate(num_samples=0)  # greedy only: the run's final evaluation
    assert metrics["greedy_pass@1"] == view.summary["eval_accuracy_end"]
    assert metrics["num_problems"] == view.config.eval.num_examples
    assert view.evaluate(0, num_samples=0)["greedy_pass@1"] == view.summary["eval_accuracy_start"]
    with pytest.raises(ConfigError, match=r"num_examples=-1 must be >= 0"):  # not all but one
        view.evaluate(num_examples=-1)


def test_run_view_restores_the_replay_buffer_of_a_checkpoint(view):
    buffer = view.replay_buffer()
    assert len(buffer) > 0 and buffer.num_prompts <= view.config.task.num_train
    assert buffer.recency_prob == M and buffer.draw_rule == view.config.replay.draw_rule
    assert view.checkpoint_metadata()["policy_version"] == TINY_STEPS
    with Checkpointer(
        view.workdir, experiment=runs.stored_experiment(view.workdir)
    ) as checkpointer:
        saved, _ = checkpointer.restore_buffer()
    restored = buffer.state_dict()
    for key in [key for key in saved if key.startswith("traj_")]:
        np.testing.assert_array_equal(restored[key], saved[key], err_msg=key)
    # each call is a fresh copy: drawing from one leaves the next one's draws as they were
    first = buffer.sample(2, 4, np.random.default_rng(0))
    again = view.replay_buffer().sample(2, 4, np.random.default_rng(0))
    np.testing.assert_array_equal(first.response_tokens, again.response_tokens)
    assert first.response_tokens.shape == (8, view.config.max_response_len)
    assert len(view.replay_buffer(step=0)) == 0  # right after the warm start


def test_run_view_refuses_what_is_not_a_run_or_a_checkpoint(view, tmp_path):
    with pytest.raises(FileNotFoundError, match="not the workdir of a tba_jax training run"):
        RunView(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"No checkpoint for step 1 .*\[0, 2\]"):
        view.policy(step=1)
