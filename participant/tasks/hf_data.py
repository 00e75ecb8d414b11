"""The Hugging Face task's text, tokenized and packed: numpy and the tokenizer only, no torch.

A document is a plain-text file, or a record of a JSON-lines file (`.jsonl`, its `text_field`). The documents are
tokenized with the model's tokenizer, joined by its end-of-text token, and cut into non-overlapping sequences of
`sequence_length` tokens (the tail that does not fill one is dropped); the last tenth of the sequences (at least
one) is held out. With no files, the text is Python's own help topics (`lm_meta.corpus`, one document per topic),
so that nothing is downloaded and every host with the same Python release holds the same text (the byte-level
task's corpus, `lm_meta.corpus`, is the same text).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

TEST_DIVISOR = 10  # the last 1/10 of the sequences are held out
Encode = Callable[[list[str]], list[list[int]]]  # documents -> their token ids (a tokenizer's batch encoding)


class TextError(ValueError):
    """Text that cannot be read or gives no sequence."""


def python_help() -> list[str]:
    """Python's help topics in sorted key order: the default text (ships with the interpreter)."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def read_documents(paths: Sequence[str], text_field: str = "text") -> list[str]:
    """The documents of plain-text and JSON-lines files (a directory: its files, sorted); TextError naming the file
    and line of anything unreadable."""
    docs: list[str] = []
    for path in _files(paths):
        try:
            raw = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TextError(f"{path}: cannot read it as UTF-8 text ({exc})") from None
        if path.suffix != ".jsonl":
            docs.append(raw)
            continue
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


def _files(paths: Iterable[str]) -> list[Path]:
    files: list[Path] = []
    for given in paths:
        path = Path(given).expanduser()
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file()))
        elif path.is_file():
            files.append(path)
        else:
            raise TextError(f"{given}: no such file or directory")
    return files


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
