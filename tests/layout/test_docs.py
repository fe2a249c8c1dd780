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


# ---- results/ and benchmarks/: what the documents cite exists, and nothing else is kept ----------

#: ``results/...`` and ``benchmarks/X.py`` as the documents write them; a path right after ``commit:``
#: (``git show 65086ed^:benchmarks/dimr_sweep.py``) names a file in git history, not in the tree.
CITED_RESULT = re.compile(r"(?<![\w.:/-])results/([\w.\-]+)((?:/[\w.\-]+)*)")
CITED_SCRIPT = re.compile(r"(?<![\w.:/-])benchmarks/([\w\-]+\.py)")
#: A script named alone in a sentence about ``benchmarks/`` (docs/bench.md: "e.g. `pass_cost.py`").
NAMED_SCRIPT = re.compile(r"`([\w\-]+\.py)`")
#: ``--out results/X`` in a command the reader runs (docs/bench.md's ``results/my-run``): where their
#: run goes, not a run kept. BENCHMARKS.md is exempt from this: its commands made the runs it quotes.
WRITTEN_BY_THE_READER = re.compile(r"--out\s+results/([\w.\-]+)")
#: Folders a document names as where a script writes, with no run of it kept.
WRITTEN_NOT_KEPT = {"gpu_check": "benchmarks/gpu_check.py's output on a machine with a GPU (docs/bench.md)"}
HISTORY = "docs/history.md"


def documents() -> list[str]:
    """The documents whose citations keep a run or a script: README.md, BENCHMARKS.md, masks/README.md
    and docs/*.md — but docs/history.md, which names runs removed from results/ (see
    ``test_history_names_what_its_commits_hold``)."""
    docs = sorted(str(path.relative_to(REPO)) for path in (REPO / "docs").glob("*.md"))
    return ["README.md", "BENCHMARKS.md", "masks/README.md"] + [doc for doc in docs if doc != HISTORY]


def cited_results(text: str, exempt_outputs: bool = True) -> set[str]:
    """The ``results/...`` paths ``text`` cites (a trailing full stop is the sentence's), less those its
    commands write (``--out``) when ``exempt_outputs`` and those named in ``WRITTEN_NOT_KEPT``."""
    written = set(WRITTEN_BY_THE_READER.findall(text)) if exempt_outputs else set()
    return {(top + rest).rstrip(".") for top, rest in CITED_RESULT.findall(text)
            if top.rstrip(".") not in written | set(WRITTEN_NOT_KEPT)}


def cited_scripts(text: str) -> set[str]:
    """The benchmark scripts ``text`` names: ``benchmarks/X.py``, or ``X.py`` alone where that is one."""
    named = {name for name in NAMED_SCRIPT.findall(text) if (REPO / "benchmarks" / name).is_file()}
    return set(CITED_SCRIPT.findall(text)) | named


def git(*args: str, stdin: str | None = None) -> str:
    import subprocess

    try:
        done = subprocess.run(["git", *args], cwd=REPO, input=stdin, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return done.stdout


def tracked_results() -> set[str]:
    """Every file under ``results/`` that the repository tracks, and every folder above one."""
    files = [line[len("results/"):] for line in git("ls-files", "results").splitlines()]
    return {"/".join(parts[:i]) for parts in (f.split("/") for f in files) for i in range(1, len(parts) + 1)}


def read(name: str) -> str:
    return (REPO / name).read_text()


def test_every_run_the_documents_cite_is_kept():
    kept = tracked_results()
    missing = sorted(f"{doc}: results/{path}" for doc in documents()
                     for path in cited_results(read(doc), exempt_outputs=doc != "BENCHMARKS.md") if path not in kept)
    assert not missing, f"cited but not in results/ (cite the history, docs/history.md, instead): {missing}"


def test_every_run_kept_in_results_is_cited():
    cited = {path.split("/")[0] for doc in documents() for path in cited_results(read(doc), doc != "BENCHMARKS.md")}
    uncited = sorted({path.split("/")[0] for path in tracked_results()} - cited)
    assert not uncited, f"results/ keeps runs no document cites (cite them or git rm them): {uncited}"


def test_every_script_the_documents_cite_exists():
    missing = sorted(f"{doc}: benchmarks/{name}" for doc in documents()
                     for name in CITED_SCRIPT.findall(read(doc)) if not (REPO / "benchmarks" / name).is_file())
    assert not missing, f"cited scripts that benchmarks/ does not hold: {missing}"


def test_every_benchmark_script_is_cited():
    cited = set().union(*(cited_scripts(read(doc)) for doc in documents()))
    uncited = sorted(path.name for path in (REPO / "benchmarks").glob("*.py") if path.name not in cited)
    assert not uncited, f"benchmark scripts no document cites (cite them where their runs are, or git rm them): {uncited}"


def history_entries() -> list[tuple[str, set[str], set[str]]]:
    """docs/history.md's entries (its ``###`` sections): (heading, the commits it names in backticks,
    the ``results/`` and ``benchmarks/`` paths it names)."""
    entries = []
    for section in re.split(r"^### ", read(HISTORY), flags=re.M)[1:]:
        heading = section.splitlines()[0]
        commits = set(re.findall(r"`([0-9a-f]{7,40})`", section))
        paths = {f"results/{path}" for path in cited_results(section, exempt_outputs=False)}
        entries.append((heading, commits, paths | {f"benchmarks/{name}" for name in CITED_SCRIPT.findall(section)}))
    return entries


def test_history_names_what_its_commits_hold():
    """Every run or script a history entry names is in the tree at one of the commits the entry
    names: a reader can ``git show`` it there."""
    entries = history_entries()
    assert len(entries) >= 20 and all(commits for _, commits, _ in entries), [h for h, c, _ in entries if not c]
    every_commit = sorted({commit for _, commits, _ in entries for commit in commits})
    present = git("cat-file", "--batch-check", stdin="".join(f"{c}^{{commit}}\n" for c in every_commit))
    absent = {line.split()[0].split("^")[0] for line in present.splitlines() if line.endswith("missing")}
    if absent and git("rev-parse", "--is-shallow-repository").strip() == "true":
        pytest.skip(f"a shallow checkout: commits {sorted(absent)} are not here")
    assert not absent, f"docs/history.md names commits this repository does not have: {sorted(absent)}"
    queries = [(heading, path, f"{commit}:{path}") for heading, commits, paths in entries
               for path in sorted(paths) for commit in sorted(commits)]
    answers = git("cat-file", "--batch-check", stdin="".join(f"{q}\n" for _, _, q in queries)).splitlines()
    found = {(heading, path) for (heading, path, _), answer in zip(queries, answers) if not answer.endswith("missing")}
    lost = sorted({(heading, path) for heading, path, _ in queries} - found)
    assert not lost, f"docs/history.md names paths none of the entry's commits hold: {lost}"


def test_the_citation_rules_on_planted_text():
    text = ("See `results/engine_spec_bench` and results/judge/head.safetensors. Run "
            "`tierspec bench --out results/my-run` or `git show 65086ed^:results/dimr/summary.md`; "
            "`python benchmarks/gpu_check.py` writes results/gpu_check/summary.md, e.g. `pass_cost.py`, `app.py`.")
    assert cited_results(text) == {"engine_spec_bench", "judge/head.safetensors"}
    assert cited_results(text, exempt_outputs=False) == {"engine_spec_bench", "judge/head.safetensors", "my-run"}
    assert cited_scripts(text) == {"gpu_check.py", "pass_cost.py"}  # app.py is no benchmark script
    assert cited_scripts("`git show 65086ed^:benchmarks/dimr_sweep.py`") == set()


def test_gitignore_ignores_nothing_tracked():
    """.gitignore is true to what is tracked: no tracked file matches it (results/ is tracked)."""
    assert git("ls-files", "--cached", "--ignored", "--exclude-standard") == ""
