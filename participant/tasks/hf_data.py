"""The Hugging Face task's text, tokenized and packed: numpy and the tokenizer only (and datasets, for a dataset), no
torch.

A document is a plain-text file, a record of a JSON-lines file (`.jsonl`, its `text_field`), or a row of a dataset:
a directory that `datasets`' `save_to_disk` wrote (a Dataset; or a DatasetDict, whose split a `@SPLIT` suffix names,
`DIR@validation`, default `train`) or a `.parquet` file, its `text_field` column in row order. Those two need the
`datasets` extra (imported only when one is given; read from disk, never downloaded, no pickle; the column is read a
batch of rows at a time, never the whole table). A directory is its files, sorted. The documents are tokenized with
the model's tokenizer, joined by its end-of-text token, and cut into non-overlapping sequences of `sequence_length`
tokens (the tail that does not fill one is dropped); the last tenth of the sequences (at least one) is held out. With
no files, the text is Python's own help topics (`lm_meta.corpus`, one document per topic), so that nothing is
downloaded and every host with the same Python release holds the same text (the byte-level task's corpus,
`lm_meta.corpus`, is the same text).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

TEST_DIVISOR = 10  # the last 1/10 of the sequences are held out
Encode = Callable[[list[str]], list[list[int]]]  # documents -> their token ids (a tokenizer's batch encoding)
# What `save_to_disk` writes (datasets.config's DATASET_STATE_JSON_FILENAME, DATASET_INFO_FILENAME and
# DATASETDICT_JSON_FILENAME): a Dataset's directory holds the first two, a DatasetDict's the third and a directory
# per split.
DATASET_FILES = ("state.json", "dataset_info.json")
DATASET_DICT_FILE = "dataset_dict.json"
DEFAULT_SPLIT = "train"
INSTALL = "pip install 'fedcoord[datasets]'"
BATCH_ROWS = 1024  # rows of a dataset's column turned into Python strings at a time


class TextError(ValueError):
    """Text that cannot be read or gives no sequence."""


def python_help() -> list[str]:
    """Python's help topics in sorted key order: the default text (ships with the interpreter)."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def read_documents(paths: Sequence[str], text_field: str = "text") -> list[str]:
    """The documents of plain-text and JSON-lines files, saved datasets (`DIR` or `DIR@SPLIT`) and Parquet files (a
    directory that is not a saved dataset: its files, sorted); TextError naming the file and line, or the dataset
    and row, of anything unreadable."""
    docs: list[str] = []
    for given in paths:
        path, split_name = _located(given)
        if _is_saved(path):
            docs.extend(_saved_dataset(path, split_name, text_field))
            continue
        if split_name is not None:
            raise TextError(f"{given}: @{split_name} names a split, but {path} is not a DatasetDict that datasets' "
                            f"save_to_disk wrote")
        for file in _files(path):
            if file.suffix == ".parquet":
                docs.extend(_parquet(file, text_field))
            else:
                docs.extend(_text_file(file, text_field))
    return docs


def _located(given: str) -> tuple[Path, str | None]:
    """(the path, the split its `@SPLIT` suffix names or None); a path that exists as given has no suffix."""
    path = Path(given).expanduser()
    if path.exists():
        return path, None
    head, at, split_name = given.rpartition("@")
    if at and head and split_name and "/" not in split_name and Path(head).expanduser().is_dir():
        return Path(head).expanduser(), split_name
    raise TextError(f"{given}: no such file or directory")


def _is_saved(path: Path) -> bool:
    """Whether `path` is a directory `save_to_disk` wrote (a DatasetDict's, or a Dataset's)."""
    return (path / DATASET_DICT_FILE).is_file() or all((path / name).is_file() for name in DATASET_FILES)


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    return [path]


def _text_file(path: Path, text_field: str) -> list[str]:
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TextError(f"{path}: cannot read it as UTF-8 text ({exc})") from None
    if path.suffix != ".jsonl":
        return [raw]
    docs: list[str] = []
    for number, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TextError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise TextError(f"{path}:{number}: no string field {text_field!r}")
        docs.append(record[text_field])
    return docs


def _datasets() -> Any:
    """The `datasets` module, quiet and offline (TextError saying what to install where it is missing)."""
    try:
        import datasets
    except ImportError:
        raise TextError(f"reading a saved dataset needs the datasets library: {INSTALL}") from None
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True  # never the hub, whatever the env
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _saved_dataset(path: Path, split_name: str | None, field: str) -> list[str]:
    """The `field` column of the Dataset `save_to_disk` wrote to `path`, or of the DatasetDict's split."""
    datasets = _datasets()
    try:
        loaded = datasets.load_from_disk(str(path.resolve()), keep_in_memory=False)  # memory-mapped Arrow
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TextError(f"{path}: cannot load it as a saved dataset ({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        name = split_name or DEFAULT_SPLIT
        if name not in loaded:
            raise TextError(f"{path}: no split {name!r}; its splits: {', '.join(loaded) or 'none'} (name one as "
                            f"{path}@SPLIT)")
        dataset, where = loaded[name], f"{path}@{name}"
    elif split_name is not None:
        raise TextError(f"{path}@{split_name}: {path} is a Dataset, which has no splits (give {path} alone)")
    else:
        dataset, where = loaded, str(path)
    if field not in dataset.column_names:
        raise TextError(f"{where}: no column {field!r}; its columns: {', '.join(dataset.column_names)}")
    column = dataset.select_columns([field]).with_format(None)
    return _strings(where, field, (batch[field] for batch in column.iter(batch_size=BATCH_ROWS)))


def _parquet(path: Path, field: str) -> list[str]:
    """The `field` column of a Parquet file, read with pyarrow (which datasets brings) a batch of rows at a time."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TextError(f"{path}: reading Parquet needs pyarrow, which the datasets extra brings: {INSTALL}") from None
    try:
        table = pq.ParquetFile(path)
        names = table.schema_arrow.names
        if field not in names:
            raise TextError(f"{path}: no column {field!r}; its columns: {', '.join(names)}")
        batches = table.iter_batches(batch_size=BATCH_ROWS, columns=[field])
        return _strings(str(path), field, (batch.column(0).to_pylist() for batch in batches))
    except TextError:
        raise
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
        raise TextError(f"{path}: cannot read it as Parquet ({exc})") from None


def _strings(where: str, field: str, batches: Iterable[list[Any]]) -> list[str]:
    """The column's values, each a string; TextError naming the first row (from 0) that holds anything else."""
    docs: list[str] = []
    for values in batches:
        for value in values:
            if not isinstance(value, str):
                kind = "null" if value is None else type(value).__name__
                raise TextError(f"{where}: row {len(docs)}: {field!r} is {kind}, not a string")
            docs.append(value)
    return docs


def pack(docs: Sequence[str], encode: Encode, eos: int | None, sequence_length: int) -> np.ndarray:
    """The documents' tokens, joined by `eos`, as (n, sequence_length) int64 rows; TextError if not one fills."""
    ids: list[int] = []
    for tokens in encode(list(docs)):
        ids.extend(tokens)
        if eos is not None:
            ids.append(eos)
    rows = len(ids) // sequence_length
    if rows < 1:
        raise TextError(f"{len(ids)} tokens do not fill one sequence of {sequence_length}")
    return np.asarray(ids[: rows * sequence_length], dtype=np.int64).reshape(rows, sequence_length)


def split(sequences: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out): the last tenth of the sequences (at least one) held out."""
    test = max(1, len(sequences) // TEST_DIVISOR)
    if len(sequences) - test < 1:
        raise TextError(f"{len(sequences)} sequence(s): too few to hold one out and train on the rest")
    return sequences[:-test], sequences[-test:]


def evenly_spaced(rows: np.ndarray, count: int) -> np.ndarray:
    """A fixed subset of `count` rows spread over all of them (0, or more than there are: all)."""
    if count <= 0 or count >= len(rows):
        return rows
    return rows[np.linspace(0, len(rows) - 1, count).round().astype(np.int64)]
