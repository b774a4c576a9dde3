"""Token data for ``qsdp train``: prepared once into nanoGPT's format, read back as batches.

[Note: the prepared format]
A prepared directory holds nanoGPT's ``train.bin`` and ``val.bin`` (flat little-endian uint16
tokens, read with ``np.memmap``) and a ``meta.json`` (tokenizer, vocab_size, source and its
sha256, per-split documents and token counts, ``format_version``)::

    prepare_data(None)     -> CACHE/shakespeare-<tokenizer>/  the built-in corpus (corpus.py)
    prepare_data(None, corpus="debian-docs")
                           -> CACHE/debian-docs-<tokenizer>/  Debian manuals (debcorpus.py)
    prepare_data(None, corpus="debian-large")
                           -> CACHE/debian-large-<tokenizer>/ + the kernel's source, more manuals
    prepare_data("a.txt")  -> CACHE/a-<key>-<tokenizer>/      one document; its last
    prepare_data("a.bin")  -> CACHE/a-<key>-<tokenizer>/      val_fraction of tokens is val
    prepare_data("dir/")   -> CACHE/dir-<key>-<tokenizer>/    links to dir/{train,val}.bin
    open_data(path) -> TokenData -> Batches(data).train_batch(...) / .val_batches(...)

``CACHE`` is ``$QSDP_DATA_DIR`` or ``~/.cache/qsdp``; ``<key>`` hashes the absolute path, size,
mtime, tokenizer and val_fraction. In the built-in corpus each document is followed by the
tokenizer's ``eot`` token (byte: 0x04, gpt2: ``<|endoftext|>``), as nanoGPT does.

Every file is written to a temporary name in its directory and moved into place with
``os.replace``; ``meta.json`` goes last and is the commit marker. A directory whose ``meta.json``
is missing, stale or disagrees with the file sizes is prepared again, so a crash leaves nothing
that is read, and two concurrent preparers write the same bytes and both succeed.

Nothing is loaded with pickle (nanoGPT's ``meta.pkl`` is ignored; a ``meta.json`` is read).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .batches import Batches
from .corpora import get_corpus
from .corpus import (
    GPT2_RANKS_SHA256,
    SHAKESPEARE,
    TOKENIZERS,
    Sdist,
    default_cache_dir,
    get_tokenizer,
    shakespeare_documents,
    split_documents,
    tokenizer_fields,
)
from .debcorpus import DebCorpus, prepare_deb_corpus
from .tokenfiles import DTYPE as _DTYPE
from .tokenfiles import FORMAT_VERSION
from .tokenfiles import commit as _commit
from .tokenfiles import is_prepared as _is_prepared
from .tokenfiles import link as _link
from .tokenfiles import read_meta as _read_meta
from .tokenfiles import write_tokens as _write_tokens

__all__ = ["FORMAT_VERSION", "Batches", "TokenData", "open_data", "prepare_data"]

# (re-exported: the batches of a prepared directory live in batches.py)

_CHUNK = 1 << 24  # tokens per read/write when copying token files


# ---------------------------------------------------------------------------------------------
# Preparing


def prepare_data(
    data: str | os.PathLike[str] | None,
    tokenizer: str | None = None,
    *,
    cache_dir: Path | None = None,
    val_fraction: float | None = None,
    corpus: str | Sdist | DebCorpus = SHAKESPEARE,
    progress: bool = False,
) -> Path:
    """Prepare token data once (nanoGPT format) and return its directory.

    Args:
        data: ``None`` for the built-in Shakespeare corpus; else a UTF-8 ``.txt`` file (one
            document), a ``.bin`` file of uint16 tokens, or a directory holding ``train.bin`` and
            ``val.bin``.
        tokenizer: ``"byte"`` or ``"gpt2"``. Default: ``"byte"`` for the corpus and ``.txt``; for
            token files, the ``tokenizer`` of a ``meta.json`` beside them, and for a ``.bin``
            without one, none (raw ids). A directory needs it given or in its ``meta.json``.
        cache_dir: the cache root (default ``$QSDP_DATA_DIR`` or ``~/.cache/qsdp``).
        val_fraction: the share of tokens for val, in (0, 1); the corpus splits by work (see
            ``corpus.split_documents``), a ``.txt`` or ``.bin`` gives its last tokens. Ignored for
            a directory, which is already split. Default: 0.1, or a ``DebCorpus``'s own.
        corpus: with ``data=None``, the built-in corpus: a name in ``corpora.CORPORA``
            (``"shakespeare"``, ``"debian-docs"``, ``"debian-large"``) or pins (tests pass fake
            ones).
        progress: report per package on stderr while building a Debian corpus.

    Returns:
        The directory holding ``train.bin``, ``val.bin`` and ``meta.json``.
    """
    if val_fraction is not None and not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1); try 0.1")
    if tokenizer is not None and tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; use one of {sorted(TOKENIZERS)}")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if isinstance(corpus, str):
        corpus = get_corpus(corpus)
    if data is None and isinstance(corpus, DebCorpus):
        return prepare_deb_corpus(
            corpus, tokenizer or "byte", cache_dir, val_fraction, progress=progress
        )
    val_fraction = 0.1 if val_fraction is None else val_fraction
    if data is None:
        return _prepare_corpus(tokenizer or "byte", cache_dir, val_fraction, corpus)
    path = Path(data).expanduser().absolute()
    if not path.exists():
        raise FileNotFoundError(
            f"data path {path} does not exist; pass a UTF-8 .txt file, a .bin file of uint16 "
            "tokens, a directory with train.bin and val.bin, or no path for the built-in corpus"
        )
    if path.is_dir():
        return _prepare_dir(path, tokenizer, cache_dir)
    if path.suffix == ".txt":
        return _prepare_txt(path, tokenizer or "byte", cache_dir, val_fraction)
    if path.suffix == ".bin":
        return _prepare_bin(path, tokenizer, cache_dir, val_fraction)
    raise ValueError(
        f"data path {path} is neither a .txt file, a .bin file nor a directory; rename it or "
        "convert it to one of these"
    )


def _prepare_corpus(tok_name: str, cache_dir: Path, val_fraction: float, corpus: Sdist) -> Path:
    key: dict[str, Any] = {
        "source": corpus.requirement,
        "sha256": corpus.sha256,
        "tokenizer": tok_name,
        "val_fraction": val_fraction,
    }
    if tok_name == "gpt2":
        key["ranks_sha256"] = GPT2_RANKS_SHA256
    suffix = "" if val_fraction == 0.1 else f"-val{val_fraction:g}"
    out = cache_dir / f"{corpus.name}-{tok_name}{suffix}"
    if _is_prepared(out, key):
        return out
    tok = get_tokenizer(tok_name, cache_dir=cache_dir)
    docs = shakespeare_documents(cache_dir, sdist=corpus)
    out.mkdir(parents=True, exist_ok=True)
    eot = np.array([tok.eot], dtype=np.int64)
    splits = {}
    for split, part in zip(("train", "val"), split_documents(docs, val_fraction), strict=True):
        ids = [tok.encode(d.text) for d in part]
        for d, t in zip(part, ids, strict=True):
            if tok.name == "byte" and (t == tok.eot).any():
                raise ValueError(f"{d.file} contains byte {tok.eot:#04x}, the document separator")
        n = _write_tokens(out / f"{split}.bin", (a for t in ids for a in (t, eot)))
        splits[split] = {
            "tokens": n,
            "documents": [
                {"name": d.name, "file": d.file, "tokens": int(t.size) + 1}
                for d, t in zip(part, ids, strict=True)
            ],
        }
    return _commit(
        out,
        key,
        splits,
        **tokenizer_fields(tok),
        source={
            "kind": "corpus",
            "package": corpus.requirement,
            "file": corpus.filename,
            "sha256": corpus.sha256,
            "license": "works: public domain (Project Gutenberg etexts, boilerplate removed); "
            "package: MIT code, CC-BY 2.5 other content (its COPYING.txt)",
            "boilerplate_stripped": [d.file for d in docs if d.stripped],
        },
        split_rule="by work: sha256('qsdp-split/'+name) order, val = shortest prefix "
        "reaching val_fraction of the UTF-8 text",
        val_fraction=val_fraction,
    )


def _user_out(path: Path, tok_name: str | None, cache_dir: Path, val_fraction: float) -> Path:
    # Keyed by every input file's size and mtime: an edited file is prepared anew.
    names = ("train.bin", "val.bin", "meta.json") if path.is_dir() else (path.name, "meta.json")
    folder = path if path.is_dir() else path.parent
    ident = [str(path), str(tok_name), repr(val_fraction)]
    for p in (folder / n for n in names if (folder / n).exists()):
        st = p.stat()
        ident += [p.name, str(st.st_size), str(st.st_mtime_ns)]
    digest = hashlib.sha256("\n".join(ident).encode()).hexdigest()[:12]
    return cache_dir / f"{path.stem or 'data'}-{digest}-{tok_name or 'raw'}"


def _prepare_txt(path: Path, tok_name: str, cache_dir: Path, val_fraction: float) -> Path:
    out = _user_out(path, tok_name, cache_dir, val_fraction)
    key = {"path": str(path), "tokenizer": tok_name, "val_fraction": val_fraction}
    if _is_prepared(out, key):
        return out
    raw = path.read_bytes()
    if not raw:
        raise ValueError(f"{path} is empty; give it some text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path} is not UTF-8 (byte {e.start}: {e.reason}); convert it, e.g. with iconv"
        ) from e
    tok = get_tokenizer(tok_name, cache_dir=cache_dir)
    ids = tok.encode(text)
    source = {"kind": "txt", "path": str(path), "bytes": len(raw)}
    return _write_split(out, key, ids, val_fraction, tok_name, tok.vocab_size, source, path.stem)


def _sibling_meta(path: Path) -> dict[str, Any]:
    file = path / "meta.json" if path.is_dir() else path.with_name("meta.json")
    if not file.exists():
        return {}
    meta = _read_meta(file.parent)
    if meta is None:
        raise ValueError(f"{file} is not a JSON object; fix or remove it")
    return meta


def _token_meta(path: Path, tokenizer: str | None) -> tuple[str | None, int | None]:
    """The tokenizer and vocab size for token files: given, else from a meta.json beside them."""
    meta = _sibling_meta(path)
    meta_tok, vocab = meta.get("tokenizer"), meta.get("vocab_size")
    if tokenizer is not None and meta_tok is not None and meta_tok != tokenizer:
        raise ValueError(
            f"tokenizer={tokenizer!r} but the meta.json of {path} says {meta_tok!r}; "
            "pass the tokenizer that made these tokens (or none)"
        )
    tok_name = tokenizer or meta_tok
    if tok_name is not None and tok_name not in TOKENIZERS:
        raise ValueError(
            f"unknown tokenizer {tok_name!r} in the meta.json of {path}; "
            f"use one of {sorted(TOKENIZERS)}"
        )
    if vocab is not None and (not isinstance(vocab, int) or not 0 < vocab <= 65536):
        raise ValueError(
            f"vocab_size={vocab} in the meta.json of {path} cannot be stored as uint16 "
            "tokens (1..65536); these are not nanoGPT-format tokens"
        )
    if vocab is None and tok_name is not None:
        vocab = TOKENIZERS[tok_name]
    return tok_name, vocab


def _open_tokens(path: Path) -> np.memmap:
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{path} is empty; it should hold uint16 tokens")
    if size % 2:
        raise ValueError(
            f"{path} has {size} bytes, not a multiple of 2, so it is not a file of uint16 "
            "tokens (nanoGPT format); was it truncated?"
        )
    return np.memmap(path, dtype=_DTYPE, mode="r")


def _max_token(tokens: np.ndarray) -> int:
    return max(int(tokens[i : i + _CHUNK].max()) for i in range(0, tokens.size, _CHUNK))


def _prepare_bin(path: Path, tokenizer: str | None, cache_dir: Path, val_fraction: float) -> Path:
    tok_name, vocab = _token_meta(path, tokenizer)
    out = _user_out(path, tok_name, cache_dir, val_fraction)
    key = {"path": str(path), "tokenizer": tok_name, "val_fraction": val_fraction}
    if _is_prepared(out, key):
        return out
    tokens = _open_tokens(path)
    vocab = vocab or _max_token(tokens) + 1
    source = {"kind": "bin", "path": str(path), "bytes": 2 * tokens.size}
    return _write_split(out, key, tokens, val_fraction, tok_name, vocab, source, path.stem)


def _write_split(
    out: Path,
    key: dict[str, Any],
    tokens: np.ndarray,
    val_fraction: float,
    tok_name: str | None,
    vocab: int,
    source: dict[str, Any],
    doc: str,
) -> Path:
    n = tokens.size
    n_val = int(round(n * val_fraction))
    if n_val < 1 or n - n_val < 1:
        raise ValueError(
            f"{source['path']} has {n} tokens; val_fraction={val_fraction} leaves an empty "
            "split; give it more text"
        )
    if (top := _max_token(tokens)) >= vocab:
        raise ValueError(
            f"{source['path']} holds token {top} but vocab_size is {vocab}; fix the "
            "vocab_size in its meta.json or pass the right tokenizer"
        )
    out.mkdir(parents=True, exist_ok=True)
    cut = n - n_val
    spans = {"train": (0, cut), "val": (cut, n)}
    splits = {}
    for split, (a, b) in spans.items():
        chunks = (tokens[i : min(i + _CHUNK, b)] for i in range(a, b, _CHUNK))
        count = _write_tokens(out / f"{split}.bin", chunks)
        splits[split] = {"tokens": count, "documents": [{"name": doc, "tokens": count}]}
    return _commit(
        out,
        key,
        splits,
        tokenizer=tok_name,
        vocab_size=vocab,
        source=source,
        split_rule="the last val_fraction of the tokens is val",
        val_fraction=val_fraction,
    )


def _prepare_dir(path: Path, tokenizer: str | None, cache_dir: Path) -> Path:
    missing = [n for n in ("train.bin", "val.bin") if not (path / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{path} has no {' or '.join(missing)}; a data directory holds nanoGPT's train.bin "
            "and val.bin (uint16 tokens)"
        )
    own = _read_meta(path)
    if own is not None and own.get("format_version") == FORMAT_VERSION and "splits" in own:
        if tokenizer is None or tokenizer == own.get("tokenizer"):
            return path  # already prepared by prepare_data
    tok_name, vocab = _token_meta(path, tokenizer)
    if tok_name is None:
        raise ValueError(
            f"{path} has no meta.json naming its tokenizer; pass tokenizer='byte' or 'gpt2' "
            "(whichever made its tokens)"
        )
    out = _user_out(path, tok_name, cache_dir, 0.0)
    key = {"path": str(path), "tokenizer": tok_name}
    if _is_prepared(out, key):
        return out
    splits = {}
    for split in ("train", "val"):
        tokens = _open_tokens(path / f"{split}.bin")
        if (top := _max_token(tokens)) >= vocab:
            raise ValueError(
                f"{path / f'{split}.bin'} holds token {top} but vocab_size is {vocab}; pass the "
                "tokenizer that made it or fix the vocab_size in its meta.json"
            )
        splits[split] = {"tokens": int(tokens.size), "documents": []}
        del tokens
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        _link(out, f"{split}.bin", (path / f"{split}.bin").resolve())
    return _commit(
        out,
        key,
        splits,
        tokenizer=tok_name,
        vocab_size=vocab,
        source={"kind": "dir", "path": str(path)},
        split_rule="as given (train.bin, val.bin)",
    )


# ---------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class TokenData:
    """A prepared directory, opened."""

    train: np.memmap
    """The train tokens (read-only uint16)."""
    val: np.memmap
    """The val tokens (read-only uint16)."""
    vocab_size: int
    """The model's vocabulary must be at least this large."""
    tokenizer: str | None
    """``"byte"``, ``"gpt2"`` or None (raw token ids that cannot be decoded)."""
    meta: dict[str, Any]
    """The parsed ``meta.json``."""


def open_data(path: Path) -> TokenData:
    """Open a directory made by ``prepare_data``.

    Args:
        path: the directory.

    Returns:
        Its token data.
    """
    path = Path(path)
    meta = _read_meta(path)
    if meta is None:
        raise FileNotFoundError(f"{path} has no readable meta.json; run prepare_data on it first")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}/meta.json has format_version={meta.get('format_version')}, this qsdp reads "
            f"{FORMAT_VERSION}; delete {path} and prepare it again"
        )
    train, val = (_open_tokens(path / f"{s}.bin") for s in ("train", "val"))
    for split, tokens in (("train", train), ("val", val)):
        if tokens.size != meta["splits"][split]["tokens"]:
            raise ValueError(
                f"{path}/{split}.bin has {tokens.size} tokens, meta.json says "
                f"{meta['splits'][split]['tokens']}; delete {path} and prepare it again"
            )
    return TokenData(train, val, int(meta["vocab_size"]), meta["tokenizer"], meta)
