"""Shared machinery for TFDS builders backed by JSONL (or plain-text) source files.

`JsonlSourceBuilder` is an abstract ``tfds.core.GeneratorBasedBuilder`` that
writes array_record without TensorFlow, in the way ``tba_jax.data.arithmetic``
explains: ``_info`` builds ``tfds.core.DatasetInfo`` directly and ``code_path``
returns the concrete builder's own file. A concrete builder names its
features, its split files, the public URLs of those files (or none, for
manual-only data) and how one source record becomes one example.

Source files are found in this order:

1. the manual directory (``download_config.manual_dir``, or TFDS's default
   ``<download_dir>/manual``) when it exists and is non-empty; every split file
   must then be there;
2. otherwise the public URLs, through ``dl_manager.download``;
3. otherwise (no URLs) an error naming the files expected and where to put them.

Examples are written unshuffled with the record index as key, so the ``i``-th
record of a split is the ``i``-th record of its source file. TFDS prepares a
dataset once per version directory: after changing the source files, bump the
builder's ``VERSION`` or prepare into a fresh ``data_dir``.
"""

from __future__ import annotations

import abc
import inspect
import json
import socket
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

import numpy as np
import tensorflow_datasets as tfds
from absl import logging
from etils import epath

from tba_jax.config_lib import ConfigError

TEXT_ENCODING = "utf-8"


class SourceFileError(ConfigError):
    """A source file the user gave (in a manual directory) that cannot be read as the
    dataset expects: a line that is not a JSON object, a record without a required field.
    A ConfigError, so the launchers print it as one `error: ...` line."""


# ------------------------------------------------------------------- source files


def read_jsonl(path: epath.PathLike, required_fields: tuple[str, ...] = ()) -> list[dict]:
    """The JSON objects of a JSONL file, one per non-blank line.

    Raises SourceFileError naming the file and line of a malformed line or of a
    record without one of `required_fields`.
    """
    path = epath.Path(path)
    records = []
    for line_number, line in enumerate(read_source_text(path).splitlines(), 1):
        if not line.strip():
            continue
        record = parse_jsonl_line(line, path, line_number)
        check_required_fields(record, required_fields, path, line_number)
        records.append(record)
    return records


def read_source_text(path: epath.Path) -> str:
    """The text of a source file; SourceFileError if it is not UTF-8."""
    try:
        return path.read_text(encoding=TEXT_ENCODING)
    except UnicodeDecodeError as error:
        raise SourceFileError(
            f"{path} is not {TEXT_ENCODING} text (byte {error.start}: {error.reason}); "
            f"save it as {TEXT_ENCODING}."
        ) from None


def parse_jsonl_line(line: str, path: epath.Path, line_number: int) -> dict:
    """One JSONL line as a dict, or a SourceFileError saying where the file is broken."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise SourceFileError(
            f"{path}:{line_number} is not valid JSON ({error.msg}); each line of a JSONL "
            "file must hold one JSON object."
        ) from error
    if not isinstance(record, dict):
        raise SourceFileError(
            f"{path}:{line_number} holds a {type(record).__name__}, not a JSON object; "
            "each line of a JSONL file must hold one JSON object."
        )
    return record


def check_required_fields(
    record: dict, required_fields: tuple[str, ...], path: epath.Path, line_number: int
) -> None:
    """Raise SourceFileError naming the fields `record` lacks, if any."""
    missing = [field for field in required_fields if field not in record]
    if missing:
        raise SourceFileError(
            f"{path}:{line_number} lacks field(s) {missing}; every record needs "
            f"{list(required_fields)}."
        )


def check_text_fields(record: dict, fields: tuple[str, ...], what: str) -> None:
    """SourceFileError naming the first of `fields` whose value in `record` (`what`, e.g.
    "Problem 3") is not a string."""
    for field in fields:
        if not isinstance(record[field], str):
            raise SourceFileError(f"{what} has {field}={record[field]!r}; it must be a string.")


def read_text_lines(path: epath.PathLike) -> list[str]:
    """The non-blank lines of a text file, stripped of surrounding whitespace."""
    lines = read_source_text(epath.Path(path)).splitlines()
    return [line.strip() for line in lines if line.strip()]


# ------------------------------------------------------------ finding the sources


def ready_manual_dir(dl_manager: tfds.download.DownloadManager) -> epath.Path | None:
    """The manual directory when it exists and is non-empty, else None.

    TFDS signals a missing or empty manual directory (and one never configured)
    with an AssertionError from ``dl_manager.manual_dir``.
    """
    try:
        return dl_manager.manual_dir
    except AssertionError:
        return None


def no_manual_dir_message(expected_files: str, instructions: str) -> str:
    """The error text for a builder that found neither a manual directory nor URLs."""
    return (
        f"No manual directory with the source files was found; expected {expected_files}. "
        "Pass the directory holding them as `manual_dir` (or "
        f"`download_config=tfds.download.DownloadConfig(manual_dir=...)`).\n{instructions}"
    )


def missing_manual_files_message(
    manual_dir: epath.Path, missing: list[str], expected_files: str, instructions: str
) -> str:
    """The error text for a manual directory that lacks some source files."""
    if manual_dir.is_dir():
        return (
            f"Missing {', '.join(missing)} in manual directory {manual_dir}; expected "
            f"{expected_files}.\n{instructions}"
        )
    return (
        f"Manual directory {manual_dir} does not exist; it must hold {expected_files}.\n"
        f"{instructions}"
    )


def require_manual_files(
    manual_dir: epath.PathLike, filenames: Mapping[str, str], instructions: str
) -> dict[str, epath.Path]:
    """``{split: manual_dir / filename}``; FileNotFoundError naming any missing file."""
    manual_dir = epath.Path(manual_dir).expanduser()
    paths = {split: manual_dir / filename for split, filename in filenames.items()}
    missing = [path.name for path in paths.values() if not path.is_file()]
    if missing:
        expected_files = ", ".join(filenames.values())
        raise FileNotFoundError(
            missing_manual_files_message(manual_dir, missing, expected_files, instructions)
        )
    return paths


def check_hosts_resolve(urls: Iterable[str]) -> None:
    """socket.gaierror unless every URL's host resolves."""
    for host in sorted({urllib.parse.urlsplit(url).hostname for url in urls}):
        socket.getaddrinfo(host, None)


class SourceFilesUnavailableError(FileNotFoundError):
    """A dataset's source files are neither in a manual directory nor downloadable (the
    launchers report it as the one-line error of a missing file)."""


def download_files(
    dl_manager: tfds.download.DownloadManager, urls: Mapping[str, str], instructions: str
) -> dict[str, epath.Path]:
    """``{split: downloaded path}``; a download failure explains the manual route. A host
    that does not resolve (no network) fails at once, before TFDS's minutes of retries."""

    try:
        check_hosts_resolve(urls.values())
        return dl_manager.download(dict(urls))
    except OSError as error:  # socket.gaierror and requests' connection errors are OSErrors
        raise SourceFilesUnavailableError(
            f"Could not download {sorted(urls.values())} ({error}). Without network access, "
            f"download the files elsewhere and pass their directory as `manual_dir`.\n"
            f"{instructions}"
        ) from None


# ------------------------------------------------------------------------ builder


def as_python_value(value: Any) -> Any:
    """TFDS returns Text as bytes and integers as numpy scalars; make them str and int."""
    if isinstance(value, bytes):
        return value.decode(TEXT_ENCODING)
    if isinstance(value, np.integer):
        return int(value)
    return value


class LocalDatasetInfo(tfds.core.DatasetInfo):
    """The ``tfds.core.DatasetInfo`` of a dataset TFDS does not host. Before a builder's
    first preparation TFDS looks for its info on TFDS's GCS bucket
    (``initialize_from_bucket``), making an empty temporary folder each time that it never
    removes: one a new workdir, a hundred a test session. Here that look is skipped."""

    def initialize_from_bucket(self) -> None:
        """Nothing to load: these datasets are not on TFDS's bucket."""


class OwnPreparationNotice:
    """Mixed into a TFDS builder: one line of ours at INFO when a dataset is prepared,
    instead of the two bold lines TFDS prints to stdout whatever the log level
    ("Downloading and preparing dataset Unknown size (download: Unknown size, ...)" and
    "... Subsequent calls will reuse this data.")."""

    def _log_download_bytes(self) -> None:
        logging.info(
            "Preparing the %s dataset in %s (once: later runs reuse it).", self.name, self.data_dir
        )

    def _log_download_done(self) -> None:
        pass


class JsonlSourceBuilder(
    OwnPreparationNotice, tfds.core.GeneratorBasedBuilder, skip_registration=True
):
    """A builder whose splits each come from one JSONL file (see the module docstring).

    Subclasses set ``VERSION``, ``RELEASE_NOTES``, ``FEATURES``, ``SPLIT_FILES``,
    ``SOURCE_URLS`` (empty for manual-only data), ``MANUAL_DOWNLOAD_INSTRUCTIONS``
    and ``REQUIRED_FIELDS``, and implement `make_example`.
    """

    FEATURES: ClassVar[dict[str, Any]]
    SPLIT_FILES: ClassVar[dict[str, str]]
    SOURCE_URLS: ClassVar[dict[str, str]] = {}
    REQUIRED_FIELDS: ClassVar[tuple[str, ...]] = ()
    SUPERVISED_KEYS: ClassVar[tuple[str, str] | None] = None

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        """The concrete builder's file, returned directly (see tba_jax.data.arithmetic)."""
        return epath.Path(inspect.getfile(cls))

    @abc.abstractmethod
    def make_example(self, index: int, record: dict) -> dict:
        """The example (a dict matching ``FEATURES``) for the `index`-th source record."""

    def _info(self) -> tfds.core.DatasetInfo:
        return LocalDatasetInfo(
            builder=self,
            description=inspect.getdoc(type(self)).split("\n\n")[0],
            features=tfds.features.FeaturesDict(self.FEATURES),
            supervised_keys=self.SUPERVISED_KEYS,
            disable_shuffling=True,
        )

    def expected_files(self) -> str:
        """The source files a manual directory must hold, for error messages."""
        return ", ".join(self.SPLIT_FILES.values())

    def manual_source_paths(self, manual_dir: epath.PathLike) -> dict[str, epath.Path]:
        """``{split: source file}`` in `manual_dir`; FileNotFoundError if any is missing."""
        return require_manual_files(manual_dir, self.SPLIT_FILES, self.MANUAL_DOWNLOAD_INSTRUCTIONS)

    def source_paths(self, dl_manager: tfds.download.DownloadManager) -> dict[str, epath.Path]:
        """``{split: source file}``: the manual directory first, then the public URLs."""
        manual_dir = ready_manual_dir(dl_manager)
        if manual_dir is not None:
            return self.manual_source_paths(manual_dir)
        if self.SOURCE_URLS:
            return download_files(dl_manager, self.SOURCE_URLS, self.MANUAL_DOWNLOAD_INSTRUCTIONS)
        raise FileNotFoundError(
            no_manual_dir_message(self.expected_files(), self.MANUAL_DOWNLOAD_INSTRUCTIONS)
        )

    def read_records(self, path: epath.Path) -> list[dict]:
        """The source records of one split file."""
        return read_jsonl(path, self.REQUIRED_FIELDS)

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        return {
            split: self._generate_examples(path)
            for split, path in self.source_paths(dl_manager).items()
        }

    def _generate_examples(self, path: epath.Path) -> Iterator[tuple[int, dict]]:
        for index, record in enumerate(self.read_records(path)):
            yield index, self.example_from(path, index, record)

    def example_from(self, path: epath.Path, index: int, record: dict) -> dict:
        """`make_example`; a record it refuses gives a SourceFileError naming `path`."""
        try:
            return self.make_example(index, record)
        except SourceFileError as error:
            raise SourceFileError(f"{path}: {error}") from None


def prepare_builder(
    builder_cls: type[JsonlSourceBuilder],
    data_dir: epath.PathLike,
    manual_dir: epath.PathLike | None = None,
    config: tfds.core.BuilderConfig | None = None,
) -> JsonlSourceBuilder:
    """A builder whose array_record files exist under `data_dir`, preparing them if needed.

    An explicit `manual_dir` must hold every source file the builder needs when
    the data is not prepared yet; prepared data is reused without reading it.
    """
    builder = builder_cls(config=config, data_dir=str(data_dir), file_format="array_record")
    if builder.is_prepared():
        return builder
    download_config = None
    if manual_dir is not None:
        builder.manual_source_paths(manual_dir)  # Fail early, naming the missing files.
        download_config = tfds.download.DownloadConfig(manual_dir=str(manual_dir))
    builder.download_and_prepare(download_config=download_config)
    return builder


def read_prepared_split(builder: tfds.core.DatasetBuilder, split: str) -> list[dict]:
    """Every example of a prepared split, in record order, as plain Python values."""
    if split not in builder.info.splits:
        raise ValueError(
            f"Unknown split {split!r}; {builder.name} has splits {sorted(builder.info.splits)}."
        )
    data_source = builder.as_data_source(split=split)
    # One batched read: several times faster than indexing record by record.
    records = data_source.__getitems__(list(range(len(data_source))))
    return [{key: as_python_value(value) for key, value in record.items()} for record in records]


def load_split(
    builder_cls: type[JsonlSourceBuilder],
    split: str,
    data_dir: epath.PathLike,
    manual_dir: epath.PathLike | None = None,
    config: tfds.core.BuilderConfig | None = None,
) -> list[dict]:
    """Examples of `split`, preparing the array_record files under `data_dir` if needed."""
    builder = prepare_builder(builder_cls, data_dir, manual_dir, config)
    return read_prepared_split(builder, split)
