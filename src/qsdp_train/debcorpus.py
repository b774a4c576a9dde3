"""Building a token corpus from pinned Debian documentation packages, resumably.

[Note: building a Debian-docs corpus]
Each package is a unit of work whose result is cached, so a killed build continues from the next
package and a finished corpus is reused::

    per package (sorted by name):                       CACHE/downloads/<file>.deb
      fetch_deb -> package_pages -> drop tiny pages      (sha256-checked, kept)
      -> tokenize each page ----------------------->    CACHE/debdocs-parts/<name>-<sha16>-<tok>.bin
                                                        + .json (per page: name, bytes, tokens)
    all parts' page names and sizes -> split_names (by document, hash order)
    -> train.bin / val.bin: pages in name order, each followed by eot
    -> meta.json (commit marker)                        CACHE/<corpus>-<tok>[-val<f>]/

A part's ``.json`` is written after its ``.bin`` and records the key it was made with (the
``.deb``'s sha256, tokenizer, merge ranks, extraction rules, ``EXTRACTOR_VERSION``); a part whose
key or ``.bin`` size disagrees is made again. A document is a page, named ``<package>/<path>``;
the split reads only those names and the pages' UTF-8 sizes, so it is the same for every
tokenizer, and no page is in both splits. Nothing machine-specific (paths, times) goes into
``meta.json``, so two builds of the same pins write the same bytes.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from .corpus import GPT2_RANKS_SHA256, Tokenizer, get_tokenizer, split_names, tokenizer_fields
from .debdocs import DebPackage, PageText, debian_mirror, fetch_deb, package_pages
from .tokenfiles import DTYPE, is_prepared, tmp_name, write_tokens
from .tokenfiles import commit as commit_meta

__all__ = ["EXTRACTOR_VERSION", "DebCorpus", "prepare_deb_corpus"]

#: Bump when ``debdocs.html_to_text`` or the page rules change: cached parts are then remade.
EXTRACTOR_VERSION = 1
_PARTS = "debdocs-parts"


@dataclass(frozen=True, kw_only=True)
class DebCorpus:
    """A named corpus made of the HTML manuals of pinned Debian packages."""

    name: str
    """The corpus' name; also the prefix of its directory in the cache."""
    packages: tuple[DebPackage, ...]
    """The pinned packages; each page of their manuals is one document."""
    val_fraction: float = 0.03
    """The default share of text (UTF-8 bytes) held out as val documents."""
    min_chars: int = 200
    """Pages with fewer characters of text than this are dropped (indexes, stubs)."""
    description: str = ""
    """One line on what the corpus is, for ``meta.json``."""

    def __post_init__(self) -> None:
        names = [p.name for p in self.packages]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"{self.name}: packages {names} must be non-empty and unique by name")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"{self.name}: val_fraction={self.val_fraction} must be in (0, 1)")


class _Report:
    """Progress: a tqdm bar per package on a terminal, one plain line per package elsewhere."""

    def __init__(self, enabled: bool, file: IO[str] | None = None) -> None:
        self.file = sys.stderr if file is None else file
        self.enabled = enabled
        self.tty = enabled and bool(getattr(self.file, "isatty", lambda: False)())
        self.bar: Any = None

    def line(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.file, flush=True)

    def start(self, desc: str) -> None:
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(desc=desc, unit="page", file=self.file, dynamic_ncols=True)

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def finish(self, text: str) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.line(text)


def _part_key(pkg: DebPackage, corpus: DebCorpus, tok_name: str) -> dict[str, Any]:
    key = {
        "package": pkg.name,
        "version": pkg.version,
        "sha256": pkg.sha256,
        "tokenizer": tok_name,
        "extractor_version": EXTRACTOR_VERSION,
        "html_root": pkg.html_root,
        "main": list(pkg.main),
        "exclude": pkg.exclude,
        "min_chars": corpus.min_chars,
    }
    if tok_name == "gpt2":
        key["ranks_sha256"] = GPT2_RANKS_SHA256
    return key


def _part_stem(cache_dir: Path, pkg: DebPackage, tok_name: str) -> Path:
    return cache_dir / _PARTS / f"{pkg.name}-{pkg.sha256[:16]}-{tok_name}"


def _with(stem: Path, ext: str) -> Path:
    # Not Path.with_suffix: package names hold dots ("python3.13-doc").
    return stem.with_name(stem.name + ext)


def _read_part(stem: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    try:
        part = json.loads(_with(stem, ".json").read_text())
        ok = part["key"] == key and _with(stem, ".bin").stat().st_size == 2 * part["tokens"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return part if ok else None


def _build_part(
    pkg: DebPackage,
    corpus: DebCorpus,
    tok: Tokenizer,
    cache_dir: Path,
    mirror: str,
    report: _Report,
) -> dict[str, Any]:
    key = _part_key(pkg, corpus, tok.name)
    stem = _part_stem(cache_dir, pkg, tok.name)
    if (part := _read_part(stem, key)) is not None:
        report.line(f"{corpus.name}: {pkg.name} {pkg.version}: cached ({part['tokens']:,} tokens)")
        return part
    t0 = time.monotonic()
    report.line(f"{corpus.name}: {pkg.name} {pkg.version}: fetching and reading")
    deb = fetch_deb(pkg, cache_dir, mirror=mirror)
    docs, ids, counts = [], [], {"links_skipped": 0, "no_main": 0, "too_small": 0}
    report.start(pkg.name)
    for page in package_pages(deb, pkg):
        report.tick()
        if not isinstance(page, PageText):
            counts["links_skipped"] += 1
            continue
        if page.text is None:
            counts["no_main"] += 1
            continue
        if len(page.text) < corpus.min_chars:
            counts["too_small"] += 1
            continue
        name = f"{pkg.name}/{page.path}"
        t = tok.encode(page.text)
        if tok.name == "byte" and (t == tok.eot).any():
            raise ValueError(f"{name} contains byte {tok.eot:#04x}, the document separator")
        docs.append({"name": name, "bytes": len(page.text.encode("utf-8")), "tokens": t.size})
        ids.append(t)
    if not docs:
        raise ValueError(
            f"{pkg.name} {pkg.version}: no page under {pkg.html_root!r} has a main element "
            f"{pkg.main} with >= {corpus.min_chars} characters; fix the pin's html_root or main"
        )
    order = sorted(range(len(docs)), key=lambda i: docs[i]["name"])
    docs, ids = [docs[i] for i in order], [ids[i] for i in order]
    stem.parent.mkdir(parents=True, exist_ok=True)
    n = write_tokens(_with(stem, ".bin"), iter(ids))
    part = {"key": key, "tokens": n, "pages": len(docs), **counts, "documents": docs}
    _write_json(_with(stem, ".json"), part)
    report.finish(
        f"{corpus.name}: {pkg.name} {pkg.version}: {len(docs)} pages, {n:,} tokens "
        f"({counts['too_small']} tiny, {counts['no_main']} without main, "
        f"{counts['links_skipped']} links skipped) in {time.monotonic() - t0:.1f} s"
    )
    return part


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = tmp_name(path)
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)


def prepare_deb_corpus(
    corpus: DebCorpus,
    tok_name: str,
    cache_dir: Path,
    val_fraction: float | None = None,
    *,
    mirror: str | None = None,
    progress: bool = False,
) -> Path:
    """Prepare ``corpus`` once (nanoGPT format); see [Note: building a Debian-docs corpus].

    Args:
        corpus: the packages and rules.
        tok_name: ``"byte"`` or ``"gpt2"``.
        cache_dir: the cache root.
        val_fraction: the share of text held out as val pages (default ``corpus.val_fraction``).
        mirror: the Debian mirror root (default ``$QSDP_DEBIAN_MIRROR`` or deb.debian.org).
        progress: report per package on stderr (a tqdm bar on a terminal).

    Returns:
        The directory holding ``train.bin``, ``val.bin`` and ``meta.json``.
    """
    vf = corpus.val_fraction if val_fraction is None else val_fraction
    packages = sorted(corpus.packages, key=lambda p: p.name)
    key: dict[str, Any] = {
        "corpus": corpus.name,
        "packages": [[p.name, p.version, p.sha256] for p in packages],
        "tokenizer": tok_name,
        "val_fraction": vf,
        "min_chars": corpus.min_chars,
        "extractor_version": EXTRACTOR_VERSION,
    }
    if tok_name == "gpt2":
        key["ranks_sha256"] = GPT2_RANKS_SHA256
    suffix = "" if vf == corpus.val_fraction else f"-val{vf:g}"
    out = cache_dir / f"{corpus.name}-{tok_name}{suffix}"
    if is_prepared(out, key):
        return out
    report = _Report(progress)
    tok = get_tokenizer(tok_name, cache_dir=cache_dir)
    mirror = mirror or debian_mirror()
    parts = {p.name: _build_part(p, corpus, tok, cache_dir, mirror, report) for p in packages}
    # Where each page's tokens lie: (part file, first token, token count).
    where: dict[str, tuple[str, int, int]] = {}
    sizes: dict[str, int] = {}
    for pkg_name, part in parts.items():
        offset = 0
        for d in part["documents"]:
            where[d["name"]] = (pkg_name, offset, d["tokens"])
            sizes[d["name"]] = d["bytes"]
            offset += d["tokens"]
    train, val = split_names(sizes, vf)
    tokens = {
        p.name: np.memmap(_with(_part_stem(cache_dir, p, tok_name), ".bin"), dtype=DTYPE, mode="r")
        for p in packages
    }
    eot = np.array([tok.eot], dtype=DTYPE)

    def chunks(names: list[str]) -> Iterator[np.ndarray]:
        for name in names:
            pkg_name, first, count = where[name]
            yield tokens[pkg_name][first : first + count]
            yield eot

    out.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, names in (("train", train), ("val", val)):
        n = write_tokens(out / f"{split}.bin", chunks(names))
        per_pkg = {p.name: sum(1 for x in names if where[x][0] == p.name) for p in packages}
        splits[split] = {
            "tokens": n,
            "n_documents": len(names),
            "documents_per_package": per_pkg,
            "documents": [{"name": x, "tokens": where[x][2] + 1} for x in names],
        }

    done = commit_meta(
        out,
        key,
        splits,
        **tokenizer_fields(tok),
        source={
            "kind": "debian-docs",
            "corpus": corpus.name,
            "description": corpus.description,
            "packages": [
                {
                    "name": p.name,
                    "version": p.version,
                    "pool_path": p.pool_path,
                    "sha256": p.sha256,
                    "license": p.license,
                    "pages": parts[p.name]["pages"],
                    "tokens": parts[p.name]["tokens"],
                    "too_small": parts[p.name]["too_small"],
                    "no_main": parts[p.name]["no_main"],
                    "links_skipped": parts[p.name]["links_skipped"],
                }
                for p in packages
            ],
            "min_chars": corpus.min_chars,
            "extractor_version": EXTRACTOR_VERSION,
        },
        split_rule="by page: sha256('qsdp-split/'+package/path) order, val = shortest prefix "
        "reaching val_fraction of the UTF-8 text",
        val_fraction=vf,
    )
    return done
