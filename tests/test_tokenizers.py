"""CharTokenizer and the Tokenizer protocol."""

import json

import numpy as np
import pytest

from tba_jax.models.tokenizers import (
    CharTokenizer,
    Tokenizer,
    pad_sequences,
    pad_sequences_with_mask,
)


@pytest.fixture
def tokenizer() -> CharTokenizer:
    return CharTokenizer.for_arithmetic("+-")


def test_special_ids_and_vocab_layout(tokenizer):
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2)
    assert tokenizer.alphabet == "0123456789+-=,>"
    assert tokenizer.vocab_size == 3 + len("0123456789+-=,>")
    assert tokenizer.encode("0") == [3]
    assert tokenizer.encode(">") == [tokenizer.vocab_size - 1]
    assert isinstance(tokenizer, Tokenizer)


def test_encode_decode_round_trip(tokenizer):
    text = "23+45-7=68,61>61"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode("") == []
    assert tokenizer.decode([]) == ""


def test_special_tokens_are_added_on_request_and_skipped_on_decode(tokenizer):
    ids = tokenizer.encode("1+2", add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id
    assert ids[-1] == tokenizer.eos_id
    assert tokenizer.decode(ids) == "1+2"
    assert tokenizer.decode([0, 0, 1, *tokenizer.encode("12"), 0]) == "12"


def test_decode_stops_at_the_first_eos(tokenizer):
    ids = [*tokenizer.encode("3>3"), tokenizer.eos_id, *tokenizer.encode("99")]
    assert tokenizer.decode(ids) == "3>3"
    assert tokenizer.decode(np.asarray(ids, dtype=np.int32)) == "3>3"


def test_encode_batch_right_padding_layout(tokenizer):
    batch = tokenizer.encode_batch(["12", "3", ""], max_len=4, left_pad=False)
    one, two, three = tokenizer.encode("123")
    assert batch.dtype == np.int32
    np.testing.assert_array_equal(batch, [[one, two, 0, 0], [three, 0, 0, 0], [0, 0, 0, 0]])


def test_encode_batch_left_padding_layout_and_special_tokens(tokenizer):
    batch = tokenizer.encode_batch(["12", "3"], max_len=4, left_pad=True, add_bos=True)
    one, two, three = tokenizer.encode("123")
    np.testing.assert_array_equal(batch, [[0, 1, one, two], [0, 0, 1, three]])
    assert tokenizer.decode_batch(batch) == ["12", "3"]


def test_decode_batch_handles_eos_and_padding_per_row(tokenizer):
    texts = ["7+8=15>15", "1-1=0>0"]
    batch = tokenizer.encode_batch(texts, max_len=12, left_pad=False, add_eos=True)
    assert tokenizer.decode_batch(batch) == texts
    assert tokenizer.decode_batch([]) == []


def test_text_longer_than_max_len_is_an_error_naming_both_lengths(tokenizer):
    with pytest.raises(ValueError, match=r"'12345' is 5 tokens long but max_len=4"):
        tokenizer.encode_batch(["1", "12345"], max_len=4, left_pad=True)
    with pytest.raises(ValueError, match="max_len=3"):
        tokenizer.encode_batch(["123"], max_len=3, left_pad=True, add_eos=True)


def test_unknown_character_is_an_error_naming_it(tokenizer):
    with pytest.raises(ValueError, match=r"Character '\*' in '2\*3'"):
        tokenizer.encode("2*3")
    assert CharTokenizer.for_arithmetic("+-*").decode(
        CharTokenizer.for_arithmetic("+-*").encode("2*3")
    ) == "2*3"  # fmt: skip


def test_out_of_vocabulary_id_is_an_error(tokenizer):
    with pytest.raises(ValueError, match=f"Token id {tokenizer.vocab_size} is outside"):
        tokenizer.decode([3, tokenizer.vocab_size])


@pytest.mark.parametrize(
    "alphabet, message", [("", "needs a non-empty alphabet"), ("abca", "repeats 'a'")]
)
def test_invalid_alphabets_are_rejected(alphabet, message):
    with pytest.raises(ValueError, match=message):
        CharTokenizer(alphabet)


def test_dict_round_trip_is_json_serialisable(tokenizer):
    description = json.loads(json.dumps(tokenizer.to_dict()))
    restored = CharTokenizer.from_dict(description)
    assert restored == tokenizer
    assert restored.encode("9>9") == tokenizer.encode("9>9")
    with pytest.raises(ValueError, match="does not describe a CharTokenizer"):
        CharTokenizer.from_dict({"type": "huggingface", "name": "gpt2"})


def test_pad_sequences_names_the_row_without_texts():
    with pytest.raises(ValueError, match="Sequence 1 is 3 tokens long"):
        pad_sequences([[5], [5, 6, 7]], max_len=2, pad_id=0, left_pad=False)


def test_prompt_mask_comes_from_lengths_not_from_the_pad_id():
    """A prompt may hold the pad id as real text (tokenizers without a pad token pad
    with EOS, which chat templates also use): the mask must still cover it."""
    pad = 2
    tokens, mask = pad_sequences_with_mask([[5, pad, 6], [pad]], 4, pad_id=pad, left_pad=True)
    np.testing.assert_array_equal(tokens, [[pad, 5, pad, 6], [pad, pad, pad, pad]])
    np.testing.assert_array_equal(mask, [[False, True, True, True], [False, False, False, True]])
    right, right_mask = pad_sequences_with_mask([[7, 8]], 3, pad_id=pad, left_pad=False)
    np.testing.assert_array_equal(right, [[7, 8, pad]])
    np.testing.assert_array_equal(right_mask, [[True, True, False]])
    tokenizer = CharTokenizer("ab")
    prompts, prompt_mask = tokenizer.encode_prompts(["ab", "b"], 3)
    np.testing.assert_array_equal(prompts, tokenizer.encode_batch(["ab", "b"], 3, left_pad=True))
    np.testing.assert_array_equal(prompt_mask, [[False, True, True], [False, False, True]])
