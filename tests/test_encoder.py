"""The BERT / RoBERTa encoder against transformers on the same weights (torch CPU, float32).

Tiny random checkpoints with tokenizers trained in the test; their weights are redrawn with a
large std (and random LayerNorm scales / biases) so that attention is far from uniform and a
wrong padding mask, position offset or swapped parameter shows in the outputs.
"""

import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tba_jax.models import encoder as encoder_lib
from tba_jax.models.encoder import TextEncoder
from tba_jax.rewards.diversity import minilm_path

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TOLERANCE = 1e-5  # max |diff| against transformers in float32
WEIGHT_STD = 0.3
MAX_TOKENS = 64  # the tiny models' position embeddings hold this many tokens
LABELS = {0: "nothate", 1: "hate", 2: "unsure"}
BERT_SPECIALS = {
    "pad_token": "[PAD]",
    "unk_token": "[UNK]",
    "cls_token": "[CLS]",
    "sep_token": "[SEP]",
    "mask_token": "[MASK]",
}
ROBERTA_SPECIALS = {
    "bos_token": "<s>",
    "pad_token": "<pad>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "mask_token": "<mask>",
}

SUBJECTS = ["the cat", "a dog", "my neighbour", "the old farmer", "every student", "nobody"]
VERBS = ["sees", "likes", "paints", "follows", "ignores", "writes to"]
OBJECTS = ["the river", "a red house", "their friends", "the moon", "some apples", "the teacher"]
CORPUS = [f"{s} {v} {o}." for s in SUBJECTS for v in VERBS for o in OBJECTS]
LONG_TEXT = " ".join(CORPUS[:40])  # far more than MAX_TOKENS tokens: truncated
TEXTS = ["The cat sees the moon.", "Nobody", LONG_TEXT, "a dog likes some apples and the river!"]
PAIRS = ["every student writes to the teacher.", "A red house?", "my neighbour", LONG_TEXT]


def _randomize(model, seed: int):
    """Redraws every parameter from N(0, WEIGHT_STD^2)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * WEIGHT_STD)
    return model.eval()


def _wordpiece_tokenizer():
    wordpiece = tokenizers.Tokenizer(tokenizers.models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=True)
    wordpiece.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    wordpiece.decoder = tokenizers.decoders.WordPiece()
    trainer = tokenizers.trainers.WordPieceTrainer(
        vocab_size=120, special_tokens=list(BERT_SPECIALS.values())
    )
    wordpiece.train_from_iterator(CORPUS, trainer)
    cls_id, sep_id = wordpiece.token_to_id("[CLS]"), wordpiece.token_to_id("[SEP]")
    wordpiece.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=wordpiece, **BERT_SPECIALS)


def _byte_level_bpe():
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(CORPUS, trainer)
    bpe.post_processor = tokenizers.processors.RobertaProcessing(
        ("</s>", bpe.token_to_id("</s>")), ("<s>", bpe.token_to_id("<s>"))
    )
    return bpe


def _bert_config(tokenizer, **overrides):
    return transformers.BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=MAX_TOKENS,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="eager",
        **overrides,
    )


def _sentence_module(index: int, path: str, kind: str) -> dict:
    """A modules.json entry of a sentence-transformers folder."""
    return {
        "idx": index,
        "name": str(index),
        "path": path,
        "type": f"sentence_transformers.models.{kind}",
    }


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    """A random BertModel with a trained WordPiece tokenizer, as a sentence-transformers
    folder: mean pooling + Normalize."""
    folder = tmp_path_factory.mktemp("tiny_bert")
    tokenizer = _wordpiece_tokenizer()
    tokenizer.save_pretrained(folder)
    _randomize(transformers.BertModel(_bert_config(tokenizer)), seed=0).save_pretrained(folder)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True})
    )
    modules = [
        _sentence_module(0, "", "Transformer"),
        _sentence_module(1, "1_Pooling", "Pooling"),
        _sentence_module(2, "2_Normalize", "Normalize"),
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    return folder


@pytest.fixture(scope="module")
def bert_classifier_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_bert_classifier")
    tokenizer = _wordpiece_tokenizer()
    tokenizer.save_pretrained(folder)
    config = _bert_config(tokenizer, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    model = transformers.BertForSequenceClassification(config)
    _randomize(model, seed=1).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def roberta_classifier_folder(tmp_path_factory):
    """A random RobertaForSequenceClassification (type_vocab_size 1, pad id 1, positions
    from pad id + 1, as roberta-base) with a byte-level BPE tokenizer."""
    folder = tmp_path_factory.mktemp("tiny_roberta_classifier")
    bpe = _byte_level_bpe()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, **ROBERTA_SPECIALS)
    tokenizer.save_pretrained(folder)
    bpe.model.save(str(folder))  # vocab.json + merges.txt, for the fallback test
    labels = {0: "nothate", 1: "hate"}
    config = transformers.RobertaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=MAX_TOKENS + 2,
        type_vocab_size=1,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
        attn_implementation="eager",
    )
    model = transformers.RobertaForSequenceClassification(config)
    _randomize(model, seed=2).save_pretrained(folder)
    return folder


def _reference_inputs(folder, texts, pairs=None, *, token_types=True):
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    return tokenizer(
        texts,
        pairs,
        padding=True,
        truncation=True,
        max_length=MAX_TOKENS,
        return_tensors="pt",
        return_token_type_ids=token_types,
    )


def _reference_logits(folder, model_class, texts, pairs=None, *, token_types=True):
    model = model_class.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(**_reference_inputs(folder, texts, pairs, token_types=token_types)).logits


def _copy_folder(source, target, *, skip=()):
    target.mkdir()
    for path in pathlib.Path(source).iterdir():
        if path.name not in skip:
            (shutil.copytree if path.is_dir() else shutil.copy)(path, target / path.name)
    return target


# ------------------------------------------------------------------------------ parity


def test_bert_mean_pooled_normalized_embeddings_match_transformers(bert_folder):
    encoder = TextEncoder.from_pretrained(str(bert_folder))
    assert encoder.pooling == encoder_lib.SentencePooling(("mean",), normalize=True)
    assert encoder.max_length == MAX_TOKENS

    inputs = _reference_inputs(bert_folder, TEXTS)
    model = transformers.BertModel.from_pretrained(bert_folder, attn_implementation="eager")
    with torch.no_grad():
        hidden = model.eval()(**inputs).last_hidden_state
    mask = inputs["attention_mask"][..., None].float()
    mean = (hidden * mask).sum(1) / mask.sum(1)
    expected = torch.nn.functional.normalize(mean, dim=1).numpy()

    embeddings = encoder.embed(TEXTS)
    assert embeddings.shape == (len(TEXTS), 32) and embeddings.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-6)
    assert np.abs(embeddings - expected).max() < TOLERANCE
    # Without modules.json: mean pooling, not normalised.
    no_modules = _copy_folder(bert_folder, bert_folder.parent / "plain", skip=("modules.json",))
    plain = TextEncoder.from_pretrained(str(no_modules))
    assert np.abs(plain.embed(TEXTS) - mean.numpy()).max() < TOLERANCE


def test_embeddings_do_not_depend_on_batching_or_order(bert_folder):
    encoder = TextEncoder.from_pretrained(str(bert_folder))
    texts = [*TEXTS, *CORPUS[:5]]
    together = encoder.embed(texts)
    in_small_batches = encoder.embed(texts[::-1], batch_size=3)[::-1]
    assert np.abs(in_small_batches - together).max() < 1e-6
    assert encoder.embed([]).shape == (0, encoder.embedding_dim)


def test_bert_classifier_logits_match_transformers_for_texts_and_pairs(bert_classifier_folder):
    encoder = TextEncoder.from_pretrained(str(bert_classifier_folder))
    assert encoder.id2label == LABELS
    folder, model_class = bert_classifier_folder, transformers.BertForSequenceClassification
    assert len(encoder.token_ids([LONG_TEXT])[0]) == MAX_TOKENS  # truncated

    expected = _reference_logits(folder, model_class, TEXTS).numpy()
    logits = encoder.classify(TEXTS)
    assert logits.shape == (len(TEXTS), 3) and logits.dtype == np.float32
    assert np.abs(logits - expected).max() < TOLERANCE

    expected_pairs = _reference_logits(folder, model_class, TEXTS, PAIRS).numpy()
    assert np.abs(encoder.classify(TEXTS, PAIRS, batch_size=2) - expected_pairs).max() < TOLERANCE
    # Segment B has token type 1: the pair result is not the concatenated text's.
    assert np.abs(expected_pairs - expected).max() > 0.1


def test_roberta_classifier_logits_match_transformers_for_texts_and_pairs(
    roberta_classifier_folder,
):
    encoder = TextEncoder.from_pretrained(str(roberta_classifier_folder))
    assert encoder.max_length == MAX_TOKENS  # max_position_embeddings - (pad_token_id + 1)
    folder, model_class = roberta_classifier_folder, transformers.RobertaForSequenceClassification

    expected = _reference_logits(folder, model_class, TEXTS, token_types=False).numpy()
    logits = encoder.classify(TEXTS)
    assert logits.shape == (len(TEXTS), 2)
    assert np.abs(logits - expected).max() < TOLERANCE

    expected_pairs = _reference_logits(folder, model_class, TEXTS, PAIRS, token_types=False)
    assert np.abs(encoder.classify(TEXTS, PAIRS) - expected_pairs.numpy()).max() < TOLERANCE
    assert encoder.label_index("hate") == 1 and encoder.label_index("nothate") == 0


def test_bfloat16_classifier_is_close_to_float32(roberta_classifier_folder):
    exact = TextEncoder.from_pretrained(str(roberta_classifier_folder)).classify(TEXTS)
    low = TextEncoder.from_pretrained(str(roberta_classifier_folder), dtype="bfloat16")
    assert str(low.params["embeddings"]["word"].dtype) == "bfloat16"
    logits = low.classify(TEXTS)
    assert logits.dtype == np.float32
    assert np.abs(logits - exact).max() < 0.1 * max(1.0, np.abs(exact).max())


def test_logical_axes_name_every_dimension_of_every_parameter(
    bert_folder, roberta_classifier_folder
):
    """The sharding rules read `logical_axes`: one name per dimension, the params' tree."""
    for folder, head in ((bert_folder, "base"), (roberta_classifier_folder, "classifier")):
        encoder = TextEncoder.from_pretrained(str(folder))
        assert encoder.config.head == head
        axes = encoder_lib.logical_axes(encoder.config)
        is_axes = lambda node: isinstance(node, tuple)
        assert jax.tree.structure(axes, is_leaf=is_axes) == jax.tree.structure(encoder.params)
        ranks = jax.tree.map(lambda a, p: (len(a), p.ndim), axes, encoder.params, is_leaf=is_axes)
        assert all(named == ndim for named, ndim in jax.tree.leaves(ranks, is_leaf=is_axes))
        assert axes["layers"]["mlp_in"]["kernel"] == ("layers", "embed", "mlp")


# --------------------------------------------------------------------- loading variants


def test_tokenizer_falls_back_to_roberta_vocab_and_merges(roberta_classifier_folder, tmp_path):
    """A hub-style RoBERTa folder without tokenizer.json tokenizes as transformers'
    RobertaTokenizer does from the same vocab.json + merges.txt."""
    folder = _copy_folder(
        roberta_classifier_folder,
        tmp_path / "vocab_files",
        skip=("tokenizer.json", "tokenizer_config.json"),
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "RobertaTokenizer"})
    )
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    assert type(reference).__name__ == "RobertaTokenizer"
    fallback = TextEncoder.from_pretrained(str(folder))
    texts = [*TEXTS[:2], "  Spaces, <mask> and  ÜNICODE ✓"]
    pairs = [*PAIRS[:2], "x <s> y"]
    assert fallback.token_ids(texts) == reference(texts)["input_ids"]
    assert fallback.token_ids(texts, pairs) == reference(texts, pairs)["input_ids"]
    with_json = TextEncoder.from_pretrained(str(roberta_classifier_folder))
    assert fallback.token_ids(TEXTS, PAIRS) == with_json.token_ids(TEXTS, PAIRS)


def test_legacy_layernorm_names_and_unprefixed_body_load_the_same_weights(
    bert_classifier_folder, tmp_path
):
    folder = _copy_folder(bert_classifier_folder, tmp_path / "legacy")
    tensors = load_file(str(folder / "model.safetensors"))
    renamed = {}
    for name, value in tensors.items():
        name = name.removeprefix("bert.")
        name = name.replace("LayerNorm.weight", "LayerNorm.gamma")
        renamed[name.replace("LayerNorm.bias", "LayerNorm.beta")] = value
    save_file(renamed, str(folder / "model.safetensors"))
    expected = TextEncoder.from_pretrained(str(bert_classifier_folder)).classify(TEXTS)
    assert np.array_equal(TextEncoder.from_pretrained(str(folder)).classify(TEXTS), expected)


def test_bucket_pads_to_powers_of_two_within_bounds():
    assert [encoder_lib.bucket(n, smallest=16, largest=100) for n in (1, 16, 17, 64, 65, 99)] == [
        16,
        16,
        32,
        64,
        100,
        100,
    ]
    assert [encoder_lib.bucket(n, smallest=1, largest=48) for n in (1, 2, 3, 5, 33)] == [
        1,
        2,
        4,
        8,
        48,
    ]


def test_pooling_modes_match_numpy():
    """cls, max, mean and mean_sqrt_len pooling, concatenated in that order and normalised,
    over the valid tokens only (sentence-transformers' Pooling + Normalize)."""
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(3, 5, 4)).astype(np.float32)
    valid = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], bool)
    pooling = encoder_lib.SentencePooling(("cls", "max", "mean", "mean_sqrt_len"), normalize=True)
    expected = []
    for row, keep in zip(hidden, valid, strict=True):
        tokens = row[keep]
        parts = [row[0], tokens.max(0), tokens.mean(0), tokens.sum(0) / np.sqrt(len(tokens))]
        joined = np.concatenate(parts)
        expected.append(joined / np.linalg.norm(joined))
    pooled = np.asarray(encoder_lib.pool_sentences(hidden, valid, pooling))
    np.testing.assert_allclose(pooled, np.stack(expected), atol=1e-6)


# ------------------------------------------------------------------ the real MiniLM


@pytest.fixture(scope="module")
def minilm_folder():
    try:
        return pathlib.Path(minilm_path())
    except (ImportError, FileNotFoundError) as error:
        pytest.skip(str(error))


def test_real_minilm_matches_transformers_mean_pooling(minilm_folder):
    texts = ["A man is playing a guitar.", "Héllo WORLD, naïve café!", LONG_TEXT]
    encoder = TextEncoder.from_pretrained(str(minilm_folder))
    assert encoder.max_length == 256  # sentence_bert_config.json's max_seq_length
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_folder)
    inputs = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    model = transformers.BertModel.from_pretrained(minilm_folder).eval()
    with torch.no_grad():
        hidden = model(**inputs).last_hidden_state
    mask = inputs["attention_mask"][..., None].float()
    expected = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1)
    assert np.abs(encoder.embed(texts) - expected.numpy()).max() < TOLERANCE


def test_tokenizer_falls_back_to_bert_vocab_txt(minilm_folder, tmp_path):
    folder = tmp_path / "minilm_vocab_txt"
    folder.mkdir()
    for path in minilm_folder.iterdir():
        if path.name not in ("tokenizer.json", "modules.json"):
            (folder / path.name).symlink_to(path)
    fallback = TextEncoder.from_pretrained(str(folder))
    packaged = TextEncoder.from_pretrained(str(minilm_folder))
    texts = ["Héllo WORLD, naïve café!", "中文 text\twith\ttabs", "unaffable [MASK] x", LONG_TEXT]
    pairs = ["second", "segment B", "", "?"]
    assert fallback.token_ids(texts) == packaged.token_ids(texts)
    assert fallback.token_ids(texts, pairs) == packaged.token_ids(texts, pairs)


# ------------------------------------------------------------------------------- errors


def _edit_config(folder, **changes):
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_unsupported_model_type_is_a_clear_error(bert_classifier_folder, tmp_path):
    folder = _copy_folder(bert_classifier_folder, tmp_path / "gpt2")
    _edit_config(folder, model_type="gpt2")
    with pytest.raises(ValueError, match=r"model_type 'gpt2'.*\['bert', 'roberta'\]"):
        TextEncoder.from_pretrained(str(folder))


def test_unsupported_architecture_is_a_clear_error(bert_classifier_folder, tmp_path):
    folder = _copy_folder(bert_classifier_folder, tmp_path / "mlm")
    _edit_config(folder, architectures=["BertForMaskedLM"])
    with pytest.raises(ValueError, match=r"BertForMaskedLM.*not supported"):
        TextEncoder.from_pretrained(str(folder))


def test_unknown_label_name_lists_the_labels(roberta_classifier_folder):
    encoder = TextEncoder.from_pretrained(str(roberta_classifier_folder))
    with pytest.raises(ValueError, match=r"'toxic'.*\['hate', 'nothate'\]"):
        encoder.label_index("toxic")


def test_classify_needs_a_classification_head(bert_folder):
    encoder = TextEncoder.from_pretrained(str(bert_folder))
    with pytest.raises(ValueError, match="BertForSequenceClassification checkpoint"):
        encoder.classify(["hello"])


def test_missing_and_unexpected_tensors_are_named(bert_classifier_folder, tmp_path):
    folder = _copy_folder(bert_classifier_folder, tmp_path / "broken")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["classifier.weight"]
    tensors["extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"1 missing tensors \['classifier.weight'\].*extra"):
        TextEncoder.from_pretrained(str(folder))


def test_unsupported_sentence_transformers_module_is_a_clear_error(bert_folder, tmp_path):
    folder = _copy_folder(bert_folder, tmp_path / "dense_module")
    modules = [
        *json.loads((folder / "modules.json").read_text()),
        _sentence_module(3, "3", "Dense"),
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=r"'sentence_transformers\.models\.Dense' module"):
        TextEncoder.from_pretrained(str(folder))


def test_bad_inputs_are_clear_errors(bert_classifier_folder, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TextEncoder.from_pretrained(str(tmp_path / "nowhere"))
    no_tokenizer = _copy_folder(
        bert_classifier_folder, tmp_path / "no_tokenizer", skip=("tokenizer.json",)
    )
    with pytest.raises(FileNotFoundError, match=r"tokenizer.json or vocab.txt"):
        TextEncoder.from_pretrained(str(no_tokenizer))
    with pytest.raises(ValueError, match=r"max_length=65 must be in \[1, 64\]"):
        TextEncoder.from_pretrained(str(bert_classifier_folder), max_length=65)
    encoder = TextEncoder.from_pretrained(str(bert_classifier_folder))
    with pytest.raises(ValueError, match="2 texts but 1 text_pairs"):
        encoder.classify(["a", "b"], ["c"])
    with pytest.raises(TypeError, match="not one string"):
        encoder.classify("a single string")
    with pytest.raises(ValueError, match="batch_size=0"):
        encoder.classify(["a"], batch_size=0)
