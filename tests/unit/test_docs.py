"""The README shows the transition table as the code has it."""

from pathlib import Path

from shared.machine import transition_table


def test_readme_shows_the_current_transition_table() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert transition_table() in readme, "README's transition table is stale: paste shared.machine.transition_table()"
