"""Helpers shared by several test files (not collected: the name has no test_ prefix)."""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from tba_jax.launch import with_xla_flags
from tba_jax.models import ModelConfig
from tba_jax.trajectories import Trajectory


def fake_cpu_devices_env(count: int) -> dict[str, str]:
    """This process's environment for a subprocess that sees `count` fake CPU devices: the
    session's XLA_FLAGS (conftest.py's) with the device count added, and JAX on the CPU."""
    device_count = f"--xla_force_host_platform_device_count={count}"
    flags = with_xla_flags(os.environ.get("XLA_FLAGS", ""), [device_count])
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


# jax.monitoring's duration events: tracing a function into a jaxpr, compiling a program.
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def recorded_durations(event: str):
    """Yields a list that collects the seconds of every `event` JAX reports inside the
    block (a trace, a compile: `TRACE_EVENT`, `BACKEND_COMPILE_EVENT`)."""
    durations = []

    def listener(name: str, duration: float, **kwargs) -> None:
        if name == event:
            durations.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield durations
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


# The GSM8K files of the shared folder beside the repository (as in CI's checkout).
REPO_ROOT = Path(__file__).resolve().parents[1]
GSM8K_DIR = REPO_ROOT.parent / "shared" / "data" / "gsm8k"
requires_gsm8k = pytest.mark.skipif(
    not all((GSM8K_DIR / name).is_file() for name in ("train.jsonl", "test.jsonl")),
    reason=f"the GSM8K files (train.jsonl, test.jsonl) are not in {GSM8K_DIR}",
)


def run_repo_script(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """`python <script> <args>` (a path relative to the repository, e.g. a benchmark) from
    the repository root with it on PYTHONPATH, as the README runs it; stdout and stderr
    captured as text."""
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / script), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        cwd=REPO_ROOT,
        timeout=timeout,
    )


# Python source that hides TensorFlow from every import finder: afterwards `import tensorflow`
# raises ModuleNotFoundError and find_spec returns None, exactly as if it were not installed.
# Prepend it to a script run in a subprocess to prove code works without TensorFlow.
HIDE_TENSORFLOW = textwrap.dedent(
    """
    import importlib.util, json, sys

    class HideTensorFlow:
        def __init__(self, finder):
            self._finder = finder

        def find_spec(self, name, path=None, target=None):
            if name == "tensorflow" or name.startswith("tensorflow."):
                return None
            return self._finder.find_spec(name, path, target)

        def __getattr__(self, attribute):
            return getattr(self._finder, attribute)

    sys.meta_path[:] = [HideTensorFlow(finder) for finder in sys.meta_path]
    assert importlib.util.find_spec("tensorflow") is None
    """
)


SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}


def save_tiny_llama_folder(
    folder, corpus: list[str], *, vocab_size: int, max_position_embeddings: int
) -> str:
    """Saves a small random Llama and a byte-level BPE tokenizer trained on `corpus` to
    `folder` in Hugging Face layout (what a user's local checkpoint folder looks like)."""
    import tokenizers
    import transformers

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, **SPECIAL_TOKENS)
    fast.save_pretrained(folder)
    config = transformers.LlamaConfig(
        vocab_size=len(fast),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=fast.pad_token_id,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


# A small decoder for the sampling tests: 2 layers, grouped-query attention (4 query heads
# over 2 key/value heads), a 24-token vocabulary.
SMALL_DECODER = ModelConfig(
    vocab_size=24,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    d_ff=64,
    max_seq_len=32,
    init_std=0.3,
)


def sampled_micro_batch(prompt_tokens, *, max_new_tokens: int, temperature: float, seed: int = 0):
    """A random micro policy (vocabulary 12) and a batch of its own samples for
    `prompt_tokens` (0: left padding), scored by a second random model as π_ref: the
    learner's batch fields, summed and per token. Returns (model, params, batch)."""
    import jax
    import numpy as np

    from tba_jax.models import init_model, preset
    from tba_jax.sampling.generate import SamplingConfig, make_generate_fn
    from tba_jax.sampling.scoring import make_score_fn

    cfg = preset("micro", vocab_size=12, init_std=0.3)
    model, params = init_model(cfg, seed=seed)
    prompt_mask = prompt_tokens != 0
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature)
    gen = make_generate_fn(model, sampling, eos_id=2, pad_id=0)(
        params, prompt_tokens, prompt_mask, jax.random.key(seed + 1)
    )
    _, ref_params = init_model(cfg, seed=seed + 1)
    token_logp_ref = make_score_fn(model, temperature=temperature)(
        ref_params, prompt_tokens, prompt_mask, gen.tokens, gen.mask
    )
    rewards = np.random.default_rng(seed).integers(0, 2, size=len(prompt_tokens))
    batch = {
        "prompt_tokens": prompt_tokens,
        "prompt_mask": prompt_mask,
        "response_tokens": np.asarray(gen.tokens),
        "response_mask": np.asarray(gen.mask),
        "reward": rewards.astype(np.float32),
        "logp_ref": np.asarray(token_logp_ref.sum(-1)),
        "logp_behaviour": np.asarray(gen.token_logp.sum(-1)),
        "token_logp_ref": np.asarray(token_logp_ref),
        "token_logp_behaviour": np.asarray(gen.token_logp),
    }
    return model, params, batch


def rewarded_preference(model, params, batch, temperature: float) -> float:
    """Mean summed log-prob of a batch's rewarded responses minus that of the others: how
    much `params` prefer what was rewarded."""
    import jax
    import numpy as np

    from tba_jax import learner

    # jitted: op by op, the model's forward is a hundred small programs to compile
    logp_of = jax.jit(lambda p, b: learner.sequence_logp(model, p, b, temperature))
    logp = np.asarray(logp_of(params, batch))
    rewarded = batch["reward"] > 0
    return float(logp[rewarded].mean() - logp[~rewarded].mean())


def sigterm_in_step(patch, module, factory: str, step_index: int) -> None:
    """Makes the step functions `module.<factory>` builds send SIGTERM to this process at
    the start of their call number `step_index` (from 0), as a preemption arriving during
    that step would. `patch`: a pytest monkeypatch (or its context)."""
    original = getattr(module, factory)

    def preempted_factory(*args, **kwargs):
        step_fn, calls = original(*args, **kwargs), []

        def step(*step_args):
            if len(calls) == step_index:
                os.kill(os.getpid(), signal.SIGTERM)
            calls.append(1)
            return step_fn(*step_args)

        return step

    patch.setattr(module, factory, preempted_factory)


def hand_made_trajectory(
    prompt_tokens: np.ndarray, response_tokens: np.ndarray, reward: float, prompt_id: int = 0
) -> Trajectory:
    """A search result made by hand: `response_tokens` (EOS included) to `prompt_tokens`
    with `reward`, zero behaviour and π_ref log-probs, generated by policy version 0."""
    zeros = np.zeros(len(response_tokens), np.float32)
    return Trajectory(
        prompt_id=prompt_id,
        prompt_tokens=np.asarray(prompt_tokens, np.int32),
        response_tokens=np.asarray(response_tokens, np.int32),
        reward=reward,
        logp_behaviour=0.0,
        logp_ref=0.0,
        token_logp_behaviour=zeros,
        token_logp_ref=zeros.copy(),
        policy_version=0,
        created_at=0.0,
    )
