"""Building a token corpus from pinned Debian packages, resumably.

[Note: building a Debian-docs corpus]
Each package is a unit of work whose result is cached, so a killed build continues from the next
package and a finished corpus is reused::

    per package (sorted by name):                       CACHE/downloads/<file>.deb
      fetch_deb -> pin.documents -> drop tiny ones       (sha256-checked, kept)
      -> tokenize each, streamed to disk ---------->    CACHE/debdocs-parts/<name>-<sha16>-<tok>.bin
                                                        + .json (per document: name, bytes, tokens)
    all parts' document names and sizes -> split_names (by document, hash order)
    -> train.bin / val.bin: documents in name order, each followed by eot
    -> meta.json (commit marker)                        CACHE/<corpus>-<tok>[-val<f>]/

A pin is a ``debpin.DebPin``: an HTML manual (``debdocs.DebPackage``, a document per page) or a
tree of text files (``debsource.DebSourceTree``, a document per file, e.g. the kernel's source).
A part's ``.bin`` is written as its documents are tokenized (in archive order, so a 400 M-token
package never sits in memory) under a temporary name, renamed when complete (a killed process's
partial one is removed when the package is built again: ``tokenfiles.remove_stale_tmp``); its
``.json`` is written after it and records the key it was made with (the ``.deb``'s sha256,
tokenizer, merge ranks, the pin's ``rules()`` with its extractor version); a part whose key or
``.bin`` size disagrees is made again. A document is named ``<package>/<path>``; the split
reads only those names and the documents' UTF-8 sizes, so it is the same for every tokenizer,
and no document is in both splits. Nothing machine-specific (paths, times) goes into
``meta.json``, so two builds of the same pins write the same bytes.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from .corpus import GPT2_RANKS_SHA256, Tokenizer, get_tokenizer, split_names, tokenizer_fields
from .debdocs import EXTRACTOR_VERSION, debian_mirror, fetch_deb
from .debpin import DebPin, Skipped
from .debsource import DebSourceTree
from .tokenfiles import DTYPE, is_prepared, remove_stale_tmp, tmp_name, write_tokens
from .tokenfiles import commit as commit_meta

__all__ = ["EXTRACTOR_VERSION", "DebCorpus", "prepare_deb_corpus"]

_PARTS = "debdocs-parts"


@dataclass(frozen=True, kw_only=True)
class DebCorpus:
    """A named corpus made of pinned Debian packages: their HTML manuals and text files."""

    name: str
    """The corpus' name; also the prefix of its directory in the cache."""
    packages: tuple[DebPin, ...]
    """The pinned packages; each page of a manual, each file of a source tree is a document."""
    val_fraction: float = 0.03
    """The default share of text (UTF-8 bytes) held out as val documents."""
    min_chars: int = 200
    """Documents with fewer characters of text than this are dropped (indexes, stubs)."""
    description: str = ""
    """One line on what the corpus is, for ``meta.json``."""

    def __post_init__(self) -> None:
        names = [p.name for p in self.packages]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"{self.name}: packages {names} must be non-empty and unique by name")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"{self.name}: val_fraction={self.val_fraction} must be in (0, 1)")


class _Report:
    """Progress: a tqdm bar per package on a terminal; elsewhere (a log) plain lines, one per
    package and one every ``every`` seconds while a long package is read."""

    def __init__(self, enabled: bool, file: IO[str] | None = None, every: float = 30.0) -> None:
        self.file = sys.stderr if file is None else file
        self.enabled = enabled
        self.tty = enabled and bool(getattr(self.file, "isatty", lambda: False)())
        self.every = every
        self.bar: Any = None
        self.desc, self.docs, self.tokens, self.t0, self.last = "", 0, 0, 0.0, 0.0

    def line(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.file, flush=True)

    def start(self, desc: str) -> None:
        self.desc, self.docs, self.tokens = desc, 0, 0
        self.t0 = self.last = time.monotonic()
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(desc=desc, unit="doc", file=self.file, dynamic_ncols=True)

    def tick(self, tokens: int) -> None:
        """One more document read, of ``tokens`` tokens (0 for a skipped one)."""
        self.docs, self.tokens = self.docs + 1, self.tokens + tokens
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled and (now := time.monotonic()) - self.last >= self.every:
            self.last = now
            self.line(
                f"  {self.desc}: {self.docs} read, {self.tokens:,} tokens, {now - self.t0:.0f} s"
            )

    def finish(self, text: str) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.line(text)


def _part_key(pkg: DebPin, corpus: DebCorpus, tok_name: str) -> dict[str, Any]:
    key = {
        "package": pkg.name,
        "version": pkg.version,
        "sha256": pkg.sha256,
        "tokenizer": tok_name,
        **pkg.rules(),
        "min_chars": corpus.min_chars,
    }
    if tok_name == "gpt2":
        key["ranks_sha256"] = GPT2_RANKS_SHA256
    return key


def _part_stem(cache_dir: Path, pkg: DebPin, tok_name: str) -> Path:
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
    pkg: DebPin,
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
    docs: list[dict[str, Any]] = []
    counts = {"too_small": 0, **dict.fromkeys(pkg.skip_reasons, 0)}
    names: set[str] = set()

    def encoded() -> Iterator[np.ndarray]:
        for doc in pkg.documents(deb):
            if isinstance(doc, Skipped):
                counts[doc.reason] += 1
                report.tick(0)
                continue
            if len(doc.text) < corpus.min_chars:
                counts["too_small"] += 1
                report.tick(0)
                continue
            name = f"{pkg.name}/{doc.path}"
            if name in names:
                raise ValueError(f"{deb} holds {doc.path} twice; is this the pinned package?")
            names.add(name)
            t = tok.encode(doc.text)
            if tok.name == "byte" and (t == tok.eot).any():
                raise ValueError(f"{name} contains byte {tok.eot:#04x}, the document separator")
            docs.append({"name": name, "bytes": len(doc.text.encode("utf-8")), "tokens": t.size})
            report.tick(t.size)
            yield t

    report.start(pkg.name)
    stem.parent.mkdir(parents=True, exist_ok=True)
    if freed := remove_stale_tmp(_with(stem, ".bin")):
        report.line(f"  {pkg.name}: removed {freed:,} bytes of a killed build's partial part")
    n = write_tokens(_with(stem, ".bin"), encoded())
    if not docs:
        _with(stem, ".bin").unlink()
        raise ValueError(
            f"{pkg.name} {pkg.version}: no document of >= {corpus.min_chars} characters "
            f"(skipped: {counts}); fix the pin's rules {pkg.rules()}"
        )
    part = {"key": key, "tokens": n, pkg.unit: len(docs), **counts, "documents": docs}
    _write_json(_with(stem, ".json"), part)
    dt = time.monotonic() - t0
    skipped = ", ".join(f"{v} {k}" for k, v in counts.items())
    report.finish(
        f"{corpus.name}: {pkg.name} {pkg.version}: {len(docs)} {pkg.unit}, {n:,} tokens "
        f"({skipped}) in {dt:.1f} s"
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
        val_fraction: the share of text held out as val documents (default
            ``corpus.val_fraction``).
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
    # A source tree's rules join the key; an HTML manual's are covered by extractor_version alone,
    # as before source trees existed, so debian-docs' key and prepared directories stay valid.
    if trees := {p.name: p.rules() for p in packages if isinstance(p, DebSourceTree)}:
        key["source_rules"] = trees
    suffix = "" if vf == corpus.val_fraction else f"-val{vf:g}"
    out = cache_dir / f"{corpus.name}-{tok_name}{suffix}"
    if is_prepared(out, key):
        return out
    report = _Report(progress)
    tok = get_tokenizer(tok_name, cache_dir=cache_dir)
    mirror = mirror or debian_mirror()
    parts = {p.name: _build_part(p, corpus, tok, cache_dir, mirror, report) for p in packages}
    # Where each document's tokens lie: (part file, first token, token count).
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
        in_split = Counter(where[x][0] for x in names)
        per_pkg = {p.name: in_split[p.name] for p in packages}
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
            "kind": "debian-packages",
            "corpus": corpus.name,
            "description": corpus.description,
            "packages": [
                {
                    "name": p.name,
                    "version": p.version,
                    "pool_path": p.pool_path,
                    "sha256": p.sha256,
                    "license": p.license,
                    p.unit: parts[p.name][p.unit],
                    "tokens": parts[p.name]["tokens"],
                    **{r: parts[p.name][r] for r in ("too_small", *p.skip_reasons)},
                    "rules": p.rules(),
                }
                for p in packages
            ],
            "min_chars": corpus.min_chars,
            "extractor_version": EXTRACTOR_VERSION,
        },
        split_rule="by document: sha256('qsdp-split/'+package/path) order, val = shortest prefix "
        "reaching val_fraction of the UTF-8 text",
        val_fraction=vf,
    )
    return done
