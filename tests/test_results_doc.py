"""The README's and docs/results.md's generated tables match the committed results."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _summarize():
    spec = importlib.util.spec_from_file_location("summarize", ROOT / "benchmarks/summarize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("doc", ["README.md", "docs/results.md"])
def test_generated_tables_are_fresh(doc):
    text = (ROOT / doc).read_text()
    assert "<!-- summarize:" in text, f"{doc} has no generated block"
    fresh = _summarize().update(text)
    assert fresh == text, (
        f"{doc} is stale: run python benchmarks/summarize.py --update {doc} and commit it"
    )


def test_a_changed_result_makes_the_doc_stale(tmp_path, monkeypatch):
    summarize = _summarize()
    text = (ROOT / "docs/results.md").read_text()
    results = tmp_path / "results"
    results.mkdir()
    for p in (ROOT / "benchmarks/results").glob("*.json"):
        (results / p.name).write_text(p.read_text().replace('"cgx"', '"cgx-renamed"'))
    monkeypatch.setattr(summarize, "RESULTS", results)
    assert summarize.update(text) != text
