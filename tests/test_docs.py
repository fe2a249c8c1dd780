"""Every reference the code makes to the docs (a docs file, then § and a heading) names a heading
that exists, so a reader can follow it and a renamed heading fails here instead of leaving a dead
link."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
REFERENCE = re.compile(r"docs/(algorithms|metrics)\.md[`]?\s+§([A-Z][\w-]*(?: [\w-]+)*)")


def headings(name: str) -> set[str]:
    return {line[3:].strip() for line in (REPO / "docs" / f"{name}.md").read_text().splitlines() if line.startswith("## ")}


def references() -> list[tuple[str, str, str]]:
    found = []
    for folder in ("tierspec", "tests", "benchmarks"):
        for path in sorted((REPO / folder).rglob("*.py")):
            # Comments wrap: a reference may continue on the next line after a "# " or indentation.
            text = re.sub(r"\s*\n\s*(?:# )?", " ", path.read_text())
            found += [(str(path.relative_to(REPO)), doc, words) for doc, words in REFERENCE.findall(text)]
    return found


def test_the_code_refers_to_the_docs():
    assert len(references()) >= 25  # the references that replaced the old design document's


@pytest.mark.parametrize("where, doc, words", references())
def test_every_reference_names_a_heading(where, doc, words):
    # The reference's words run into the sentence after the heading's name: a heading must start them.
    assert any(words == h or words.startswith(h + " ") for h in headings(doc)), f"{where}: docs/{doc}.md §{words}"
