"""The Hugging Face task's text as a `datasets` dataset: a directory `save_to_disk` wrote (a Dataset, or a DatasetDict's
split named by `DIR@SPLIT`) or a Parquet file, its `text_field` column in row order. Built here, nothing downloaded."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest

from participant.tasks import hf_data
from participant.tasks.hf_data import TextError, read_documents
from tests.functional.conftest import hf_local_task

DOCS = [f"def f{i}(x):\n    return x * {i}\n" * 20 for i in range(30)]
OTHER = [f"class C{i}:\n    size = {i}\n" * 20 for i in range(12)]
INSTALL = r"pip install 'fedcoord\[datasets\]'"


@pytest.fixture(autouse=True)
def _quiet() -> None:
    datasets.disable_progress_bars()


def saved(directory: Path, dataset: datasets.Dataset | datasets.DatasetDict, num_shards: int | None = None) -> str:
    dataset.save_to_disk(str(directory), num_shards=num_shards)
    return str(directory)


def rows(docs: list[str]) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"body": docs, "n": list(range(len(docs)))})


def test_a_saved_dataset_and_a_parquet_file_give_their_rows_in_order(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the documents as a Dataset saved in 3 shards, and as a Parquet file of row groups of 7 rows
    directory = saved(tmp_path / "saved", rows(DOCS), num_shards=3)
    parquet = tmp_path / "docs.parquet"
    rows(DOCS).to_parquet(str(parquet), batch_size=7)
    monkeypatch.setattr(hf_data, "BATCH_ROWS", 4)  # the column is read 4 rows at a time

    # Then each reads as the rows' "body", in row order, and both together one after the other
    assert read_documents([directory], "body") == DOCS
    assert read_documents([str(parquet)], "body") == DOCS
    assert read_documents([directory, str(parquet)], "body") == DOCS + DOCS
    # and a directory of Parquet files (with other text) reads each file, sorted
    shards = tmp_path / "shards"
    shards.mkdir()
    rows(DOCS[:10]).to_parquet(str(shards / "a.parquet"))
    (shards / "b.txt").write_text("plain")
    rows(DOCS[10:]).to_parquet(str(shards / "c.parquet"))
    assert read_documents([str(shards)], "body") == DOCS[:10] + ["plain"] + DOCS[10:]
    # and datasets was kept off the hub
    assert datasets.config.HF_HUB_OFFLINE is True


def test_a_dataset_dicts_split_is_named_by_at_and_train_is_the_default(tmp_path: Path) -> None:
    # Given a DatasetDict with a train and a validation split, and a Dataset
    both = saved(tmp_path / "dict", datasets.DatasetDict(train=rows(DOCS), validation=rows(OTHER)))
    one = saved(tmp_path / "one", rows(DOCS))

    # Then the directory alone is its train split, DIR@validation the other
    assert read_documents([both], "body") == DOCS
    assert read_documents([f"{both}@validation"], "body") == OTHER
    assert read_documents([f"{both}@train", f"{both}@validation"], "body") == DOCS + OTHER
    # and a split it does not hold is refused, naming the splits there are
    with pytest.raises(TextError, match=r"dict: no split 'test'; its splits: train, validation"):
        read_documents([f"{both}@test"], "body")
    # as is a DatasetDict without a train split, given alone
    only = saved(tmp_path / "only", datasets.DatasetDict(validation=rows(OTHER)))
    with pytest.raises(TextError, match=r"only: no split 'train'; its splits: validation"):
        read_documents([only], "body")
    # and a split of what has none: a Dataset, a plain directory, a missing path
    with pytest.raises(TextError, match=r"one is a Dataset, which has no splits"):
        read_documents([f"{one}@train"], "body")
    (tmp_path / "plain").mkdir()
    with pytest.raises(TextError, match=r"@train names a split, but .*plain is not a DatasetDict"):
        read_documents([f"{tmp_path / 'plain'}@train"], "body")
    with pytest.raises(TextError, match=r"nowhere@train: no such file or directory"):
        read_documents([f"{tmp_path / 'nowhere'}@train"], "body")


@pytest.mark.parametrize("form", ["saved", "parquet"])
def test_a_missing_column_or_a_value_that_is_no_string_is_refused_naming_it(tmp_path: Path, form: str) -> None:
    # Given a dataset whose "text" holds a null at row 2 and whose "n" holds integers
    table = datasets.Dataset.from_dict({"text": ["a", "b", None, "d"], "n": [1, 2, 3, 4]})
    if form == "saved":
        path = saved(tmp_path / "bad", table)
    else:
        path = str(tmp_path / "bad.parquet")
        table.to_parquet(path)

    # Then each problem is refused, naming the path, the row and the column
    with pytest.raises(TextError, match=r"bad(\.parquet)?: row 2: 'text' is null, not a string"):
        read_documents([path], "text")
    with pytest.raises(TextError, match=r"bad(\.parquet)?: row 0: 'n' is int, not a string"):
        read_documents([path], "n")
    with pytest.raises(TextError, match=r"bad(\.parquet)?: no column 'body'; its columns: text, n"):
        read_documents([path], "body")


def test_a_parquet_file_that_is_not_one_is_refused(tmp_path: Path) -> None:
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    with pytest.raises(TextError, match=r"broken.parquet: cannot read it as Parquet"):
        read_documents([str(broken)])


def test_without_datasets_installed_the_error_says_what_to_install(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a saved dataset and a Parquet file, on a host where neither datasets nor pyarrow can be imported
    directory = saved(tmp_path / "saved", rows(DOCS))
    parquet = tmp_path / "docs.parquet"
    rows(DOCS).to_parquet(str(parquet))
    for name in ("datasets", "pyarrow", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError

    # Then reading either says what to install
    with pytest.raises(TextError, match=rf"needs the datasets library: {INSTALL}"):
        read_documents([directory], "body")
    with pytest.raises(TextError, match=rf"docs.parquet: reading Parquet needs pyarrow.*: {INSTALL}"):
        read_documents([str(parquet)], "body")


def test_a_saved_dataset_packs_the_sequences_its_json_lines_would(hf_model: Path, tmp_path: Path) -> None:
    # Given the same documents as a host's JSON-lines file, a DatasetDict's split, and a Parquet file
    lines = tmp_path / "mine.jsonl"
    lines.write_text("\n".join(json.dumps({"body": doc}) for doc in DOCS))
    split = saved(tmp_path / "mine", datasets.DatasetDict(train=rows(OTHER), validation=rows(DOCS))) + "@validation"
    parquet = tmp_path / "mine.parquet"
    rows(DOCS).to_parquet(str(parquet))

    # When the task loads each as local data (field "body")
    packed = []
    for source in (str(lines), split, str(parquet)):
        task = hf_local_task(hf_model, text_field="body")
        assert len(task.local_data(source)) == task.train_size > 10
        packed.append(task._own)

    # Then each packs exactly the same training sequences
    assert np.array_equal(packed[0], packed[1]) and np.array_equal(packed[0], packed[2])
    # and as the run's shared text (assigned mode) a dataset is the same text as its JSON lines
    from_lines = hf_local_task(hf_model, text=(str(lines),), text_field="body")._shared
    from_split = hf_local_task(hf_model, text=(split,), text_field="body")._shared
    assert all(np.array_equal(a, b) for a, b in zip(from_lines, from_split, strict=True))
