"""HFTokenizer: Hugging Face checkpoint tokenizers trained here and saved in HF layout."""

import json
import pathlib

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")
sentencepiece = pytest.importorskip("sentencepiece")
transformers = pytest.importorskip("transformers")

from tba_jax.models.hf_tokenizer import HFTokenizer, check_vocab_matches  # noqa: E402
from tba_jax.models.tokenizers import Tokenizer  # noqa: E402

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, héllo wörld, 你好世界",
    "pack my box with five dozen liquor jugs",
    "sphinx of black quartz, judge my vow",
    "  indented line\twith a tab\nand a newline",
]
PAD, BOS, EOS, END_OF_TURN = "<pad>", "<s>", "</s>", "<|eot|>"
BPE_VOCAB_SIZE = 300
SENTENCEPIECE_VOCAB_SIZE = 100

# Unicode the corpus never saw, runs of spaces, tabs, newlines, the empty text.
TEXTS = [
    "hello world",
    "héllo wörld 你好 🙂 ünseen",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n",
    "",
    "the quick brown fox, twice: the quick brown fox",
]


def write_json(path: pathlib.Path, content) -> None:
    path.write_text(json.dumps(content), encoding="utf-8")


def update_json(path: pathlib.Path, **changes) -> None:
    write_json(path, {**json.loads(path.read_text(encoding="utf-8")), **changes})


@pytest.fixture(scope="module")
def byte_level_bpe():
    """A byte-level BPE whose post-processor puts BOS before every text."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        special_tokens=[PAD, BOS, EOS, END_OF_TURN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return tokenizer


def save_bpe_checkpoint(byte_level_bpe, folder: pathlib.Path, **special_tokens) -> pathlib.Path:
    fresh_copy = tokenizers.Tokenizer.from_str(byte_level_bpe.to_str())
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=fresh_copy, **special_tokens)
    wrapped.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def bpe_folder(byte_level_bpe, tmp_path_factory):
    folder = tmp_path_factory.mktemp("bpe")
    return save_bpe_checkpoint(byte_level_bpe, folder, bos_token=BOS, eos_token=EOS, pad_token=PAD)


@pytest.fixture
def fresh_bpe_folder(byte_level_bpe, tmp_path):
    """A BPE checkpoint without a pad token, for tests that edit its files."""
    return save_bpe_checkpoint(byte_level_bpe, tmp_path, bos_token=BOS, eos_token=EOS)


@pytest.fixture(scope="module")
def ours(bpe_folder):
    return HFTokenizer.from_pretrained(bpe_folder)


@pytest.fixture(scope="module")
def reference(bpe_folder):
    return transformers.AutoTokenizer.from_pretrained(str(bpe_folder))


def test_is_a_tokenizer(ours):
    assert isinstance(ours, Tokenizer)


def test_bpe_encode_decode_agree_with_transformers(ours, reference):
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ours.encode(text, add_bos=False) == reference.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True) == text


def test_bpe_special_ids_and_vocab_match_transformers(ours, reference, byte_level_bpe):
    assert ours.bos_id == reference.bos_token_id == byte_level_bpe.token_to_id(BOS)
    assert ours.eos_id == reference.eos_token_id == byte_level_bpe.token_to_id(EOS)
    assert ours.eos_ids == (ours.eos_id,)
    assert ours.pad_id == reference.pad_token_id == byte_level_bpe.token_to_id(PAD)
    assert ours.vocab_size == len(reference) == byte_level_bpe.get_vocab_size()
    assert ours.adds_bos_by_default and not ours.adds_eos_by_default


def test_explicit_add_bos_and_add_eos_override_the_checkpoint(ours):
    plain = ours.encode("hello world", add_bos=False)
    assert ours.bos_id not in plain
    assert ours.encode("hello world", add_eos=True) == [ours.bos_id, *plain, ours.eos_id]
    assert ours.encode("hello world", add_bos=False, add_eos=True) == [*plain, ours.eos_id]


def test_left_and_right_padded_batches(ours):
    texts = ["hello", "hello world, héllo"]
    lengths = [len(ours.encode(t)) for t in texts]
    max_len = max(lengths) + 2
    left = ours.encode_batch(texts, max_len, left_pad=True)
    right = ours.encode_batch(texts, max_len, left_pad=False)
    assert left.shape == right.shape == (len(texts), max_len)
    assert left.dtype == right.dtype == np.int32
    for row, (text, length) in enumerate(zip(texts, lengths, strict=True)):
        assert left[row, max_len - length :].tolist() == ours.encode(text)
        assert (left[row, : max_len - length] == ours.pad_id).all()
        assert right[row, :length].tolist() == ours.encode(text)
        assert (right[row, length:] == ours.pad_id).all()
    assert ours.decode_batch(left) == ours.decode_batch(right) == texts
    with pytest.raises(ValueError, match="max_len"):
        ours.encode_batch(texts, max(lengths) - 1, left_pad=True)


def test_decode_stops_at_eos_and_skips_special_tokens(ours, byte_level_bpe):
    hello, world = ours.encode("hello"), ours.encode(" world", add_bos=False)
    end_of_turn = byte_level_bpe.token_to_id(END_OF_TURN)
    assert ours.decode([*hello, ours.eos_id, *world]) == "hello"
    assert ours.decode([*hello, end_of_turn, ours.pad_id, *world]) == "hello world"
    assert ours.decode([ours.eos_id, *world]) == ""


def test_decode_rejects_ids_outside_the_vocabulary(ours):
    with pytest.raises(ValueError, match=rf"{ours.vocab_size}.*mask logits"):
        ours.decode([ours.vocab_size])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ours.decode([-1])


def test_checkpoint_without_pad_token_pads_with_eos(fresh_bpe_folder):
    tokenizer = HFTokenizer.from_pretrained(fresh_bpe_folder)
    assert transformers.AutoTokenizer.from_pretrained(str(fresh_bpe_folder)).pad_token is None
    assert tokenizer.pad_id == tokenizer.eos_id
    texts = ["hi", "hello world"]
    prompts = tokenizer.encode_batch(texts, 12, left_pad=True, add_bos=False)
    assert prompts[0, 0] == tokenizer.eos_id
    assert tokenizer.decode_batch(prompts) == texts
    response = [*tokenizer.encode("hello", add_bos=False), tokenizer.eos_id, tokenizer.pad_id]
    assert tokenizer.decode(response) == "hello"
    assert tokenizer.decode([tokenizer.eos_id, tokenizer.pad_id]) == ""


def test_add_bos_token_flag_overrides_the_post_processor(fresh_bpe_folder):
    update_json(fresh_bpe_folder / "tokenizer_config.json", add_bos_token=False)
    tokenizer = HFTokenizer.from_pretrained(fresh_bpe_folder)
    assert not tokenizer.adds_bos_by_default
    assert tokenizer.bos_id not in tokenizer.encode("hello")
    assert tokenizer.encode("hello", add_bos=True)[0] == tokenizer.bos_id


def test_special_tokens_as_dicts_and_from_special_tokens_map(fresh_bpe_folder, byte_level_bpe):
    write_json(
        fresh_bpe_folder / "tokenizer_config.json",
        {"eos_token": {"content": END_OF_TURN, "special": True}, "bos_token": None},
    )
    write_json(
        fresh_bpe_folder / "special_tokens_map.json",
        {"bos_token": {"content": BOS}, "eos_token": EOS, "pad_token": PAD},
    )
    tokenizer = HFTokenizer.from_pretrained(fresh_bpe_folder)
    assert tokenizer.eos_id == byte_level_bpe.token_to_id(END_OF_TURN)  # tokenizer_config wins
    assert tokenizer.bos_id == byte_level_bpe.token_to_id(BOS)
    assert tokenizer.pad_id == byte_level_bpe.token_to_id(PAD)


def test_eos_token_id_list_in_generation_config_ends_decoding(fresh_bpe_folder, byte_level_bpe):
    eos, end_of_turn = byte_level_bpe.token_to_id(EOS), byte_level_bpe.token_to_id(END_OF_TURN)
    write_json(fresh_bpe_folder / "generation_config.json", {"eos_token_id": [end_of_turn, eos]})
    tokenizer = HFTokenizer.from_pretrained(fresh_bpe_folder)
    assert tokenizer.eos_ids == (eos, end_of_turn)
    assert tokenizer.eos_id == eos
    hello, world = tokenizer.encode("hello"), tokenizer.encode(" world", add_bos=False)
    assert tokenizer.decode([*hello, end_of_turn, *world]) == "hello"
    assert tokenizer.decode([*hello, eos, *world]) == "hello"


def test_ids_from_model_config_when_the_tokenizer_names_none(byte_level_bpe, tmp_path):
    byte_level_bpe.save(str(tmp_path / "tokenizer.json"))
    eos, pad = byte_level_bpe.token_to_id(EOS), byte_level_bpe.token_to_id(PAD)
    write_json(tmp_path / "config.json", {"eos_token_id": eos, "pad_token_id": pad})
    tokenizer = HFTokenizer.from_pretrained(tmp_path)
    assert (tokenizer.eos_ids, tokenizer.pad_id) == ((eos,), pad)
    assert tokenizer.bos_id == byte_level_bpe.token_to_id(BOS)  # What the post-processor adds.
    assert tokenizer.adds_bos_by_default


@pytest.fixture(scope="module")
def sentencepiece_folder(tmp_path_factory):
    """A Llama-style SentencePiece checkpoint: tokenizer.model and tokenizer_config.json."""
    folder = tmp_path_factory.mktemp("sentencepiece")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 4), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(folder / "tokenizer"),
        vocab_size=SENTENCEPIECE_VOCAB_SIZE,
        model_type="bpe",
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    corpus.unlink()
    write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "LlamaTokenizer",
            "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
            "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True},
            "unk_token": "<unk>",
            "add_bos_token": True,
            "add_eos_token": False,
        },
    )
    return folder


@pytest.fixture(scope="module")
def processor(sentencepiece_folder):
    return sentencepiece.SentencePieceProcessor(
        model_file=str(sentencepiece_folder / "tokenizer.model")
    )


def test_sentencepiece_matches_sentencepiece(sentencepiece_folder, processor):
    tokenizer = HFTokenizer.from_pretrained(sentencepiece_folder)
    assert tokenizer.vocab_size == processor.get_piece_size() == SENTENCEPIECE_VOCAB_SIZE
    assert (tokenizer.bos_id, tokenizer.eos_id) == (processor.bos_id(), processor.eos_id())
    assert tokenizer.pad_id == tokenizer.eos_id  # No pad piece in the model.
    for text in ["hello world", "  two leading spaces", "héllo wörld 你好", "a  b  "]:
        ids = tokenizer.encode(text)
        assert ids == [processor.bos_id(), *processor.encode(text)]
        assert tokenizer.decode(ids) == processor.decode(processor.encode(text)) == text
    assert tokenizer.decode([processor.unk_id()]) == ""


def test_sentencepiece_matches_transformers_llama_tokenizer(sentencepiece_folder):
    tokenizer = HFTokenizer.from_pretrained(sentencepiece_folder)
    reference = transformers.AutoTokenizer.from_pretrained(str(sentencepiece_folder))
    # transformers 5 rebuilds the model as a `tokenizers` pipeline that departs from
    # sentencepiece on leading spaces and unknown characters; compare plain text only.
    for text in ["hello world", "the lazy dog", "héllo wörld 你好", "a  b  "]:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_sentencepiece_added_tokens_count_in_vocab(sentencepiece_folder, tmp_path):
    for name in ("tokenizer.model", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((sentencepiece_folder / name).read_bytes())
    pad_id = SENTENCEPIECE_VOCAB_SIZE
    update_json(
        tmp_path / "tokenizer_config.json",
        pad_token=PAD,
        added_tokens_decoder={str(pad_id): {"content": PAD, "special": True}},
    )
    tokenizer = HFTokenizer.from_pretrained(tmp_path)
    assert tokenizer.vocab_size == SENTENCEPIECE_VOCAB_SIZE + 1
    assert tokenizer.pad_id == pad_id
    assert tokenizer.decode([pad_id, *tokenizer.encode("hello world"), pad_id]) == "hello world"


def test_check_vocab_matches(ours):
    check_vocab_matches(ours, ours.vocab_size, where="ckpt/equal")
    check_vocab_matches(ours, ours.vocab_size + 27, where="ckpt/padded-embedding")
    with pytest.raises(ValueError, match=rf"ckpt/small.*{ours.vocab_size}.*{ours.vocab_size - 1}"):
        check_vocab_matches(ours, ours.vocab_size - 1, where="ckpt/small")


def test_folder_without_tokenizer_files(tmp_path):
    write_json(tmp_path / "config.json", {"eos_token_id": 0})
    with pytest.raises(FileNotFoundError, match=r"neither tokenizer\.json nor tokenizer\.model"):
        HFTokenizer.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFTokenizer.from_pretrained(tmp_path / "missing")


def test_unreadable_files_are_named(fresh_bpe_folder):
    (fresh_bpe_folder / "generation_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=r"generation_config\.json as JSON"):
        HFTokenizer.from_pretrained(fresh_bpe_folder)
    (fresh_bpe_folder / "generation_config.json").unlink()
    (fresh_bpe_folder / "tokenizer.json").write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        HFTokenizer.from_pretrained(fresh_bpe_folder)


def test_config_that_disagrees_with_the_tokenizer(fresh_bpe_folder):
    update_json(fresh_bpe_folder / "tokenizer_config.json", eos_token="<|not-a-token|>")
    with pytest.raises(ValueError, match=r"eos_token='<\|not-a-token\|>'.*not a token"):
        HFTokenizer.from_pretrained(fresh_bpe_folder)
    update_json(fresh_bpe_folder / "tokenizer_config.json", eos_token=EOS)
    write_json(fresh_bpe_folder / "config.json", {"eos_token_id": BPE_VOCAB_SIZE * 10})
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        HFTokenizer.from_pretrained(fresh_bpe_folder)


def test_checkpoint_without_any_eos(byte_level_bpe, tmp_path):
    byte_level_bpe.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="No EOS token"):
        HFTokenizer.from_pretrained(tmp_path)
