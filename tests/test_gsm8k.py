"""GSM8K: the TFDS builder on the real files (without TensorFlow) and the answer reward."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tensorflow_datasets as tfds
from support import GSM8K_DIR, HIDE_TENSORFLOW, requires_gsm8k, run_repo_script

from tba_jax.config_lib import ConfigError
from tba_jax.data import builder_utils, gsm8k
from tba_jax.rewards.gsm8k import (
    batch_rewards,
    extract_final_answer,
    extract_last_number,
    reward,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
EXPECTED_SIZES = {"train": 7473, "test": 1319}
GOLD_MARKER = "####"


def read_source(split: str) -> list[dict]:
    lines = (GSM8K_DIR / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def gold_number(answer_field: str) -> str:
    """An independent reading of the gold answer: the text after '#### ', commas dropped."""
    return answer_field.split(GOLD_MARKER)[-1].strip().replace(",", "")


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")


# ------------------------------------------------------------------ builder (real data)

_PREPARE_WITHOUT_TENSORFLOW = HIDE_TENSORFLOW + textwrap.dedent(
    """
    from tba_jax.data.gsm8k import load_split

    data_dir, manual_dir = sys.argv[1], sys.argv[2]
    splits = {split: load_split(split, data_dir, manual_dir) for split in ("train", "test")}
    assert "tensorflow" not in sys.modules
    print(json.dumps(splits))
    """
)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """(data_dir, {split: examples}) prepared from the real files with TensorFlow hidden."""
    data_dir = tmp_path_factory.mktemp("gsm8k_data")
    completed = subprocess.run(
        [sys.executable, "-c", _PREPARE_WITHOUT_TENSORFLOW, str(data_dir), str(GSM8K_DIR)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert completed.returncode == 0, completed.stderr
    return data_dir, json.loads(completed.stdout.strip().splitlines()[-1])


@requires_gsm8k
def test_builder_prepares_the_real_splits_without_tensorflow(prepared):
    data_dir, splits = prepared
    assert {split: len(examples) for split, examples in splits.items()} == EXPECTED_SIZES
    record_files = sorted(path.name.split(".")[0] for path in data_dir.rglob("*.array_record-*"))
    assert record_files == ["gsm8k-test", "gsm8k-train"]


@requires_gsm8k
@pytest.mark.parametrize("split", list(EXPECTED_SIZES))
def test_examples_reproduce_the_source_lines_in_order(prepared, split):
    _, splits = prepared
    examples = splits[split]
    for index, (example, source) in enumerate(zip(examples, read_source(split), strict=True)):
        assert example == {
            "id": index,
            "question": source["question"],
            "answer": source["answer"],
            "final_answer": gold_number(source["answer"]),
            "prompt": "[MATH TASK] Problem:\n" + source["question"] + "\n\nSolution:\n",
        }


@requires_gsm8k
def test_load_split_reuses_prepared_data_and_rejects_unknown_splits(prepared, monkeypatch):
    data_dir, splits = prepared

    def fail_if_regenerated(*_):
        raise AssertionError("load_split regenerated data that was already prepared")

    monkeypatch.setattr(gsm8k.Gsm8k, "_generate_examples", fail_if_regenerated)
    assert gsm8k.load_split("test", data_dir) == splits["test"]
    assert len(tfds.data_source("gsm8k", split="train", data_dir=str(data_dir))) == 7473
    with pytest.raises(ValueError, match="Unknown split 'validation'"):
        gsm8k.load_split("validation", data_dir)


def test_missing_manual_files_are_named_with_where_to_get_them(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"train\.jsonl, test\.jsonl") as missing_dir:
        gsm8k.load_split("train", tmp_path / "data", manual_dir=tmp_path / "nowhere")
    assert "does not exist" in str(missing_dir.value)
    assert "openai/grade-school-math" in str(missing_dir.value)

    manual_dir = tmp_path / "manual"
    manual_dir.mkdir()
    write_jsonl(manual_dir / "train.jsonl", [{"question": "1+1?", "answer": "2\n#### 2"}])
    with pytest.raises(FileNotFoundError, match=r"Missing test\.jsonl in manual directory"):
        gsm8k.load_split("train", tmp_path / "data", manual_dir=manual_dir)


def manual_dir_with_train_text(tmp_path: Path, train_bytes: bytes) -> Path:
    """A manual directory whose train.jsonl holds `train_bytes` and test.jsonl one problem."""
    manual_dir = tmp_path / "manual"
    manual_dir.mkdir()
    (manual_dir / "train.jsonl").write_bytes(train_bytes)
    write_jsonl(manual_dir / "test.jsonl", [{"question": "1+1?", "answer": "2\n#### 2"}])
    return manual_dir


@pytest.mark.parametrize(
    "train_bytes, message",
    [
        (b'{"question": "a" "answer": "b"}\n', r"train\.jsonl:1 is not valid JSON \(Expecting"),
        (b'\n["a", "b"]\n', r"train\.jsonl:2 holds a list, not a JSON object"),
        (b'{"question": "a"}\n', r"train\.jsonl:1 lacks field\(s\) \['answer'\]"),
        (b'{"question": 5, "answer": "#### 5"}\n', r"train\.jsonl: Problem 0 has question=5"),
        (b'{"question": "a", "answer": 5}\n', r"Problem 0 has answer=5; it must be a string"),
        (b'{"question": "\xff"}\n', r"train\.jsonl is not utf-8 text \(byte 14"),
    ],
)
def test_a_malformed_manual_file_is_a_config_error_naming_the_file(tmp_path, train_bytes, message):
    """A ConfigError, so the launchers print it as one `error:` line (a ValueError, a
    TypeError from TFDS or an AttributeError was a traceback)."""
    manual_dir = manual_dir_with_train_text(tmp_path, train_bytes)
    with pytest.raises(ConfigError, match=message):
        gsm8k.load_split("train", tmp_path / "data", manual_dir=manual_dir)


def test_train_py_reports_a_malformed_manual_file_in_one_line(tmp_path):
    manual_dir = manual_dir_with_train_text(tmp_path, b'{"question": "a" "answer": "b"}\n')
    workdir = tmp_path / "run"
    result = run_repo_script(
        "experiments/train.py",
        "--config=configs/gsm8k_rho1b.py:tiny",
        f"--config.task.manual_dir={manual_dir}",
        f"--workdir={workdir}",
        timeout=120,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {manual_dir}/train.jsonl:1 is not valid JSON (Expecting ',' delimiter); "
        "each line of a JSONL file must hold one JSON object."
    )
    assert not workdir.exists()  # the refused run removes the workdir it made


def test_without_a_manual_dir_the_public_files_are_downloaded(tmp_path, monkeypatch):
    sources = {}
    for split, count in (("train", 3), ("test", 2)):
        sources[split] = tmp_path / f"fetched_{split}.jsonl"
        records = [{"question": f"{split} {i}?", "answer": f"{i}\n#### {i}"} for i in range(count)]
        write_jsonl(sources[split], records)
    requested = []

    def fake_download(self, urls):
        requested.append(urls)
        return {split: tfds.core.Path(sources[split]) for split in urls}

    monkeypatch.setattr(tfds.download.DownloadManager, "download", fake_download)
    monkeypatch.setattr(builder_utils, "check_hosts_resolve", lambda urls: None)  # offline CI
    examples = gsm8k.load_split("train", tmp_path / "data")
    base = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/"
    assert requested == [{"train": base + "data/train.jsonl", "test": base + "data/test.jsonl"}]
    assert [example["question"] for example in examples] == ["train 0?", "train 1?", "train 2?"]


def test_without_a_network_the_download_fails_at_once_saying_to_pass_manual_dir(
    tmp_path, monkeypatch
):
    def no_dns(host, port):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    def no_download(self, urls):
        raise AssertionError("TFDS was asked to download (and retry for minutes)")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    monkeypatch.setattr(tfds.download.DownloadManager, "download", no_download)
    with pytest.raises(builder_utils.SourceFilesUnavailableError, match="as `manual_dir`"):
        gsm8k.load_split("train", tmp_path / "data")


# ------------------------------------------------------------------------------ reward


@requires_gsm8k
@pytest.mark.parametrize("split", list(EXPECTED_SIZES))
def test_every_gold_solution_earns_the_reward_and_a_wrong_final_number_does_not(split):
    answers = [source["answer"] for source in read_source(split)]
    np.testing.assert_array_equal(batch_rewards(answers, answers), np.ones(len(answers)))
    finals = [gold_number(answer) for answer in answers]
    np.testing.assert_array_equal(batch_rewards(answers, finals), np.ones(len(answers)))
    corrupted = [
        answer.rsplit(GOLD_MARKER, 1)[0] + f"{GOLD_MARKER} {int(final) + 1}"
        for answer, final in zip(answers, finals, strict=True)
    ]
    np.testing.assert_array_equal(batch_rewards(corrupted, answers), np.zeros(len(answers)))


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("The answer is 18.", "18", 1.0),
        ("She makes $18 every day.", "#### 18", 1.0),
        ("Total: $1,000", "Work...\n#### 1,000", 1.0),
        ("Total: 1000", "#### 1,000", 1.0),
        ("It costs $1,000.50.", "1000.5", 1.0),
        ("3 + 4 = 7, so 7 apples, then 8", "7", 0.0),  # The last number wins.
        ("I first thought 8, but it is 7", "7", 1.0),
        ("The change is -3 degrees", "-3", 1.0),
        ("The change is -$3.", "-3", 1.0),
        ("10 - 3", "-3", 0.0),  # Subtraction, not a negative number: the last number is 3.
        ("5-3", "3", 1.0),
        ("x = 2.50", "2.5", 1.0),
        ("x = .5", "0.5", 1.0),
        ("about 7.", "7.0", 1.0),
        ("7.5", "7", 0.0),
        ("I do not know", "7", 0.0),
        ("", "7", 0.0),
        ("####", "7", 0.0),
        ("12,345,678 grains", "12345678", 1.0),
        ("the pairs 3,4", "4", 1.0),
    ],
)
def test_reward_on_hand_computed_cases(response, answer, expected):
    assert reward(response, answer) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$1,000.50.", "1000.50"),
        ("a -12 b 3", "3"),
        ("a 3 b -12", "-12"),
        ("(-7)", "-7"),
        ("version 1.2.3", "1.2"),
        ("H2O", None),
        ("nothing", None),
    ],
)
def test_extract_last_number(text, expected):
    assert extract_last_number(text) == expected


@pytest.mark.parametrize(
    ("answer_field", "expected"),
    [
        ("She sells 9 eggs.\n#### 18", "18"),
        ("#### 1,080", "1080"),
        ("#### -4", "-4"),
        ("42", "42"),
        (" 2,125 ", "2125"),
    ],
)
def test_extract_final_answer(answer_field, expected):
    assert extract_final_answer(answer_field) == expected


def test_reward_rejects_a_reference_that_is_not_a_number():
    with pytest.raises(ValueError, match="not a number"):
        reward("7", "Work...\n#### seven")


def test_batch_rewards_checks_lengths():
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        batch_rewards(["1", "2"], ["1"])
