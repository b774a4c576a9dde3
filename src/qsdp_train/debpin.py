"""What a Debian corpus needs of each pinned ``.deb``: the :class:`DebPin` contract.

Two kinds of pin implement it: ``debdocs.DebPackage``, an HTML manual read one document per
page, and ``debsource.DebSourceTree``, text files read one document per file, from the package's
own files or from a source tarball nested in it. ``debcorpus.py`` builds a corpus from any mix
of them, one cached part per pin (see [Note: building a Debian-docs corpus]).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = ["DebPin", "DocText", "Skipped", "check_pin"]


@dataclass(frozen=True, kw_only=True)
class DocText:
    """One document of a package, as text."""

    path: str
    """Its path relative to the pin's root; the document is named ``<package>/<path>``."""
    text: str
    """The text."""


@dataclass(frozen=True, kw_only=True)
class Skipped:
    """A file the pin's rules leave out; counted per reason in the part and in ``meta.json``."""

    path: str
    """Its path relative to the pin's root."""
    reason: str
    """One of the pin's ``skip_reasons``."""


class DebPin(Protocol):
    """A ``.deb`` pinned by version and sha256, and the rules that read documents out of it."""

    @property
    def name(self) -> str:
        """The package name; the prefix of its documents' names."""
        ...

    @property
    def version(self) -> str:
        """The exact Debian version."""
        ...

    @property
    def pool_path(self) -> str:
        """The ``.deb``'s path below the mirror root (the ``Filename:`` field of ``Packages``)."""
        ...

    @property
    def sha256(self) -> str:
        """The ``.deb``'s sha256, hex (the ``SHA256:`` field of ``Packages``)."""
        ...

    @property
    def license(self) -> str:
        """The license of what is read, as the package's ``copyright`` file states it."""
        ...

    @property
    def filename(self) -> str:
        """The ``.deb``'s file name (the pool path's last part)."""
        ...

    @property
    def unit(self) -> str:
        """What one document is, plural (``"pages"``, ``"files"``): the count's key in reports."""
        ...

    @property
    def skip_reasons(self) -> tuple[str, ...]:
        """The reasons :meth:`documents` may give in a :class:`Skipped`, in report order."""
        ...

    def rules(self) -> dict[str, Any]:
        """How documents are read (JSON values); a cached part made with other rules is remade."""
        ...

    def documents(self, deb: Path) -> Iterator[DocText | Skipped]:
        """The documents of the verified ``deb`` in archive order, and what was left out."""
        ...


def check_pin(*, name: str, sha256: str, pool_path: str) -> None:
    """Refuse a pin whose sha256 is not 64 lowercase hex digits or whose pool path could leave
    the mirror (absolute, or holding ``..``); the errors name the value."""
    if not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise ValueError(f"{name}: sha256={sha256!r} must be 64 lowercase hex digits")
    if pool_path.startswith("/") or ".." in pool_path.split("/"):
        raise ValueError(f"{name}: pool_path={pool_path!r} must be relative, no '..'")
