"""The arithmetic task: generator, TFDS builder (without TensorFlow) and reward."""

import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tensorflow_datasets as tfds
from support import HIDE_TENSORFLOW, run_repo_script

from tba_jax.config_lib import ConfigError
from tba_jax.data import arithmetic, gsm8k
from tba_jax.data.arithmetic import (
    ArithmeticTaskConfig,
    builder_config_for,
    check_enough_questions,
    count_distinct_questions,
    enumerate_questions,
    generate_splits,
    load_split,
    make_example,
)
from tba_jax.models.tokenizers import CharTokenizer
from tba_jax.rewards.arithmetic import batch_rewards, reward

REPO_ROOT = Path(__file__).resolve().parents[1]
SMALL_TASK = ArithmeticTaskConfig(
    num_terms_min=2, num_terms_max=4, max_operand=20, max_result=40, num_train=300, num_test=60
)
ALL_OPS_TASK = ArithmeticTaskConfig(
    num_terms_min=2, num_terms_max=5, max_operand=9, max_result=30, ops="+-*", num_train=400,
    num_test=100, seed=3,
)  # fmt: skip
# 2-term questions a+b / a-b with operands in [0, 3] and totals in [0, 6]: 16 + 10 of them.
TINY_TASK = ArithmeticTaskConfig(num_terms_min=2, num_terms_max=2, max_operand=3, max_result=6)
TINY_TASK_QUESTION_COUNT = 26

_QUESTION_TOKEN = re.compile(r"(\d+)|([-+*])")
_PY_OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def parse_question(question: str) -> tuple[list[int], list[str]]:
    """An independent parser: ``"23+45-7"`` -> ``([23, 45, 7], ["+", "-"])``."""
    tokens = _QUESTION_TOKEN.findall(question)
    assert "".join(number + op for number, op in tokens) == question
    operands = [int(number) for number, _ in tokens[0::2]]
    operators = [op for _, op in tokens[1::2]]
    return operands, operators


def brute_force_questions(task: ArithmeticTaskConfig) -> set[str]:
    """All valid questions by exhaustive search over operand and operator tuples."""
    questions = set()
    for num_terms in range(task.num_terms_min, task.num_terms_max + 1):
        operand_tuples = itertools.product(range(task.max_operand + 1), repeat=num_terms)
        for operands in operand_tuples:
            for operators in itertools.product(task.ops, repeat=num_terms - 1):
                total, valid = operands[0], operands[0] <= task.max_result
                for op, operand in zip(operators, operands[1:], strict=True):
                    total = _PY_OPERATORS[op](total, operand)
                    valid = valid and 0 <= total <= task.max_result
                if valid:
                    questions.add(arithmetic.format_question(operands, operators))
    return questions


# --------------------------------------------------------------------------- format


def test_make_example_matches_the_documented_format():
    assert make_example(7, ((23, 45, 7), ("+", "-"))) == {
        "id": 7,
        "question": "23+45-7",
        "prompt": "23+45-7=",
        "solution": "68,61>61",
        "answer": "61",
    }
    assert make_example(0, ((23, 45), ("+",)))["solution"] == "68>68"
    assert make_example(0, ((3, 4, 5), ("*", "-")))["solution"] == "12,7>7"


@pytest.mark.parametrize("task", [SMALL_TASK, ALL_OPS_TASK], ids=["add_sub", "add_sub_mul"])
def test_examples_have_correct_running_totals_in_range(task):
    for split in generate_splits(task).values():
        for example in split:
            operands, operators = parse_question(example["question"])
            assert task.num_terms_min <= len(operands) <= task.num_terms_max
            assert set(operators) <= set(task.ops)
            assert all(0 <= operand <= task.max_operand for operand in operands)
            total, totals = operands[0], []
            for op, operand in zip(operators, operands[1:], strict=True):
                total = _PY_OPERATORS[op](total, operand)
                totals.append(total)
            assert all(0 <= t <= task.max_result for t in [operands[0], *totals])
            assert example["prompt"] == example["question"] + "="
            assert example["solution"] == ",".join(map(str, totals)) + ">" + str(totals[-1])
            assert example["answer"] == str(totals[-1])


@pytest.mark.parametrize("task", [SMALL_TASK, ALL_OPS_TASK], ids=["add_sub", "add_sub_mul"])
def test_solutions_tokenize_and_earn_full_reward(task):
    tokenizer = CharTokenizer.for_arithmetic(task.ops)
    examples = generate_splits(task)["train"]
    for example in examples:
        text = example["prompt"] + example["solution"]
        assert tokenizer.decode(tokenizer.encode(text)) == text
    rewards = batch_rewards([e["solution"] for e in examples], [e["answer"] for e in examples])
    np.testing.assert_array_equal(rewards, np.ones(len(examples), dtype=np.float32))


# ------------------------------------------------------------------------ generation


def test_generation_is_deterministic_in_the_seed():
    assert generate_splits(SMALL_TASK) == generate_splits(SMALL_TASK)
    reseeded = ArithmeticTaskConfig(**{**SMALL_TASK.__dict__, "seed": SMALL_TASK.seed + 1})
    assert generate_splits(reseeded)["train"] != generate_splits(SMALL_TASK)["train"]


@pytest.mark.parametrize("task", [SMALL_TASK, ALL_OPS_TASK], ids=["add_sub", "add_sub_mul"])
def test_splits_have_requested_sizes_ids_and_no_shared_or_repeated_questions(task):
    splits = generate_splits(task)
    train = [e["question"] for e in splits["train"]]
    test = [e["question"] for e in splits["test"]]
    assert (len(train), len(test)) == (task.num_train, task.num_test)
    assert len(set(train)) == len(train)
    assert len(set(test)) == len(test)
    assert not set(train) & set(test)
    for split in splits.values():
        assert [e["id"] for e in split] == list(range(len(split)))


def test_test_split_does_not_depend_on_train_size():
    larger_train = ArithmeticTaskConfig(
        **{**SMALL_TASK.__dict__, "num_train": 2 * SMALL_TASK.num_train}
    )
    assert generate_splits(larger_train)["test"] == generate_splits(SMALL_TASK)["test"]


THREE_TERM_ALL_OPS_TASK = ArithmeticTaskConfig(
    num_terms_min=2, num_terms_max=3, max_operand=3, max_result=5, ops="+-*"
)


@pytest.mark.parametrize(
    "task", [TINY_TASK, THREE_TERM_ALL_OPS_TASK], ids=["tiny", "three_terms_all_ops"]
)
def test_question_count_and_enumeration_match_brute_force(task):
    expected = brute_force_questions(task)
    enumerated = [arithmetic.format_question(*q) for q in enumerate_questions(task)]
    assert sorted(enumerated) == sorted(expected)
    assert count_distinct_questions(task, limit=10**9) == len(expected)
    assert count_distinct_questions(task, limit=5) == 5


def test_requesting_every_distinct_question_uses_them_all():
    task = ArithmeticTaskConfig(**{**TINY_TASK.__dict__, "num_train": 20, "num_test": 6})
    splits = generate_splits(task)
    questions = {e["question"] for split in splits.values() for e in split}
    assert questions == brute_force_questions(TINY_TASK)


def test_requesting_more_questions_than_exist_is_a_clear_error():
    task = ArithmeticTaskConfig(**{**TINY_TASK.__dict__, "num_train": 20, "num_test": 7})
    with pytest.raises(ConfigError, match=f"only {TINY_TASK_QUESTION_COUNT} exist"):
        generate_splits(task)
    with pytest.raises(ConfigError, match=f"Requested 27 .* only {TINY_TASK_QUESTION_COUNT}"):
        check_enough_questions(task)
    assert check_enough_questions(TINY_TASK, count=TINY_TASK_QUESTION_COUNT) == 26


def test_too_many_questions_are_refused_before_tfds_prepares_anything(tmp_path, monkeypatch):
    task = ArithmeticTaskConfig(**{**TINY_TASK.__dict__, "num_train": 20, "num_test": 7})

    def fail_if_preparing(*_, **__):
        raise AssertionError("TFDS started preparing data the task cannot have")

    monkeypatch.setattr(arithmetic.ArithmeticReasoning, "download_and_prepare", fail_if_preparing)
    with pytest.raises(ConfigError, match=f"only {TINY_TASK_QUESTION_COUNT} exist"):
        load_split(task, "train", str(tmp_path))


def test_new_builders_leave_no_temporary_folders(tmp_path, monkeypatch):
    """TFDS's own DatasetInfo makes (and leaves) an empty tmp*tfds folder per builder made
    before its data is prepared, while it looks for the info on its GCS bucket."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    arithmetic.ArithmeticReasoning(
        config=builder_config_for(TINY_TASK),
        data_dir=str(tmp_path / "a"),
        file_format="array_record",
    )
    gsm8k.Gsm8k(data_dir=str(tmp_path / "g"), file_format="array_record")
    assert not list(temp.iterdir())


def test_train_py_reports_too_many_questions_in_one_line(tmp_path):
    workdir = tmp_path / "run"
    result = run_repo_script(
        "experiments/train.py",
        "--config=configs/arithmetic.py:smoke,task.num_train=100000",
        f"--workdir={workdir}",
        timeout=120,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: Requested 100016 distinct questions"), last_line
    assert not workdir.exists()  # the refused run removes the workdir it made


@pytest.mark.parametrize(
    "bad_fields, message",
    [
        ({"num_terms_min": 1}, r"num_terms_min=1: a question needs at least 2 terms"),
        ({"num_terms_max": 1}, r"num_terms_max=1 is below num_terms_min=2"),
        ({"ops": "+/"}, r"ops='\+/' must be a non-empty string of distinct operators"),
        ({"ops": "++"}, r"ops='\+\+' must be a non-empty string of distinct operators"),
        ({"ops": ""}, r"ops='' must be a non-empty string"),
        ({"max_operand": -1}, r"max_operand=-1 and max_result=\d+ must both be non-negative"),
        ({"num_test": 0}, r"num_test=0 must both be >= 1"),
        ({"sampling_max_fill_fraction": 0.0}, r"sampling_max_fill_fraction=0\.0 must be in"),
    ],
)
def test_invalid_task_configs_are_rejected(bad_fields, message):
    with pytest.raises(ConfigError, match=message):  # the launchers print it in one line
        ArithmeticTaskConfig(**bad_fields)


# --------------------------------------------------------------------------- builder


def test_builder_config_names_encode_every_parameter():
    names = {
        builder_config_for(ArithmeticTaskConfig(**{field: value})).name
        for field, value in [
            ("num_terms_min", 3), ("num_terms_max", 4), ("max_operand", 7), ("max_result", 9),
            ("ops", "+"), ("num_train", 11), ("num_test", 13), ("seed", 17),
            ("sampling_max_fill_fraction", 0.25), ("max_draws_per_example", 19),
        ]
    }  # fmt: skip
    names.add(builder_config_for(ArithmeticTaskConfig()).name)
    assert len(names) == 11
    assert builder_config_for(ArithmeticTaskConfig()) is arithmetic.DEFAULT_BUILDER_CONFIG
    assert builder_config_for(SMALL_TASK).name == builder_config_for(SMALL_TASK).name


_PREPARE_WITHOUT_TENSORFLOW = HIDE_TENSORFLOW + textwrap.dedent(
    """
    from tba_jax.data.arithmetic import ArithmeticTaskConfig, load_split

    task = ArithmeticTaskConfig(**json.loads(sys.argv[1]))
    splits = {split: load_split(task, split, sys.argv[2]) for split in ("train", "test")}
    assert "tensorflow" not in sys.modules
    print(json.dumps(splits))
    """
)


def test_builder_prepares_array_record_without_tensorflow_and_reads_back_exactly(tmp_path):
    task_json = json.dumps(SMALL_TASK.__dict__)
    completed = subprocess.run(
        [sys.executable, "-c", _PREPARE_WITHOUT_TENSORFLOW, task_json, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert completed.returncode == 0, completed.stderr
    read_back = json.loads(completed.stdout.strip().splitlines()[-1])
    assert read_back == generate_splits(SMALL_TASK)
    config_name = builder_config_for(SMALL_TASK).name
    for split, examples in read_back.items():
        data_source = tfds.data_source(
            f"arithmetic_reasoning/{config_name}", split=split, data_dir=str(tmp_path)
        )
        assert len(data_source) == len(examples)
        assert data_source[0]["prompt"].decode() == examples[0]["prompt"]
    record_files = sorted(p.name for p in tmp_path.rglob("*.array_record-*"))
    assert [name.split(".")[0] for name in record_files] == [
        "arithmetic_reasoning-test",
        "arithmetic_reasoning-train",
    ]


def test_load_split_reuses_prepared_data_and_rejects_unknown_splits(tmp_path, monkeypatch):
    task = ArithmeticTaskConfig(**{**SMALL_TASK.__dict__, "num_train": 40, "num_test": 10})
    first = load_split(task, "test", str(tmp_path))
    assert first == generate_splits(task)["test"]

    def fail_if_regenerated(_):
        raise AssertionError("load_split regenerated data that was already prepared")

    monkeypatch.setattr(arithmetic, "generate_splits", fail_if_regenerated)
    assert load_split(task, "test", str(tmp_path)) == first
    with pytest.raises(ValueError, match="Unknown split 'validation'"):
        load_split(task, "validation", str(tmp_path))


# ---------------------------------------------------------------------------- reward


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("68,61>61", "61", 1.0),
        ("68,61>62", "61", 0.0),
        ("68,61", "61", 0.0),
        ("61", "61", 0.0),
        ("68>68,61>61", "61", 1.0),
        ("68,61>61>60", "61", 0.0),
        ("68,61>61abc", "61", 0.0),
        ("68,61>61,62", "61", 0.0),
        ("68,61>  61 \n", "61", 1.0),
        ("68,61> 6 1", "61", 0.0),
        ("68,61>061", "61", 0.0),
        ("68,61>", "61", 0.0),
        ("68,61>+61", "61", 0.0),
        ("5>-3", "-3", 1.0),
        ("68,61>61", " 61 ", 1.0),
    ],
)
def test_reward_on_hand_written_responses(response, answer, expected):
    assert reward(response, answer) == expected


def test_reward_rejects_malformed_reference_answers():
    with pytest.raises(ValueError, match="not a well-formed integer"):
        reward("1>1", "one")


def test_batch_rewards_returns_float32_and_checks_lengths():
    rewards = batch_rewards(["1>1", "1>2", "no marker"], ["1", "1", "1"])
    assert rewards.dtype == np.float32
    np.testing.assert_array_equal(rewards, [1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        batch_rewards(["1>1", "2>2"], ["1"])
