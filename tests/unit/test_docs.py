"""The docs show the transition table as the code has it, and their relative links lead somewhere."""

import re
from pathlib import Path

import pytest

from shared.machine import transition_table

REPO = Path(__file__).resolve().parents[2]
GUIDES = ["README.md", "docs/protocol.md", "docs/architecture.md", "docs/deploy.md", "benchmarks/README.md",
          "participant/README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_protocol_shows_the_current_transition_table() -> None:
    protocol = (REPO / "docs" / "protocol.md").read_text()
    assert transition_table() in protocol, (
        "docs/protocol.md's transition table is stale: paste shared.machine.transition_table()")


def test_readme_stays_a_guide() -> None:
    # The README says what the project is and how to run it; figures live in benchmarks/README.md
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) < 12 * 1024
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", readme), "dated measurements belong in benchmarks/README.md"


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings (outside code blocks)."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        text = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", GUIDES)
def test_relative_links_lead_to_a_file_and_heading(page: str) -> None:
    source = REPO / page
    for target in LINK.findall(source.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (source.parent / path).resolve() if path else source
        assert linked.exists(), f"{page}: link to {target}: no such file"
        if anchor:
            assert anchor in anchors(linked.read_text()), f"{page}: link to {target}: no such heading"
