"""A training run's workdir as Python objects: what the notebooks (experiments/notebooks/)
and any script that looks inside a run read.

    from tba_jax.run_view import RunView

    view = RunView("/tmp/tba_demo")
    view.config, view.summary                 # config.json; summary.json (None until done)
    steps, rewards = view.scalar("reward_mean")
    seconds, rewards = view.against_seconds("reward_mean")   # x: RL wall-clock seconds
    for s in view.sample(4, n=2):             # the first 4 test problems, 2 responses each
        print(s.prompt, s.response, s.reward)
    buffer = view.replay_buffer()             # the latest checkpoint's ReplayBuffer
    view.evaluate(num_samples=0)              # evaluate.py's metrics: {"greedy_pass@1": ...}

Everything is read with the functions the tools use (`runs.load_config`,
`runs.restore_run`, `metrics.read_scalars` and `evaluation_curve`, `tasks.build_task`, the
generators the evaluation uses, `evaluation.evaluate_policy` with `runs.eval_settings`,
`Checkpointer.restore_buffer`,
`sources.make_replay_buffer`), so a view sees what `evaluate.py` and
`experiments/reproduce.py` see.
Checkpoints are restored on the default device, once per step; files (the summary, the
scalars) are read again on every access, so a view of a run in progress stays current.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import jax
import ml_collections
import numpy as np

from tba_jax import evaluation, runs, sources, tasks
from tba_jax.checkpoint import Checkpointer
from tba_jax.metrics import RL_SECONDS, TENSORBOARD_SUBDIR, evaluation_curve, read_scalars
from tba_jax.replay import ReplayBuffer
from tba_jax.sampling.engine import make_generator

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One response of the policy. `reward`: the task's reward of it (as the evaluation
    scores it, without the searchers' non-EOS penalty); None for a bare prompt string,
    which carries nothing to check a response against."""

    prompt: str
    response: str
    reward: float | None
    length: int  # response tokens, EOS included when emitted


class RunView:
    """The run in `workdir` (one `experiments/train.py` or `train_and_evaluate` wrote).

    FileNotFoundError when `workdir` holds no run's config.json.
    """

    def __init__(self, workdir: str):
        self.workdir = os.path.abspath(workdir)
        self.config: ml_collections.ConfigDict = runs.load_config(self.workdir)
        self._policies: dict[int, runs.RestoredRun] = {}
        self._buffers: dict[int, tuple[dict, dict]] = {}
        self._generators: dict[tuple, object] = {}

    def __repr__(self) -> str:
        return f"RunView({self.workdir!r})"

    # ------------------------------------------------------------------ files

    @property
    def summary(self) -> dict | None:
        """summary.json: the whole run's figures; None while the run is unfinished."""
        path = os.path.join(self.workdir, runs.SUMMARY_FILENAME)
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return json.load(f)

    @property
    def scalars(self) -> dict[str, list[tuple[int, float]]]:
        """Every learner step's TensorBoard scalars, {tag: [(step, value), ...]}."""
        event_dir = os.path.join(self.workdir, TENSORBOARD_SUBDIR)
        return read_scalars(event_dir) if os.path.isdir(event_dir) else {}

    @property
    def tags(self) -> list[str]:
        return sorted(self.scalars)

    def scalar(self, tag: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps int64 [n], values float64 [n]) of `tag`, in step order (a step logged
        twice, by a segment resumed from an earlier checkpoint: its last value)."""
        return self._points(self.scalars, tag)

    def _points(self, scalars: dict, tag: str) -> tuple[np.ndarray, np.ndarray]:
        if tag not in scalars:
            raise KeyError(f"No scalar {tag!r} in {self.workdir}; it has {sorted(scalars)}.")
        points = sorted(dict(scalars[tag]).items())
        steps = np.asarray([step for step, _ in points], np.int64)
        return steps, np.asarray([value for _, value in points], np.float64)

    def against_seconds(
        self, tag: str, since_first_step: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """(seconds, values) of `tag`: the RL phase's wall-clock seconds (after the warm
        start; in-loop evaluations left out; a resumed run's segments joined:
        `metrics.evaluation_curve`), or `since_first_step` counted from the end of the
        first learner step, which also holds compiling and the searchers' first fill of the
        buffer (so runs that compiled and runs whose programs came from JAX's compilation
        cache line up)."""
        scalars = self.scalars
        self._points(scalars, tag)  # a KeyError naming the tags there are
        curve = evaluation_curve(scalars, tag)
        seconds = np.asarray([seconds for _, _, seconds in curve], np.float64)
        if since_first_step and len(seconds):
            seconds -= evaluation_curve(scalars, RL_SECONDS)[0][2]
        return seconds, np.asarray([value for _, value, _ in curve], np.float64)

    # ------------------------------------------------------------------ checkpoints

    def _checkpointer(self) -> Checkpointer:
        # the identity the checkpoints were written for: any run's checkpoints open here
        return Checkpointer(self.workdir, experiment=runs.stored_experiment(self.workdir))

    @property
    def checkpoint_steps(self) -> list[int]:
        """The steps with a checkpoint (0: right after the warm start), oldest first."""
        return runs.saved_steps(self.workdir)

    def _read_checkpoint(self, step: int | None, read: Callable[[int], T]) -> T:
        """`read(step)` of the checkpoint of `step` (None: the latest), as
        `runs.read_checkpoint` reads a run in progress: tried again while the run saves and
        removes checkpoints around it; a step removed meanwhile is named as such."""
        return runs.read_checkpoint(self.workdir, step, read)

    def policy(self, step: int | None = None) -> runs.RestoredRun:
        """The checkpoint of `step` (default: the latest): model, params, π_ref, metadata."""
        return self._read_checkpoint(step, self._policy)

    def _policy(self, step: int) -> runs.RestoredRun:
        if step not in self._policies:
            # read once: `_read_checkpoint` tries again
            self._policies[step] = runs.restore_run(self.config, self.workdir, step, attempts=1)
        return self._policies[step]

    def checkpoint_metadata(self, step: int | None = None) -> dict:
        """What the checkpoint of `step` records besides arrays: `policy_version` (the
        version its searchers were sampling with), `data_position`, `seed`, `history`."""
        return self._read_checkpoint(step, self._buffer_checkpoint)[1]

    def replay_buffer(self, step: int | None = None) -> ReplayBuffer | None:
        """A new `ReplayBuffer` holding what the checkpoint of `step` (default: the latest)
        kept: the samples, their order, the sync window and the draw pools, so its draws
        are the ones the run would have made next (each call gives a fresh copy). Built
        from the run's `replay` settings. None for a sync run, which keeps no buffer. A
        multi-process run's buffer is process 0's."""
        state = dict(self._read_checkpoint(step, self._buffer_checkpoint)[0])
        if not state:
            return None
        for key in sources.STREAM_POSITION_KEYS:  # a process's prompt-stream position
            state.pop(key, None)
        buffer = sources.make_replay_buffer(self.config, self.tokenizer.pad_id)
        buffer.load_state_dict(state)
        return buffer

    def _buffer_checkpoint(self, step: int) -> tuple[dict, dict]:
        if step not in self._buffers:
            with self._checkpointer() as checkpointer:
                self._buffers[step] = runs.read_or_unreadable(
                    checkpointer, step, checkpointer.restore_buffer
                )
        return self._buffers[step]

    # ------------------------------------------------------------------ the policy

    @functools.cached_property
    def task(self) -> tasks.Task:
        """The run's task (data, tokenizer, rewards), built as `evaluate.py` builds it."""
        return tasks.build_task(
            self.config.task,
            self.workdir,
            tokenizer=runs.policy_tokenizer(self.config),
            engine=sources.evaluation_engine_config(self.config),
        )

    @property
    def tokenizer(self):
        return self.task.tokenizer

    def decode(self, tokens) -> str:
        """Text of token ids (stops at EOS; padding skipped)."""
        return self.tokenizer.decode(np.asarray(tokens).tolist())

    def test_examples(self, num: int | None = None) -> list[dict]:
        """The first `num` (None: all) examples of the task's test split."""
        if num is not None and num < 0:  # as a slice's end it would leave out the last ones
            raise ValueError(f"num={num} must be >= 0 (None: all).")
        return list(self.task.test[:num])

    def evaluate(self, step: int | None = None, **settings) -> dict:
        """The task's held-out metrics of the policy at checkpoint `step` (default: the
        latest), as `experiments/evaluate.py` computes them: greedy pass@1 and sampled
        pass@k (or the task's own, e.g. TL;DR's win rate), with the run's evaluation
        settings and `settings` in place of theirs (max_new_tokens, num_examples,
        num_samples, ks: `view.evaluate(num_samples=0)` is greedy only)."""
        chosen = runs.eval_settings(self.config, settings)
        evaluation.check_settings(chosen)
        run = self.policy(step)
        return evaluation.evaluate_policy(
            run.model, run.params, self.task, chosen, reference_params=run.reference_params
        )

    def sample(
        self,
        examples: int | Sequence[dict | str] = 4,
        *,
        n: int = 1,
        temperature: float | None = None,
        greedy: bool = False,
        step: int | None = None,
        seed: int = 0,
    ) -> list[Sample]:
        """`n` responses of the policy at checkpoint `step` (default: the latest) to each of
        `examples`: the first that many test examples (an int), test examples (dicts with
        `prompt` and what the reward reads), or bare prompt strings (no reward; one string
        is one prompt). Drawn at
        `temperature` (default: the run's `sampling.temperature`, with its top-k / top-p),
        or greedily; `seed` picks the draws. Returned example by example, n in a row."""
        if isinstance(examples, int):
            examples = self.test_examples(examples)
        elif isinstance(examples, str):
            examples = [examples]
        if n < 1:
            raise ValueError(f"n={n} must be >= 1.")
        rows = [
            (example, True) if isinstance(example, Mapping) else ({"prompt": example}, False)
            for example in examples
            for _ in range(n)
        ]
        run = self.policy(step)
        batches = evaluation.generated_responses(
            self._generator(run.model, temperature, greedy),
            run.params,
            [example for example, _ in rows],
            self.tokenizer,
            max_prompt_len=self.config.max_prompt_len,
            batch_size=self.config.eval.batch_size,
            rng=jax.random.key(seed),
        )
        samples, start = [], 0
        for batch_examples, texts, lengths in batches:
            scored = [i for i in range(len(texts)) if rows[start + i][1]]
            rewards = [None] * len(texts)
            if scored:
                values = self.task.rewards(
                    [batch_examples[i] for i in scored], [texts[i] for i in scored]
                )
                for i, value in zip(scored, values, strict=True):
                    rewards[i] = float(value)
            samples.extend(
                Sample(example["prompt"], text, reward, int(length))
                for example, text, reward, length in zip(
                    batch_examples, texts, rewards, lengths, strict=True
                )
            )
            start += len(texts)
        return samples

    def _generator(self, model, temperature: float | None, greedy: bool):
        """The evaluation's generator of `model` (batches, or the slot engine the run
        searched with) for these settings; one per setting and model config (the policy's
        architecture is the same at every step, its params layout may not be: a run can
        switch `model.scan_layers`), so repeated calls compile once."""
        temperature = None if greedy or temperature is None else float(temperature)
        key = (model.config, temperature, greedy)
        if key not in self._generators:
            sampling = sources.sampling_config(self.config, self.tokenizer.vocab_size, greedy)
            if temperature is not None:
                sampling = dataclasses.replace(sampling, temperature=temperature)
            self._generators[key] = make_generator(
                model,
                sampling,
                eos_id=self.tokenizer.eos_id,
                pad_id=self.tokenizer.pad_id,
                max_prompt_len=self.config.max_prompt_len,
                engine=sources.evaluation_engine_config(self.config),
            )
        return self._generators[key]
