"""Text files of a pinned Debian package as documents: source trees, one document per file.

[Note: a source tree as documents]
A :class:`DebSourceTree` reads the text files under ``root``, either the package's own files or,
with ``tarball`` set, the members of a source tarball the package ships (``linux-source-6.12``
holds ``usr/src/linux-source-6.12.tar.xz``). Everything is read in memory, never extracted, so
a hostile member name cannot write anywhere; the nested tarball is streamed (``tarfile``'s
``r|*`` mode), so its 1.5 GB of members are never held at once::

    .deb -> data.tar.xz (debdocs.open_deb_data)
            -> member `tarball`, streamed -> its members in archive order   (tarball set)
            -> its own members in archive order                           (tarball "")
    each member under `root`, path relative to it:
      include misses or exclude matches (regex search) ........... skipped: "excluded"
      not a regular file (symlink, hard link) .................... skipped: "links_skipped"
      more than max_bytes ........................................ skipped: "too_large" (unread)
      a control byte other than \\t \\n \\v \\f \\r ESC, or not UTF-8 . skipped: "binary"
      more than max_hex_fraction of its bytes in 0x.. literals ... skipped: "hex_data"
      else DocText(path, the file's text as it is)

The corpus then drops documents shorter than its ``min_chars`` (``debcorpus.py``). Why each rule:
the control-byte test finds executables, images and compressed data (a NUL is a control byte) and
keeps the byte tokenizer's separator, 0x04, out of every document. ``hex_data`` catches what is
text but not language: firmware images and register dumps committed as C arrays (amdgpu's
``polaris10_pwrvirus.h``, rtw89's ``*_table.c``); in linux-source-6.12, 159 files of over 20 KB
were more than 30% hex literals, 18.5 MB in all. ``max_bytes`` bounds the generated tables the
other rules miss. Larger generated trees are named in each pin's ``exclude``
(``corpora.py``).
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .debdocs import open_deb_data
from .debpin import DocText, Skipped, check_pin

__all__ = ["SOURCE_EXTRACTOR_VERSION", "DebSourceTree", "file_text"]

#: Bump when the file rules change: cached parts of source-tree pins are then remade.
SOURCE_EXTRACTOR_VERSION = 1
_CONTROL = re.compile(rb"[\x00-\x08\x0e-\x1a\x1c-\x1f]")
_HEX = re.compile(rb"0[xX][0-9a-fA-F]+")


@dataclass(frozen=True, kw_only=True)
class DebSourceTree:
    """A Debian package's text files under one folder, pinned by version and the sha256 of its
    ``.deb``; one document per file (a :class:`~qsdp_train.debpin.DebPin`)."""

    name: str
    """The package name, e.g. ``"linux-source-6.12"``."""
    version: str
    """The exact Debian version, e.g. ``"6.12.107-1"``."""
    pool_path: str
    """The ``.deb``'s path below the mirror root (the ``Filename:`` field of ``Packages``)."""
    sha256: str
    """The ``.deb``'s sha256, hex (the ``SHA256:`` field of ``Packages``)."""
    license: str
    """The license of the files read, as the package's ``usr/share/doc/<name>/copyright`` says."""
    root: str
    """The folder whose files are read, in the package or in ``tarball``; paths are relative."""
    tarball: str = ""
    """A tarball inside the package whose members are read instead of the package's own files
    (e.g. ``usr/src/linux-source-6.12.tar.xz``); empty to read the package's files."""
    include: str = ""
    """A regex (searched) a relative path must match to be read; empty reads every file."""
    exclude: str = ""
    """A regex (searched) of relative paths to skip: generated trees, data, duplicates."""
    max_bytes: int = 1 << 20
    """Files larger than this are skipped unread (``too_large``)."""
    max_hex_fraction: float = 0.5
    """Files with a larger share of their bytes in ``0x..`` literals are skipped (``hex_data``)."""

    def __post_init__(self) -> None:
        check_pin(name=self.name, sha256=self.sha256, pool_path=self.pool_path)
        if self.tarball.startswith("/") or ".." in self.tarball.split("/"):
            raise ValueError(f"{self.name}: tarball={self.tarball!r} must be relative, no '..'")
        for field in ("include", "exclude"):
            try:
                re.compile(getattr(self, field))
            except re.error as e:
                raise ValueError(f"{self.name}: {field}={getattr(self, field)!r}: {e}") from e
        if self.max_bytes < 1:
            raise ValueError(f"{self.name}: max_bytes={self.max_bytes} must be >= 1; try 1 << 20")
        if not 0.0 < self.max_hex_fraction <= 1.0:
            raise ValueError(
                f"{self.name}: max_hex_fraction={self.max_hex_fraction} must be in (0, 1]; "
                "try 0.5 (1 keeps every file)"
            )

    @property
    def filename(self) -> str:
        """The ``.deb``'s file name (the pool path's last part)."""
        return self.pool_path.rsplit("/", 1)[-1]

    @property
    def unit(self) -> str:
        return "files"

    @property
    def skip_reasons(self) -> tuple[str, ...]:
        return ("excluded", "links_skipped", "too_large", "binary", "hex_data")

    def rules(self) -> dict[str, Any]:
        return {
            "extractor_version": SOURCE_EXTRACTOR_VERSION,
            "tarball": self.tarball,
            "root": self.root,
            "include": self.include,
            "exclude": self.exclude,
            "max_bytes": self.max_bytes,
            "max_hex_fraction": self.max_hex_fraction,
        }

    def documents(self, deb: Path) -> Iterator[DocText | Skipped]:
        """The text files under ``root`` and the files skipped, in archive order; see
        [Note: a source tree as documents].

        Args:
            deb: the verified ``.deb`` of this pin.

        Returns:
            An iterator of :class:`DocText` and :class:`Skipped`.
        """
        with open_deb_data(deb) as outer:
            if not self.tarball:
                yield from self._members(outer, f"{deb}'s data.tar.xz")
                return
            for info in outer:
                if info.name.removeprefix("./") != self.tarball.strip("/"):
                    continue
                if not info.isfile():
                    raise ValueError(
                        f"{deb}: {self.tarball} is not a regular file; is this the pinned package?"
                    )
                f = outer.extractfile(info)
                assert f is not None
                with tarfile.open(fileobj=f, mode="r|*") as inner:
                    yield from self._members(inner, f"{deb}:{self.tarball}")
                return
        raise ValueError(
            f"{deb} has no member {self.tarball!r}; fix the pin's tarball (`dpkg-deb -c` lists "
            "the package's files; give the path without its leading ./)"
        )

    def _members(self, tar: tarfile.TarFile, where: str) -> Iterator[DocText | Skipped]:
        root = self.root.strip("/")
        prefix = root + "/" if root else ""
        include = re.compile(self.include) if self.include else None
        exclude = re.compile(self.exclude) if self.exclude else None
        tops: set[str] = set()
        found = False
        for info in tar:
            name = info.name.removeprefix("./")
            if not name.startswith(prefix) or info.isdir():
                tops.add(name.split("/", 1)[0])
                continue
            found = True
            rel = name[len(prefix) :]
            if (include and not include.search(rel)) or (exclude and exclude.search(rel)):
                yield Skipped(path=rel, reason="excluded")
            elif not info.isfile():
                yield Skipped(path=rel, reason="links_skipped")
            elif info.size > self.max_bytes:
                yield Skipped(path=rel, reason="too_large")
            else:
                f = tar.extractfile(info)
                assert f is not None
                text, reason = file_text(f.read(), max_hex_fraction=self.max_hex_fraction)
                if text is None:
                    yield Skipped(path=rel, reason=reason)
                else:
                    yield DocText(path=rel, text=text)
        if not found:
            raise ValueError(
                f"{where}: no file under root {root!r}; fix the pin's root (top-level names "
                f"there: {sorted(tops)[:8]})"
            )


def file_text(data: bytes, *, max_hex_fraction: float) -> tuple[str | None, str]:
    """A file's text, or why it is not read as text; see [Note: a source tree as documents].

    Args:
        data: the file's bytes.
        max_hex_fraction: the largest share of bytes in ``0x..`` literals a text may have.

    Returns:
        ``(text, "")``, or ``(None, reason)`` with reason ``"binary"`` or ``"hex_data"``.
    """
    if _CONTROL.search(data):
        return None, "binary"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, "binary"
    if sum(map(len, _HEX.findall(data))) > max_hex_fraction * len(data):
        return None, "hex_data"
    return text, ""
