"""The README's and docs/results.md's generated tables match the committed results, and every
results file the docs cite is in the tree (or cited at the commit that last had it)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from .bench_scripts import load

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks/results"


@pytest.mark.parametrize("doc", ["README.md", "docs/results.md"])
def test_generated_tables_are_fresh(doc):
    text = (ROOT / doc).read_text()
    assert "<!-- summarize:" in text, f"{doc} has no generated block"
    fresh = load("summarize").update(text)
    assert fresh == text, (
        f"{doc} is stale: run python benchmarks/summarize.py --update {doc} and commit it"
    )


def test_a_changed_result_makes_the_doc_stale(tmp_path, monkeypatch):
    summarize = load("summarize")
    text = (ROOT / "docs/results.md").read_text()
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    for p in results.rglob("*.json"):
        p.write_text(p.read_text().replace('"cgx"', '"cgx-renamed"'))
    monkeypatch.setattr(summarize, "RESULTS", results)
    assert summarize.update(text) != text


# a backquoted path into benchmarks/results, `<study>_<date>[...]/...` (or a file named with its
# date), with or without the benchmarks/results/ prefix; what follows it says whether it is
# cited at an older commit
_CITED = re.compile(
    r"`(benchmarks/results/|\.\./)?([\w.+-]*_20\d\d-\d\d-\d\d\w*(?:\.[\w.]+)?(?:/[^`\s]*)?)`"
)
_AT_COMMIT = re.compile(r"\s*,?\s+at\s+commit\b")


def _docs():
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted(RESULTS.rglob("README.md")),
    ]


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_results_are_in_the_tree(doc):
    text = doc.read_text().split("\n## Not in the tree\n")[0]  # what left the tree, by design
    # a study's README may name its own subfolders, or (../) its neighbours
    here = doc.parent if doc.is_relative_to(RESULTS) else RESULTS
    missing = []
    for m in _CITED.finditer(text):
        prefix, path = m.groups()
        if not prefix and "/" not in path and "." in path:
            continue  # a bare file name: its folder is given by the sentence
        if _AT_COMMIT.match(text, m.end()):
            continue  # cited where git keeps it
        bases = {"../": [here.parent], "benchmarks/results/": [RESULTS]}.get(
            prefix, [RESULTS, here]
        )
        if not any(any(base.glob(path.rstrip("/"))) for base in bases):
            missing.append(path)
    assert not missing, f"{doc.relative_to(ROOT)} cites results not in the tree: {missing}"
