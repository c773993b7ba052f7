"""Built-in multi-step arithmetic task: generator and TFDS builder.

Each example is a left-to-right chain of non-negative integer operands, e.g.
question ``"23+45-7"``, prompt ``"23+45-7="``, solution ``"68,61>61"`` (the
running total after every operation, then the answer marker and the final
answer) and answer ``"61"``. Operands lie in ``[0, max_operand]`` and are chosen
so that every running total stays in ``[0, max_result]``.

Generation is deterministic in ``ArithmeticTaskConfig.seed``. The test split is
drawn first and the train split continues the same stream of distinct
questions, so the splits never share a question and the test split does not
depend on ``num_train``. When the requested examples fill at most
``sampling_max_fill_fraction`` of all distinct questions, questions are sampled
(number of terms uniform, then each operand uniform over its valid range) and
duplicates are redrawn; otherwise every distinct question is enumerated and
a seeded shuffle picks from them.

TFDS without TensorFlow: TFDS 4.9.10's ``GeneratorBasedBuilder`` serializes
examples with its own vendored copy of the ``tf.train.Example`` protos
(``tensorflow_datasets/proto/tf_example_pb2``, plain protobuf) and
``ArrayRecordDataSource`` decodes them with the numpy example parser, so
``download_and_prepare(file_format="array_record")`` and ``as_data_source()``
run without TensorFlow. ``ArithmeticReasoning`` is therefore an ordinary
builder; the only deviation from the usual template is that ``_info`` builds
``tfds.core.DatasetInfo`` directly instead of ``dataset_info_from_configs``,
which would read metadata files (README, citations) from this package's
directory, and that ``code_path`` is overridden to return this file: TFDS's own
lookup touches ``importlib_resources``, a backport TFDS 4.9.10 only declares for
Python < 3.9, and fails on newer Pythons for builders defined inside a package
(its fallback, used here, gives the same path). Examples are written
unshuffled, so record ``i`` has ``id == i``.
Bump ``ArithmeticReasoning.VERSION`` whenever the generator's output changes.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
import random
from collections.abc import Callable, Iterator
from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from tba_jax.config_lib import ConfigError
from tba_jax.data import builder_utils
from tba_jax.rewards.arithmetic import ANSWER_MARKER

PROMPT_SUFFIX = "="
TOTAL_SEPARATOR = ","
SPLITS = ("train", "test")

OPERATORS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}
OPERATOR_NAMES = {"+": "add", "-": "sub", "*": "mul"}

Question = tuple[tuple[int, ...], tuple[str, ...]]  # (operands, operators)


@dataclasses.dataclass(frozen=True)
class ArithmeticTaskConfig:
    """Parameters of the arithmetic task; every field changes the generated data.

    A ConfigError (a ValueError the launchers print as one line) for values that cannot
    work; `check_enough_questions` says whether the ranges hold enough distinct questions.
    """

    num_terms_min: int = 2
    num_terms_max: int = 3
    max_operand: int = 50
    max_result: int = 100
    ops: str = "+-"
    num_train: int = 20_000
    num_test: int = 500
    seed: int = 0
    # Sample-and-redraw while the requested examples fill at most this fraction of all
    # distinct questions; above it, enumerate them all (redrawing would stall).
    sampling_max_fill_fraction: float = 0.5
    # Sampling gives up after this many draws per requested example.
    max_draws_per_example: int = 100
    # Fraction of *train* solutions (the warm-start demonstrations) whose final answer
    # is the total before the last operation: the slip a weaker demonstrator makes.
    # Test examples and every `answer` field stay exact; rewards check `answer`.
    demo_error_rate: float = 0.0

    def __post_init__(self):
        if self.num_terms_min < 2:
            raise ConfigError(
                f"num_terms_min={self.num_terms_min}: a question needs at least 2 terms."
            )
        if self.num_terms_max < self.num_terms_min:
            raise ConfigError(
                f"num_terms_max={self.num_terms_max} is below "
                f"num_terms_min={self.num_terms_min}; set num_terms_max >= num_terms_min."
            )
        if self.max_operand < 0 or self.max_result < 0:
            raise ConfigError(
                f"max_operand={self.max_operand} and max_result={self.max_result} "
                "must both be non-negative."
            )
        unknown = sorted(set(self.ops) - set(OPERATORS))
        if not self.ops or unknown or len(set(self.ops)) != len(self.ops):
            raise ConfigError(
                f"ops={self.ops!r} must be a non-empty string of distinct operators "
                f"from {''.join(OPERATORS)!r}."
            )
        if self.num_train < 1 or self.num_test < 1:
            raise ConfigError(
                f"num_train={self.num_train} and num_test={self.num_test} must both be >= 1 "
                "(TFDS cannot write an empty split)."
            )
        if not 0.0 < self.sampling_max_fill_fraction <= 1.0:
            raise ConfigError(
                f"sampling_max_fill_fraction={self.sampling_max_fill_fraction} must be in (0, 1]."
            )
        if not 0.0 <= self.demo_error_rate <= 1.0:
            raise ConfigError(f"demo_error_rate={self.demo_error_rate} must be in [0, 1].")
        if self.max_draws_per_example < 1:
            raise ConfigError(f"max_draws_per_example={self.max_draws_per_example} must be >= 1.")


# ----------------------------------------------------------------------------- format


def running_totals(operands: tuple[int, ...], operators: tuple[str, ...]) -> list[int]:
    """The total after each operation, evaluating strictly left to right."""
    if len(operands) != len(operators) + 1:
        raise ValueError(
            f"Got {len(operands)} operands and {len(operators)} operators; "
            "a chain needs exactly one more operand than operators."
        )
    totals = []
    total = operands[0]
    for op, operand in zip(operators, operands[1:], strict=True):
        total = OPERATORS[op](total, operand)
        totals.append(total)
    return totals


def format_question(operands: tuple[int, ...], operators: tuple[str, ...]) -> str:
    """``(23, 45, 7), ("+", "-")`` -> ``"23+45-7"``."""
    pieces = [str(operands[0])]
    for op, operand in zip(operators, operands[1:], strict=True):
        pieces.append(op + str(operand))
    return "".join(pieces)


def format_solution(totals: list[int], final_answer: int | None = None) -> str:
    """``[68, 61]`` -> ``"68,61>61"``; `final_answer` replaces the number after ``>``."""
    final = totals[-1] if final_answer is None else final_answer
    return TOTAL_SEPARATOR.join(str(t) for t in totals) + ANSWER_MARKER + str(final)


def make_example(example_id: int, question: Question, *, flawed: bool = False) -> dict:
    """The example dict (id, question, prompt, solution, answer) for one question.

    A `flawed` example's solution ends with the total before the last operation
    (the first operand for a two-term question); its `answer` stays exact.
    """
    operands, operators = question
    totals = running_totals(operands, operators)
    question_text = format_question(operands, operators)
    before_last = ([operands[0], *totals])[-2]
    return {
        "id": example_id,
        "question": question_text,
        "prompt": question_text + PROMPT_SUFFIX,
        "solution": format_solution(totals, before_last if flawed else None),
        "answer": str(totals[-1]),
    }


# ------------------------------------------------------------------- question space


def operand_upper_bound(total: int, op: str, config: ArithmeticTaskConfig) -> int:
    """Largest operand b <= max_operand keeping ``total op b`` in [0, max_result].

    Every operand in ``[0, bound]`` is valid too, and 0 is always valid when
    ``total`` itself is in range, so a chain can always be extended.
    """
    if op == "+":
        return min(config.max_operand, config.max_result - total)
    if op == "-":
        return min(config.max_operand, total)
    if op == "*":
        return (
            config.max_operand
            if total == 0
            else min(config.max_operand, config.max_result // total)
        )
    raise ValueError(f"Unknown operator {op!r}; expected one of {''.join(OPERATORS)!r}.")


def first_operand_upper_bound(config: ArithmeticTaskConfig) -> int:
    """The first operand is itself a running total, so it obeys both limits."""
    return min(config.max_operand, config.max_result)


def count_distinct_questions(config: ArithmeticTaskConfig, limit: int) -> int:
    """min(number of distinct questions, limit), by dynamic programming over totals.

    Counts saturate at `limit` so huge question spaces cannot overflow; this is
    exact below the limit because every chain has at least one extension.
    """
    counts = np.zeros(config.max_result + 1, dtype=np.int64)
    counts[: first_operand_upper_bound(config) + 1] = 1
    total_questions = 0
    for num_terms in range(2, config.num_terms_max + 1):
        extended = np.zeros_like(counts)
        for total in np.flatnonzero(counts):
            for op in config.ops:
                operands = np.arange(operand_upper_bound(int(total), op, config) + 1)
                np.add.at(extended, OPERATORS[op](int(total), operands), counts[total])
        counts = np.minimum(extended, limit)
        if num_terms >= config.num_terms_min:
            total_questions = min(total_questions + int(counts.sum()), limit)
    return total_questions


def sample_question(rng: random.Random, config: ArithmeticTaskConfig) -> Question:
    """Number of terms uniform, each operator uniform, each operand uniform in its range."""
    num_terms = rng.randint(config.num_terms_min, config.num_terms_max)
    total = rng.randint(0, first_operand_upper_bound(config))
    operands, operators = [total], []
    for _ in range(num_terms - 1):
        op = rng.choice(config.ops)
        operand = rng.randint(0, operand_upper_bound(total, op, config))
        total = OPERATORS[op](total, operand)
        operands.append(operand)
        operators.append(op)
    return tuple(operands), tuple(operators)


def enumerate_questions(config: ArithmeticTaskConfig) -> Iterator[Question]:
    """Every distinct question, shortest chains first."""

    def extend(operands: tuple[int, ...], operators: tuple[str, ...], total: int, num_terms: int):
        if len(operands) == num_terms:
            yield operands, operators
            return
        for op in config.ops:
            for operand in range(operand_upper_bound(total, op, config) + 1):
                yield from extend(
                    (*operands, operand), (*operators, op), OPERATORS[op](total, operand), num_terms
                )

    for num_terms in range(config.num_terms_min, config.num_terms_max + 1):
        for first in range(first_operand_upper_bound(config) + 1):
            yield from extend((first,), (), first, num_terms)


def draw_distinct_by_sampling(config: ArithmeticTaskConfig, count: int) -> list[Question]:
    """`count` distinct sampled questions in draw order; redraws duplicates."""
    rng = random.Random(config.seed)
    seen: set[Question] = set()
    questions: list[Question] = []
    max_draws = count * config.max_draws_per_example
    for _ in range(max_draws):
        if len(questions) == count:
            break
        question = sample_question(rng, config)
        if question not in seen:
            seen.add(question)
            questions.append(question)
    if len(questions) < count:
        raise RuntimeError(
            f"Found only {len(questions)} of {count} distinct questions in {max_draws} draws; "
            "lower num_train/num_test, widen max_operand/max_result/num_terms, or lower "
            "sampling_max_fill_fraction so the enumerating path is used."
        )
    return questions


def draw_distinct_by_enumeration(config: ArithmeticTaskConfig, count: int) -> list[Question]:
    """`count` distinct questions from a seeded shuffle of all of them."""
    questions = list(enumerate_questions(config))
    random.Random(config.seed).shuffle(questions)
    return questions[:count]


def sampling_limit(config: ArithmeticTaskConfig, count: int) -> int:
    """Questions needed for `count` of them to fill at most sampling_max_fill_fraction."""
    return int(count / config.sampling_max_fill_fraction) + 1


def check_enough_questions(config: ArithmeticTaskConfig, count: int | None = None) -> int:
    """The distinct questions there are, counted up to `sampling_limit`; a ConfigError when
    fewer than `count` (default: both splits, num_train + num_test) exist.

    Cheap next to generating the data, so a task can call it before preparing anything.
    """
    count = config.num_train + config.num_test if count is None else count
    available = count_distinct_questions(config, limit=sampling_limit(config, count))
    if available < count:
        raise ConfigError(
            f"Requested {count} distinct questions (num_train={config.num_train} + "
            f"num_test={config.num_test}) but only {available} exist for "
            f"num_terms in [{config.num_terms_min}, {config.num_terms_max}], "
            f"max_operand={config.max_operand}, max_result={config.max_result}, "
            f"ops={config.ops!r}; lower the split sizes or widen the ranges."
        )
    return available


def draw_distinct_questions(config: ArithmeticTaskConfig, count: int) -> list[Question]:
    """`count` distinct questions, deterministic in the seed; errors if too few exist."""
    available = check_enough_questions(config, count)
    if available >= sampling_limit(config, count):
        return draw_distinct_by_sampling(config, count)
    return draw_distinct_by_enumeration(config, count)


def generate_splits(config: ArithmeticTaskConfig) -> dict[str, list[dict]]:
    """Examples of both splits; ids count from 0 within each split."""
    questions = draw_distinct_questions(config, config.num_test + config.num_train)
    test_questions = questions[: config.num_test]
    train_questions = questions[config.num_test :]
    flaw_rng = random.Random(f"{config.seed}-demo-errors")
    flawed = [flaw_rng.random() < config.demo_error_rate for _ in train_questions]
    return {
        "train": [
            make_example(i, q, flawed=f)
            for i, (q, f) in enumerate(zip(train_questions, flawed, strict=True))
        ],
        "test": [make_example(i, q) for i, q in enumerate(test_questions)],
    }


# ------------------------------------------------------------------------------ TFDS


@dataclasses.dataclass(eq=False)
class ArithmeticBuilderConfig(tfds.core.BuilderConfig):
    """A TFDS builder config carrying the task parameters it prepares."""

    task: ArithmeticTaskConfig = dataclasses.field(default_factory=ArithmeticTaskConfig)


def builder_config_name(task: ArithmeticTaskConfig) -> str:
    """A name encoding every task parameter, so each config prepares into its own dir."""
    op_names = "_".join(OPERATOR_NAMES[op] for op in task.ops)
    fill = str(task.sampling_max_fill_fraction).replace(".", "p")
    return (
        f"terms{task.num_terms_min}to{task.num_terms_max}_operand{task.max_operand}"
        f"_result{task.max_result}_ops_{op_names}_train{task.num_train}_test{task.num_test}"
        f"_seed{task.seed}_fill{fill}_draws{task.max_draws_per_example}"
        + (f"_flawed{str(task.demo_error_rate).replace('.', 'p')}" if task.demo_error_rate else "")
    )


def _new_builder_config(task: ArithmeticTaskConfig) -> ArithmeticBuilderConfig:
    return ArithmeticBuilderConfig(
        name=builder_config_name(task),
        description=f"Multi-step arithmetic: {task}",
        task=task,
    )


DEFAULT_BUILDER_CONFIG = _new_builder_config(ArithmeticTaskConfig())


def builder_config_for(task: ArithmeticTaskConfig) -> ArithmeticBuilderConfig:
    """The builder config for `task` (the registered one when it is the default).

    TFDS refuses a custom config that shares its name with a registered one, so
    the default task must map to the very object in ``BUILDER_CONFIGS``.
    """
    if task == DEFAULT_BUILDER_CONFIG.task:
        return DEFAULT_BUILDER_CONFIG
    return _new_builder_config(task)


class ArithmeticReasoning(builder_utils.OwnPreparationNotice, tfds.core.GeneratorBasedBuilder):
    """Multi-step arithmetic with worked solutions and verifiable final answers."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS: ClassVar[list[tfds.core.BuilderConfig]] = [DEFAULT_BUILDER_CONFIG]

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        """This file, returned directly (see the module docstring for why)."""
        return epath.Path(inspect.getfile(cls))

    def _info(self) -> tfds.core.DatasetInfo:
        return builder_utils.LocalDatasetInfo(
            builder=self,
            description=__doc__.split("\n\n")[0],
            features=tfds.features.FeaturesDict(
                {
                    "question": tfds.features.Text(),
                    "prompt": tfds.features.Text(),
                    "solution": tfds.features.Text(),
                    "answer": tfds.features.Text(),
                    "id": np.int64,
                }
            ),
            supervised_keys=("prompt", "solution"),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # Nothing to download: the data is generated.
        splits = generate_splits(self.builder_config.task)
        return {name: self._generate_examples(splits[name]) for name in SPLITS}

    def _generate_examples(self, examples: list[dict]):
        for example in examples:
            yield example["id"], example


def _as_python_example(record: dict) -> dict:
    """TFDS returns Text as bytes and ints as numpy scalars; make them str and int."""
    return {
        key: int(value) if key == "id" else value.decode("utf-8") for key, value in record.items()
    }


def load_split(task_config: ArithmeticTaskConfig, split: str, data_dir: str) -> list[dict]:
    """Examples of `split`, preparing the array_record files under `data_dir` if needed."""
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; the arithmetic task has splits {SPLITS}.")
    builder = ArithmeticReasoning(
        config=builder_config_for(task_config),
        data_dir=data_dir,
        file_format="array_record",
    )
    if not builder.is_prepared():
        check_enough_questions(task_config)  # a ConfigError before TFDS starts preparing
    builder.download_and_prepare()
    data_source = builder.as_data_source(split=split)
    # One batched read: several times faster than indexing record by record.
    records = data_source.__getitems__(list(range(len(data_source))))
    examples = [_as_python_example(record) for record in records]
    return sorted(examples, key=lambda example: example["id"])
