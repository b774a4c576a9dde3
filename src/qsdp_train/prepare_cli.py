"""``qsdp prepare-data``: build a named corpus into the data cache and say where it is."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .corpora import CORPORA, get_corpus
from .corpus import TOKENIZERS
from .data import prepare_data


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qsdp prepare-data",
        description="Fetch, tokenize and split a built-in corpus once (nanoGPT format: "
        "train.bin, val.bin, meta.json); prints its directory, which `qsdp train --data DIR` "
        "takes. Downloads and per-package results are cached, so a killed run resumes.",
    )
    p.add_argument("--corpus", required=True, help=f"one of: {', '.join(sorted(CORPORA))}")
    p.add_argument("--tokenizer", default="gpt2", help=f"one of: {', '.join(sorted(TOKENIZERS))}")
    p.add_argument(
        "--cache-dir", type=Path, help="cache root (default: $QSDP_DATA_DIR or ~/.cache/qsdp)"
    )
    p.add_argument("--no-progress", action="store_true", help="print nothing while building")
    return p


def main(argv: list[str] | None = None) -> Path:
    """Run ``qsdp prepare-data``; a bad corpus or tokenizer name ends it with one line naming
    the valid ones (exit code 1).

    Returns:
        The prepared directory (also printed, with a one-line summary).
    """
    args = parser().parse_args(argv)
    t0 = time.monotonic()
    try:
        corpus = get_corpus(args.corpus)
        out = prepare_data(
            None,
            args.tokenizer,
            cache_dir=args.cache_dir,
            corpus=corpus,
            progress=not args.no_progress,
        )
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        sys.exit(f"qsdp prepare-data: {e}")
    meta = json.loads((out / "meta.json").read_text())
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    print(out)
    print(
        f"{args.corpus} ({meta['tokenizer']}): train {train['tokens']:,} tokens in "
        f"{len(train['documents'])} documents, val {val['tokens']:,} tokens in "
        f"{len(val['documents'])} documents ({time.monotonic() - t0:.1f} s)"
    )
    return out
