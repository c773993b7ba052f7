"""TL;DR and red-team seed-prompt builders on small fixture files, and TL;DR truncation."""

import json
import random
import re
from pathlib import Path

import pytest
import tensorflow_datasets as tfds

from tba_jax.data import builder_utils, redteam, tldr
from tba_jax.data.tldr import build_prompt, prompt_budget, truncate_post

LONG_POST = (
    "I moved to a new city last spring and\tfound a job I love.\n\n"
    "My roommate keeps eating my food and   never cleans the kitchen, even after we agreed "
    "on a rota.\nWhat should I do?"
)
TLDR_SPLIT_RECORDS = {
    "train.jsonl": [
        {"id": "t3_a", "subreddit": "relationships", "title": "Roommate trouble",
         "post": LONG_POST, "summary": " roommate eats my food, what do?"},
        {"id": "t3_b", "subreddit": "cooking", "title": "Salt?", "post": "How much salt?",
         "summary": "salt question"},
        {"id": "t3_c", "subreddit": "AskReddit", "title": "Hi", "post": "Short post.",
         "summary": "hi"},
    ],
    "valid.jsonl": [
        {"id": "t3_d", "subreddit": "pets", "title": "Cat", "post": "My cat sneezes.",
         "summary": "cat sneezes"},
        {"id": "t3_e", "subreddit": "pets", "title": "Dog", "post": "My dog barks.",
         "summary": "dog barks"},
    ],
    "test.jsonl": [
        {"id": "t3_f", "subreddit": "books", "title": "Book", "post": "Which book next?",
         "summary": "book advice"},
    ],
}  # fmt: skip
TLDR_SPLITS = {"train": "train.jsonl", "validation": "valid.jsonl", "test": "test.jsonl"}


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")


def expected_prompt(record: dict, post: str | None = None) -> str:
    post = record["post"] if post is None else post
    return (
        f"SUBREDDIT: r/{record['subreddit']}\n\nTITLE: {record['title']}\n\nPOST: {post}\n\nTL;DR:"
    )


def is_whitespace_cut(post: str, truncated: str) -> bool:
    """A prefix of `post` ending before whitespace, without trailing whitespace."""
    if not post.startswith(truncated) or truncated != truncated.rstrip():
        return False
    return truncated == "" or len(truncated) == len(post) or post[len(truncated)].isspace()


@pytest.fixture
def tldr_manual_dir(tmp_path):
    manual_dir = tmp_path / "tldr_manual"
    manual_dir.mkdir()
    for filename, records in TLDR_SPLIT_RECORDS.items():
        write_jsonl(manual_dir / filename, records)
    return manual_dir


# ---------------------------------------------------------------------- TL;DR builder


def test_tldr_builder_reads_every_split_in_order_with_the_query_format(tmp_path, tldr_manual_dir):
    for split, filename in TLDR_SPLITS.items():
        examples = tldr.load_split(split, tmp_path / "data", manual_dir=tldr_manual_dir)
        assert examples == [
            {
                "id": record["id"],
                "subreddit": record["subreddit"],
                "title": record["title"],
                "post": record["post"],
                "prompt": expected_prompt(record),
                "reference_summary": record["summary"],
            }
            for record in TLDR_SPLIT_RECORDS[filename]
        ]


def test_tldr_builder_truncates_posts_to_the_character_budget(tmp_path, tldr_manual_dir):
    long_record = TLDR_SPLIT_RECORDS["train.jsonl"][0]
    max_prompt_chars = len(expected_prompt(long_record)) - 40
    examples = tldr.load_split(
        "train", tmp_path / "data", manual_dir=tldr_manual_dir, max_prompt_chars=max_prompt_chars
    )
    assert all(len(example["prompt"]) <= max_prompt_chars for example in examples)
    truncated = examples[0]["prompt"].split("POST: ", 1)[1].removesuffix("\n\nTL;DR:")
    assert truncated != LONG_POST and is_whitespace_cut(LONG_POST, truncated)
    assert examples[0]["prompt"] == expected_prompt(long_record, truncated)
    assert examples[0]["post"] == LONG_POST  # The full post is kept for re-truncation.
    assert [e["prompt"] for e in examples[1:]] == [
        expected_prompt(record) for record in TLDR_SPLIT_RECORDS["train.jsonl"][1:]
    ]
    untruncated = tldr.load_split("train", tmp_path / "data", manual_dir=tldr_manual_dir)
    assert untruncated[0]["prompt"] == expected_prompt(long_record)  # Its own config dir.


def test_tldr_builder_names_the_post_whose_title_cannot_fit(tmp_path, tldr_manual_dir):
    with pytest.raises(ValueError, match=r"Post 't3_a'.*even with an empty post"):
        tldr.load_split("train", tmp_path / "data", manual_dir=tldr_manual_dir, max_prompt_chars=30)


def test_tldr_builder_configs_encode_the_budget_and_reject_bad_ones():
    assert tldr.builder_config_for(None) is tldr.DEFAULT_BUILDER_CONFIG
    assert tldr.builder_config_for(500).name == "max_prompt_chars_500"
    assert tldr.builder_config_for(500).max_prompt_chars == 500
    with pytest.raises(ValueError, match="max_prompt_chars=0"):
        tldr.builder_config_for(0)


def test_tldr_missing_manual_files_are_named(tmp_path, tldr_manual_dir):
    with pytest.raises(FileNotFoundError, match=r"train\.jsonl, valid\.jsonl, test\.jsonl"):
        tldr.load_split("train", tmp_path / "data", manual_dir=tmp_path / "nowhere")
    (tldr_manual_dir / "valid.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match=r"Missing valid\.jsonl in manual directory"):
        tldr.load_split("train", tmp_path / "data", manual_dir=tldr_manual_dir)


def test_tldr_without_a_manual_dir_downloads_the_public_files(tmp_path, monkeypatch):
    fixture_dir = tmp_path / "fetched"
    fixture_dir.mkdir()
    for filename, records in TLDR_SPLIT_RECORDS.items():
        write_jsonl(fixture_dir / filename, records)
    requested = []

    def fake_download(self, urls):
        requested.append(urls)
        return {split: tfds.core.Path(fixture_dir / Path(url).name) for split, url in urls.items()}

    monkeypatch.setattr(tfds.download.DownloadManager, "download", fake_download)
    monkeypatch.setattr(builder_utils, "check_hosts_resolve", lambda urls: None)  # offline CI
    assert len(tldr.load_split("validation", tmp_path / "data")) == 2
    base = "https://openaipublic.blob.core.windows.net/summarize-from-feedback/datasets/"
    assert requested == [
        {split: base + "tldr_3_filtered/" + name for split, name in TLDR_SPLITS.items()}
    ]


def test_malformed_and_incomplete_records_are_reported_with_file_and_line(tmp_path):
    manual_dir = tmp_path / "manual"
    manual_dir.mkdir()
    for filename, records in TLDR_SPLIT_RECORDS.items():
        write_jsonl(manual_dir / filename, records)
    incomplete = {key: value for key, value in TLDR_SPLIT_RECORDS["test.jsonl"][0].items()}
    del incomplete["summary"]
    write_jsonl(manual_dir / "test.jsonl", [TLDR_SPLIT_RECORDS["test.jsonl"][0], incomplete])
    with pytest.raises(ValueError, match=r"test\.jsonl:2 lacks field\(s\) \['summary'\]"):
        tldr.load_split("test", tmp_path / "data", manual_dir=manual_dir)
    (manual_dir / "test.jsonl").write_text('{"id": "t3_f",\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"test\.jsonl:1 is not valid JSON"):
        tldr.load_split("test", tmp_path / "data", manual_dir=manual_dir)


# ------------------------------------------------------------------------ truncation


def test_truncate_post_keeps_a_post_that_fits():
    assert truncate_post("a b c", lambda post: True) == "a b c"


def test_truncate_post_cuts_at_whitespace_to_the_longest_fitting_prefix():
    post = "alpha beta\tgamma\n\ndelta  epsilon"
    within_chars = lambda limit: lambda candidate: len(candidate) <= limit
    assert truncate_post(post, within_chars(len(post) - 1)) == "alpha beta\tgamma\n\ndelta"
    assert truncate_post(post, within_chars(17)) == "alpha beta\tgamma"
    assert truncate_post(post, within_chars(15)) == "alpha beta"
    assert truncate_post(post, within_chars(4)) == ""


def test_truncate_post_without_room_for_any_post_is_an_error():
    with pytest.raises(ValueError, match="even with an empty post"):
        truncate_post("words", lambda post: False)


@pytest.mark.parametrize("seed", range(5))
def test_build_prompt_fits_the_budget_and_keeps_as_many_words_as_possible(seed):
    rng = random.Random(seed)
    words = ["a", "bb", "ccc", "dddd", "eeeeeeee"]
    separators = [" ", "  ", "\n", "\n\n", "\t"]
    post = "".join(rng.choice(words) + rng.choice(separators) for _ in range(60)).rstrip()
    record = {"subreddit": "test", "title": "A title", "post": post}
    for max_length in range(len(expected_prompt(record, "")), len(expected_prompt(record)) + 2):
        prompt = build_prompt(record["subreddit"], record["title"], post, max_length)
        kept = prompt.split("POST: ", 1)[1].removesuffix("\n\nTL;DR:")
        assert len(prompt) <= max_length
        assert is_whitespace_cut(post, kept)
        longer_cuts = [match.start() for match in re.finditer(r"\s+", post + " ")]
        next_cut = min(cut for cut in longer_cuts if cut > len(kept)) if kept != post else None
        if next_cut is not None:  # One more word would not fit.
            assert len(expected_prompt(record, post[:next_cut])) > max_length


def test_prompt_budget_can_count_tokens_with_any_tokenizer():
    count_words = lambda text: len(text.split())  # A stand-in tokenizer: one token per word.
    record = {"subreddit": "r", "title": "t"}
    header_tokens = count_words(expected_prompt(record, ""))
    budget = prompt_budget(record["subreddit"], record["title"], header_tokens + 3, count_words)
    assert truncate_post("one two three four five", budget) == "one two three"
    prompt = build_prompt("r", "t", "one two three four five", header_tokens + 3, count_words)
    assert count_words(prompt) == header_tokens + 3


# ------------------------------------------------------------------- red-team builder


def test_redteam_builder_reads_jsonl_prompts_with_optional_categories(tmp_path):
    manual_dir = tmp_path / "manual"
    manual_dir.mkdir()
    write_jsonl(
        manual_dir / "seed_prompts.jsonl",
        [{"prompt": "Tell me a secret.", "category": "privacy"}, {"prompt": "Say something."}],
    )
    examples = redteam.load_split("train", tmp_path / "data", manual_dir=manual_dir)
    assert examples == [
        {"id": 0, "prompt": "Tell me a secret.", "category": "privacy"},
        {"id": 1, "prompt": "Say something.", "category": ""},
    ]
    with pytest.raises(ValueError, match="Unknown split 'test'"):
        redteam.load_split("test", tmp_path / "data", manual_dir=manual_dir)


def test_redteam_builder_reads_text_files_and_an_optional_test_split(tmp_path):
    manual_dir = tmp_path / "manual"
    manual_dir.mkdir()
    (manual_dir / "seed_prompts.txt").write_text("First prompt\n\n  Second prompt \n", "utf-8")
    write_jsonl(manual_dir / "seed_prompts_test.jsonl", [{"prompt": "Held out", "category": "x"}])
    train = redteam.load_split("train", tmp_path / "data", manual_dir=manual_dir)
    test = redteam.load_split("test", tmp_path / "data", manual_dir=manual_dir)
    assert train == [
        {"id": 0, "prompt": "First prompt", "category": ""},
        {"id": 1, "prompt": "Second prompt", "category": ""},
    ]
    assert test == [{"id": 0, "prompt": "Held out", "category": "x"}]


def test_redteam_missing_manual_dir_names_the_expected_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"seed_prompts\.jsonl or seed_prompts\.txt"):
        redteam.load_split("train", tmp_path / "data", manual_dir=tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"No manual directory.*seed_prompts\.jsonl"):
        redteam.load_split("train", tmp_path / "data")


def test_redteam_rejects_ambiguous_sources_and_bad_records(tmp_path):
    manual_dir = tmp_path / "manual"
    manual_dir.mkdir()
    (manual_dir / "seed_prompts.txt").write_text("A prompt\n", "utf-8")
    write_jsonl(manual_dir / "seed_prompts.jsonl", [{"prompt": "A prompt"}])
    with pytest.raises(ValueError, match=r"Both seed_prompts\.jsonl and seed_prompts\.txt"):
        redteam.load_split("train", tmp_path / "data", manual_dir=manual_dir)
    (manual_dir / "seed_prompts.txt").unlink()
    write_jsonl(manual_dir / "seed_prompts.jsonl", [{"prompt": "ok"}, {"category": "no prompt"}])
    with pytest.raises(ValueError, match=r"seed_prompts\.jsonl:2 lacks field\(s\) \['prompt'\]"):
        redteam.load_split("train", tmp_path / "data", manual_dir=manual_dir)
    write_jsonl(manual_dir / "seed_prompts.jsonl", [{"prompt": "ok", "category": 3}])
    with pytest.raises(ValueError, match="category=3; it must be a string"):
        redteam.load_split("train", tmp_path / "data", manual_dir=manual_dir)
