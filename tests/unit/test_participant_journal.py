"""The participant's progress file: what survives its restarts."""

from __future__ import annotations

from pathlib import Path

from participant.journal import Journal, JournalFile


def test_round_trip(tmp_path: Path) -> None:
    f = JournalFile(tmp_path / "state", "a-run", "alice")
    journal, why = f.load()
    assert why == "" and journal.uploaded == {} and journal.training is None
    journal.joined_at = 1700000000.25
    journal.uploaded[3] = {"digest": "d" * 64, "samples": 359}
    journal.training = {"round": 4, "digest": "e" * 64}
    journal.outcomes[3] = "accepted"
    journal.witnessed[3] = {"complete": True, "attested": ["alice", "bob"], "at": 1700000001.0}
    journal.health_reported[2] = ["carol"]
    f.save(journal)
    again, why = f.load()
    assert why == "" and again == journal
    assert again.uploaded_rounds == frozenset({3})
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["progress.json"]  # no temporary files left


def test_another_participants_or_runs_file_is_not_used(tmp_path: Path) -> None:
    JournalFile(tmp_path, "a-run", "bob").save(Journal("a-run", "bob", uploaded={1: {}}))
    journal, why = JournalFile(tmp_path, "a-run", "alice").load()
    assert journal.uploaded == {} and "belongs to bob@a-run" in why


def test_a_corrupt_file_starts_afresh_with_a_reason(tmp_path: Path) -> None:
    (tmp_path / "progress.json").write_text("{not json")
    journal, why = JournalFile(tmp_path, "a-run", "alice").load()
    assert journal.uploaded == {} and "unreadable" in why
