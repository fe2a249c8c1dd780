"""Every reference the code makes to the docs (a docs file, then § and a heading) names a heading
that exists, so a reader can follow it and a renamed heading fails here instead of leaving a dead
link."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
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


# ---- results/: the runs BENCHMARKS.md quotes, and nothing else ------------------------------------

CITED = re.compile(r"results/([\w.\-]+)((?:/[\w.\-]+)*)")
DOCUMENTS = ("BENCHMARKS.md", "README.md", "masks/README.md", "docs/algorithms.md", "docs/metrics.md",
             "docs/structured.md", "docs/robustness.md", "docs/engine.md", "docs/models.md")


def cited_results() -> dict[str, set[str]]:
    """Per document, the ``results/...`` paths it names (a trailing full stop is the sentence's)."""
    return {name: {(top + rest).rstrip(".") for top, rest in CITED.findall((REPO / name).read_text())}
            for name in DOCUMENTS if (REPO / name).exists()}


def tracked_results() -> set[str]:
    """Top-level entries of ``results/`` in the repository (results/ is gitignored: only what was
    added on purpose is tracked)."""
    import subprocess

    try:
        listed = subprocess.run(["git", "ls-files", "results"], cwd=REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return {line.split("/")[1] for line in listed.stdout.splitlines() if line.count("/") >= 1}


def test_every_run_benchmarks_cites_exists():
    missing = sorted(path for path in cited_results()["BENCHMARKS.md"] if not (REPO / "results" / path).exists())
    assert not missing, f"BENCHMARKS.md cites results that are not in results/: {missing}"


def test_every_run_kept_in_results_is_cited():
    cited = {path.split("/")[0] for paths in cited_results().values() for path in paths}
    uncited = sorted(tracked_results() - cited)
    assert not uncited, f"results/ keeps runs no document cites (cite them in BENCHMARKS.md or git rm them): {uncited}"
