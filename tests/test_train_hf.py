"""The main job started from a Hugging Face folder: policy, reference and tokenizer from it."""

import jax
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from configs.arithmetic import get_config  # noqa: E402
from tba_jax.data import arithmetic  # noqa: E402
from tba_jax.models import hf  # noqa: E402
from tba_jax.train import restore_policy, train_and_evaluate  # noqa: E402

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]


def _train_arithmetic_tokenizer() -> tokenizers.Tokenizer:
    """A small BPE tokenizer that covers the arithmetic task's prompts and solutions."""
    splits = arithmetic.generate_splits(
        arithmetic.ArithmeticTaskConfig(max_operand=9, max_result=20, num_train=300, num_test=20)
    )
    corpus = [ex["prompt"] + ex["solution"] for ex in splits["train"]]
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=80,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_llama")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_train_arithmetic_tokenizer(),
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )
    fast.save_pretrained(folder)
    config = transformers.LlamaConfig(
        vocab_size=len(fast),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=fast.pad_token_id,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


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
    hf.export_run(workdir, out)

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
