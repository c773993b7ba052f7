"""RewardModel (tba_jax/rewards/reward_model.py): what it encodes, its buckets, and its scores
against transformers' GPTNeoXForSequenceClassification on the same texts."""

import numpy as np
import pytest
from support import save_tiny_llama_folder

from tba_jax.models import init_model, preset
from tba_jax.models.frozen import FrozenModel, load_frozen_model, role_attention
from tba_jax.models.tokenizers import CharTokenizer
from tba_jax.rewards.reward_model import (
    RewardModel,
    bucket_for,
    bucket_lengths,
    encode_scored_text,
    reward_model_role_config,
)

TOL = 1e-4
WEIGHT_STD = 0.2  # transformers' init zeroes biases and sets norms to 1: redraw everything
PROMPTS = [
    "SUBREDDIT: r/pets\n\nTITLE: Cat\n\nPOST: My cat ignores the new food.\n\nTL;DR:",
    "SUBREDDIT: r/cooking\n\nTITLE: Rice burns again and again at the bottom of the pot\n\n"
    "POST: I tried to cook rice three times this week and it always burns.\n\nTL;DR:",
    "SUBREDDIT: r/books\n\nTITLE: Next?\n\nPOST: Which book next?\n\nTL;DR:",
    "SUBREDDIT: r/travel\n\nTITLE: Passport\n\nPOST: I lost my passport.\n\nTL;DR:",
    "SUBREDDIT: r/cars\n\nTITLE: Noise\n\nPOST: Clicking when I turn left.\n\nTL;DR:",
]
RESPONSES = [" cat refuses food", " rice burns", " book advice", " lost passport", " car clicks"]


class BosCharTokenizer(CharTokenizer):
    """A char tokenizer that, like Llama's, puts BOS before every text by default."""

    def encode(self, text, *, add_bos=None, add_eos=None):
        return super().encode(text, add_bos=True if add_bos is None else add_bos, add_eos=add_eos)


# ----------------------------------------------------------------------------- encoding


def test_encoding_is_prefix_prompt_response_eos():
    tokenizer = BosCharTokenizer("abcdefgh ")
    ids = encode_scored_text(tokenizer, "abc", " de", max_len=20, append_eos=True)
    prompt, response = (
        tokenizer.encode("abc", add_bos=False),
        tokenizer.encode(" de", add_bos=False),
    )
    assert ids == [tokenizer.bos_id, *prompt, *response, tokenizer.eos_id]
    plain = CharTokenizer("abcdefgh ")  # no BOS by default: no prefix
    assert encode_scored_text(plain, "abc", "d", max_len=20, append_eos=False) == plain.encode(
        "abcd"
    )


def test_long_prompts_lose_tokens_from_the_left_and_keep_the_response():
    tokenizer = BosCharTokenizer("abcdefgh ")
    # 1 BOS + 3 response + 1 EOS leave 3 of the prompt's 8 characters.
    ids = encode_scored_text(tokenizer, "abcdefgh", " ab", max_len=8, append_eos=True)
    assert tokenizer.decode(ids) == "fgh ab" and ids[0] == tokenizer.bos_id
    assert ids[-1] == tokenizer.eos_id and len(ids) == 8
    exact = encode_scored_text(tokenizer, "abcdefgh", " ab", max_len=5, append_eos=True)
    assert tokenizer.decode(exact) == " ab"  # no room for the prompt at all
    with pytest.raises(ValueError, match="raise max_len"):
        encode_scored_text(tokenizer, "abc", " abcd", max_len=5, append_eos=True)


def test_buckets_double_up_to_max_len():
    assert bucket_lengths(300, 64) == [64, 128, 256, 300]
    assert bucket_lengths(64, 64) == [64] and bucket_lengths(10, 64) == [10]
    assert [bucket_for(n, [64, 128, 300]) for n in (1, 64, 65, 300)] == [64, 64, 128, 300]
    with pytest.raises(ValueError, match="longer than every bucket"):
        bucket_for(301, [64, 128, 300])


def test_a_classifier_with_two_labels_or_an_lm_head_is_refused():
    tokenizer = CharTokenizer.for_text()
    for head, labels in (("score", 2), ("lm", 1)):
        cfg = preset("micro", vocab_size=tokenizer.vocab_size, head=head, num_labels=labels)
        model, params = init_model(cfg, 0)
        with pytest.raises(ValueError, match="num_labels=1"):
            RewardModel(FrozenModel(model, params, tokenizer, "test"), batch_size=2, max_len=64)


# -------------------------------------------------------------- against transformers


@pytest.fixture(scope="module")
def neox_reward_folder(tmp_path_factory):
    """A tiny random GPTNeoXForSequenceClassification (one label) with a BPE tokenizer whose
    pad id differs from EOS, in Hugging Face layout."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    base = tmp_path_factory.mktemp("rm")
    tokenizer_source = save_tiny_llama_folder(
        base / "tokenizer", PROMPTS + RESPONSES, vocab_size=300, max_position_embeddings=64
    )
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_source)
    config = transformers.GPTNeoXConfig(
        vocab_size=len(hf_tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        rotary_pct=0.25,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=hf_tokenizer.pad_token_id,
        eos_token_id=hf_tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = transformers.GPTNeoXForSequenceClassification(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, WEIGHT_STD)
    folder = base / "neox_rm"
    model.save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    return str(folder)


def transformers_scores(folder: str, prompts, responses, max_len: int) -> np.ndarray:
    """Each pair alone (no padding) through transformers: prompt and response tokenized by
    transformers' tokenizer, then EOS, the oldest tokens dropped beyond max_len."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        folder, dtype=torch.float32
    ).eval()
    scores = []
    for prompt, response in zip(prompts, responses, strict=True):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids += tokenizer(response, add_special_tokens=False)["input_ids"]
        ids = [*ids, tokenizer.eos_token_id][-max_len:]
        with torch.no_grad():
            scores.append(model(torch.tensor([ids])).logits[0, 0].item())
    return np.asarray(scores)


@pytest.mark.parametrize(
    "max_len, attention", [(256, "einsum"), (24, "einsum"), (256, "dot_product")]
)  # 24: most prompts lose their start
def test_scores_equal_transformers_on_the_same_texts(neox_reward_folder, max_len, attention):
    role = reward_model_role_config()
    role.hf_path, role.attention = neox_reward_folder, attention
    frozen = load_frozen_model(
        role,
        role_name="reward_model",
        fallback_tokenizer=CharTokenizer.for_text(),
        max_seq_len=max_len,
        head="score",
    )
    assert frozen.model.config.attention == attention
    # Batches of 2 over 5 pairs (the last one filled up), buckets 16, 32, ... up to max_len.
    reward_model = RewardModel(frozen, batch_size=2, max_len=max_len, min_bucket_len=16)
    ours = reward_model.scores(PROMPTS, RESPONSES)
    theirs = transformers_scores(neox_reward_folder, PROMPTS, RESPONSES, max_len)
    assert ours.dtype == np.float32 and ours.shape == (5,)
    np.testing.assert_allclose(ours, theirs, atol=TOL)
    assert np.ptp(theirs) > 10 * TOL  # the pairs score differently: the check has teeth
    # The Task.rewards contract: examples carry the prompts.
    examples = [{"id": i, "prompt": prompt} for i, prompt in enumerate(PROMPTS)]
    np.testing.assert_array_equal(reward_model(examples, RESPONSES), ours)


def test_a_roles_gpu_only_kernel_is_read_elsewhere_as_the_same_attention(caplog):
    role = reward_model_role_config(preset_name="micro", dtype="bfloat16")
    role.attention = "cudnn"
    assert role_attention(role, "task.reward_model", backend="gpu") == "cudnn"
    with caplog.at_level("WARNING"):
        frozen = load_frozen_model(
            role,
            role_name="task.reward_model",
            fallback_tokenizer=CharTokenizer.for_text(),
            max_seq_len=32,
            head="score",
        )
    assert frozen.model.config.attention == "dot_product"
    assert "task.reward_model.attention=cudnn needs a GPU" in caplog.text


def test_from_config_builds_a_random_stand_in_with_the_policy_tokenizer():
    role = reward_model_role_config(preset_name="micro", seed=3, batch_size=4, max_len=128)
    tokenizer = CharTokenizer.for_text()
    reward_model = RewardModel.from_config(
        role, role_name="task.reward_model", fallback_tokenizer=tokenizer
    )
    assert reward_model.tokenizer is tokenizer and reward_model.source == "preset:micro:seed=3"
    scores = reward_model.scores(["ab", "abc"], [" x", " y"])
    assert scores.shape == (2,) and np.all(np.isfinite(scores)) and scores[0] != scores[1]
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        reward_model.scores(["ab", "abc"], [" x"])
