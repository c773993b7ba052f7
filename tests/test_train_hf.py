"""The main job started from a Hugging Face folder: policy, reference and tokenizer from it."""

import jax
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from support import save_tiny_llama_folder  # noqa: E402

from configs.arithmetic import get_config  # noqa: E402
from experiments.export_hf import export_run  # noqa: E402
from tba_jax.data import arithmetic  # noqa: E402
from tba_jax.models import hf  # noqa: E402
from tba_jax.runs import restore_policy  # noqa: E402
from tba_jax.train import train_and_evaluate  # noqa: E402

ARITHMETIC_CORPUS_SIZE = 300
TOKENIZER_VOCAB_SIZE = 80
MAX_POSITIONS = 64


def arithmetic_corpus() -> list[str]:
    """Prompts and solutions of the arithmetic task, to train the test tokenizer on."""
    splits = arithmetic.generate_splits(
        arithmetic.ArithmeticTaskConfig(
            max_operand=9, max_result=20, num_train=ARITHMETIC_CORPUS_SIZE, num_test=20
        )
    )
    return [ex["prompt"] + ex["solution"] for ex in splits["train"]]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return save_tiny_llama_folder(
        tmp_path_factory.mktemp("hf_llama"),
        arithmetic_corpus(),
        vocab_size=TOKENIZER_VOCAB_SIZE,
        max_position_embeddings=MAX_POSITIONS,
    )


def test_main_job_trains_from_a_hugging_face_folder(hf_folder, tmp_path):
    variant = (
        f"smoke,hf_path={hf_folder},reference.hf_path={hf_folder},"
        "warm_start.steps=0,keep_checkpoints=10"
    )
    summary = train_and_evaluate(get_config(variant), str(tmp_path))
    assert summary["learner_steps"] == 4
    assert summary["samples_generated"] > 0

    # With no warm start the starting policy (checkpoint step 0) is exactly the folder's weights.
    _, start_params, _ = restore_policy(get_config(variant), str(tmp_path), step=0)
    model, _ = hf.load_model(hf_folder)
    imported = hf.load_params(hf_folder, model)
    for a, b in zip(jax.tree.leaves(start_params), jax.tree.leaves(imported), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_trained_run_exports_to_a_folder_transformers_loads(hf_folder, tmp_path):
    torch = pytest.importorskip("torch")
    workdir, out = str(tmp_path / "run"), str(tmp_path / "exported")
    train_and_evaluate(get_config(f"smoke,hf_path={hf_folder},warm_start.steps=2"), workdir)
    export_run(workdir, out)

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert exported.config.eos_token_id == tokenizer.eos_token_id
    tokens = np.asarray([tokenizer("7+5=")["input_ids"]], np.int32)
    with torch.no_grad():
        theirs = exported(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    model, params, _ = restore_policy(get_config(f"smoke,hf_path={hf_folder}"), workdir)
    valid = np.ones_like(tokens, bool)
    ours, _ = model.apply(params, tokens, np.cumsum(valid, axis=1) - 1, valid)
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4)


def test_a_checkpoint_whose_learned_positions_cannot_hold_a_response_is_refused_first(tmp_path):
    """GPT-2's learned position table (here 16) must hold a prompt and its response (the
    demo's 10 + 12): one line from its config.json before any work (until 2026-11-29 the
    warm start's loss was NaN and the run ended in a traceback)."""
    from tba_jax.config_lib import ConfigError
    from tba_jax.train import check_policy_architecture

    folder = tmp_path / "gpt2"
    for positions in (16, 22):
        transformers.GPT2Config(
            vocab_size=64, n_positions=positions, n_embd=32, n_layer=1, n_head=2
        ).save_pretrained(folder)
        config = get_config(f"hf_path={folder}")
        if positions == 16:
            with pytest.raises(ConfigError, match=r"has 16 learned positions, fewer than a"):
                check_policy_architecture(config)
        else:
            check_policy_architecture(config)
