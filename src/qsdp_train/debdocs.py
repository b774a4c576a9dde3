"""Real English prose from pinned Debian documentation packages: fetch, read in memory, to text.

A Debian ``*-doc`` package ships its project's Sphinx-built HTML manual. This module fetches a
``.deb`` from a Debian mirror by its pool path, checks it against a pinned sha256, reads it in
memory (``ar`` archive -> ``data.tar.xz`` -> members) and turns each HTML page into plain text.
``debcorpus.py`` builds a token corpus from a list of such packages; ``debsource.py`` reads
plain text files (source trees) out of the same kind of ``.deb`` with the same fetching.

[Note: pinned .deb packages]
A package is pinned by name, version, pool path and the sha256 of its ``.deb`` as listed in the
mirror's ``dists/<suite>/main/binary-all/Packages.xz`` (:class:`DebPackage`). The mirror is
``$QSDP_DEBIAN_MIRROR`` or ``http://deb.debian.org/debian``; a ``file://`` URL works, so tests and
air-gapped machines can serve a local copy. A download goes to a temporary name in
``CACHE/downloads`` and is renamed only after its sha256 matched; a cached file is hashed again on
every use, and a mismatch is an error naming the file and the fix (delete it). Nothing is
extracted to disk: the ``.deb`` is parsed by hand (``ar`` is 60-byte headers and data), its
``data.tar.xz`` read with :mod:`tarfile` from memory, so a hostile member name (``../x``,
``/etc/x``) cannot write anywhere. Links are never followed: a linked page duplicates a page
that is read anyway, so links are skipped and counted.

[Note: Sphinx HTML to text]
Only the page's main content is kept: the element with the package's ``main`` attribute
(``role="main"`` in most themes; Django's theme uses ``id="yui-main"``) and everything inside it.
Dropped inside it: ``<script>``, ``<style>`` and Sphinx's heading anchors
(``<a class="headerlink">``, whose text is a pilcrow or ``#``). A newline is put around block
elements (paragraphs, headings, list items, ``<pre>``, ...), each line loses its trailing blanks,
runs of blank lines become one, and a page with fewer than ``min_chars`` characters left is
dropped (an index or stub).
Navigation pages are skipped by path: ``_sources/``, ``_static/``, ``_modules/`` (highlighted
source code), any other ``_*`` folder, ``translations/``, ``genindex*.html``, ``search.html``,
``*-modindex.html`` and ``404.html``; a package may add its own exclusions (API listings).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tarfile
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from .debpin import DebPin, DocText, Skipped, check_pin

__all__ = [
    "DEFAULT_MIRROR",
    "EXTRACTOR_VERSION",
    "DebPackage",
    "PageText",
    "debian_mirror",
    "fetch_deb",
    "html_to_text",
    "iter_deb_members",
    "open_deb_data",
    "package_pages",
]

#: Bump when ``html_to_text`` or the page rules change: cached parts of HTML pins are then remade.
EXTRACTOR_VERSION = 1
DEFAULT_MIRROR = "http://deb.debian.org/debian"
_AR_MAGIC = b"!<arch>\n"
_AR_HEADER = 60
_SKIP_NAMES = re.compile(r"genindex.*\.html|search\.html|.*modindex\.html|404\.html")


@dataclass(frozen=True, kw_only=True)
class DebPackage:
    """A Debian package's HTML manual, pinned by version and the sha256 of its ``.deb``; one
    document per page (a :class:`~qsdp_train.debpin.DebPin`)."""

    name: str
    """The package name, e.g. ``"python3.13-doc"``."""
    version: str
    """The exact Debian version, e.g. ``"3.13.5-2+deb13u5"``."""
    pool_path: str
    """The ``.deb``'s path below the mirror root (the ``Filename:`` field of ``Packages``)."""
    sha256: str
    """The ``.deb``'s sha256, hex (the ``SHA256:`` field of ``Packages``)."""
    license: str
    """The documentation's license, as its ``usr/share/doc/<name>/copyright`` states it."""
    html_root: str
    """The folder of the HTML manual inside ``data.tar``, e.g. ``usr/share/doc/x/html``."""
    main: tuple[str, str] = ("role", "main")
    """The attribute ``(name, value)`` that marks the element holding a page's main content."""
    exclude: str = ""
    """A regex of page paths (relative to ``html_root``) to skip besides the shared rules."""

    def __post_init__(self) -> None:
        check_pin(name=self.name, sha256=self.sha256, pool_path=self.pool_path)
        if self.exclude:
            re.compile(self.exclude)

    @property
    def filename(self) -> str:
        """The ``.deb``'s file name (the pool path's last part)."""
        return self.pool_path.rsplit("/", 1)[-1]

    @property
    def unit(self) -> str:
        return "pages"

    @property
    def skip_reasons(self) -> tuple[str, ...]:
        return ("no_main", "links_skipped")

    def rules(self) -> dict[str, Any]:
        return {
            "extractor_version": EXTRACTOR_VERSION,
            "html_root": self.html_root,
            "main": list(self.main),
            "exclude": self.exclude,
        }

    def documents(self, deb: Path) -> Iterator[DocText | Skipped]:
        """The pages of ``deb`` (see :func:`package_pages`); a page without a main element is
        skipped as ``no_main``, a linked page as ``links_skipped``."""
        for page in package_pages(deb, self):
            if not isinstance(page, PageText):
                yield Skipped(path=page, reason="links_skipped")
            elif page.text is None:
                yield Skipped(path=page.path, reason="no_main")
            else:
                yield DocText(path=page.path, text=page.text)


# ---------------------------------------------------------------------------------------------
# Fetching


def debian_mirror() -> str:
    """``$QSDP_DEBIAN_MIRROR`` if set (``http(s)://`` or ``file://``), else ``DEFAULT_MIRROR``."""
    return (os.environ.get("QSDP_DEBIAN_MIRROR") or DEFAULT_MIRROR).rstrip("/")


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _check(path: Path, pkg: DebPin) -> None:
    got = _file_sha256(path)
    if got != pkg.sha256:
        raise ValueError(
            f"{path} has sha256 {got}, expected {pkg.sha256} ({pkg.name} {pkg.version}); delete "
            "the file and run again to fetch it anew (or point QSDP_DEBIAN_MIRROR at a mirror "
            "that serves the pinned version)"
        )


def fetch_deb(pkg: DebPin, cache_dir: Path, *, mirror: str | None = None) -> Path:
    """The path of ``pkg``'s verified ``.deb`` in ``cache_dir/downloads``, downloading it once.

    Args:
        pkg: the pin; its sha256 is checked for a new and for a cached file alike.
        cache_dir: the data cache root.
        mirror: the mirror root URL (default :func:`debian_mirror`).

    Returns:
        The ``.deb``'s path.
    """
    path = Path(cache_dir) / "downloads" / pkg.filename
    if path.exists():
        _check(path, pkg)
        return path
    url = f"{(mirror or debian_mirror()).rstrip('/')}/{pkg.pool_path}"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        try:
            with urllib.request.urlopen(url, timeout=60) as r, open(tmp, "wb") as f:
                while block := r.read(1 << 20):
                    f.write(block)
        except (urllib.error.URLError, OSError) as e:
            raise RuntimeError(
                f"could not download {url} ({e}); set QSDP_DEBIAN_MIRROR to a reachable Debian "
                f"mirror (a file:// URL works) or copy {pkg.filename} to {path} by hand"
            ) from e
        _check(tmp, pkg)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# ---------------------------------------------------------------------------------------------
# Reading a .deb in memory


def _ar_members(data: bytes, where: Path) -> dict[str, memoryview]:
    # ar: an 8-byte magic, then per member a 60-byte header (name 16, mtime 12, uid 6, gid 6,
    # mode 8, size 10, "`\n") and its data, padded to an even offset.
    if not data.startswith(_AR_MAGIC):
        raise ValueError(f"{where} is not a Debian package (no '!<arch>' ar header)")
    view, pos, out = memoryview(data), len(_AR_MAGIC), {}
    while pos < len(data):
        head = data[pos : pos + _AR_HEADER]
        if len(head) < _AR_HEADER or head[58:60] != b"`\n":
            raise ValueError(f"{where}: corrupt ar member header at byte {pos}")
        name = head[:16].decode("ascii", "replace").strip().rstrip("/")
        size = int(head[48:58].decode("ascii").strip() or "0")
        start = pos + _AR_HEADER
        if start + size > len(data):
            raise ValueError(f"{where}: ar member {name!r} runs past the end of the file")
        out[name] = view[start : start + size]
        pos = start + size + (size & 1)
    return out


@contextmanager
def open_deb_data(deb: Path) -> Iterator[tarfile.TarFile]:
    """A ``.deb``'s ``data.tar.xz``, opened with :mod:`tarfile` from memory.

    Args:
        deb: the ``.deb`` file.

    Returns:
        A context manager giving the open archive; nothing is extracted to disk.
    """
    members = _ar_members(Path(deb).read_bytes(), deb)
    data_names = [n for n in members if n.startswith("data.tar")]
    if data_names != ["data.tar.xz"]:
        raise ValueError(
            f"{deb} holds {data_names or 'no data.tar.*'}, not data.tar.xz; only xz-compressed "
            "packages are read (every package of Debian's binary-all is), so pin another version"
        )
    with tarfile.open(fileobj=io.BytesIO(members["data.tar.xz"]), mode="r:xz") as tar:
        yield tar


def iter_deb_members(deb: Path) -> Iterator[tuple[tarfile.TarInfo, bytes | None]]:
    """The members of a ``.deb``'s ``data.tar.xz`` in archive order, read in memory.

    Args:
        deb: the ``.deb`` file.

    Returns:
        An iterator of ``(info, data)``; ``data`` is the bytes of a regular file and None for
        anything else (folders, links, devices), which is never followed or created.
    """
    with open_deb_data(deb) as tar:
        for info in tar:
            if info.isfile():
                f = tar.extractfile(info)
                assert f is not None
                yield info, f.read()
            else:
                yield info, None


# ---------------------------------------------------------------------------------------------
# HTML to text

_BLOCK = frozenset(
    "address article aside blockquote br caption dd div dl dt figcaption figure footer h1 h2 h3 "
    "h4 h5 h6 header hr li main nav ol p pre section table tbody td th thead tr ul".split()
)
_VOID = frozenset("area base br col embed hr img input link meta source track wbr".split())


class _MainText(HTMLParser):
    """Collects the text inside the first element carrying ``attr``; see [Note: Sphinx HTML]."""

    def __init__(self, attr: tuple[str, str]) -> None:
        super().__init__(convert_charrefs=True)
        self.attr, self.parts = attr, []
        self.tag: str | None = None  # the main element's tag once found
        self.depth = 0  # open elements named self.tag, the main one included
        self.done = False
        self.skip = 0  # open <script>/<style>
        self.in_anchor = False  # inside <a class="headerlink">

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self.done:
            return
        if self.tag is None:
            if (self.attr[0], self.attr[1]) in attrs and tag not in _VOID:
                self.tag, self.depth = tag, 1
            return
        if tag == self.tag:
            self.depth += 1
        if tag in ("script", "style"):
            self.skip += 1
        elif tag == "a" and "headerlink" in (dict(attrs).get("class") or "").split():
            self.in_anchor = True
        if tag in _BLOCK:
            self.parts.append("\n")
        elif tag in ("td", "th"):
            self.parts.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if self.tag is None or self.done:
            return
        if tag in ("script", "style"):
            self.skip = max(self.skip - 1, 0)
        elif tag == "a":
            self.in_anchor = False
        if tag in _BLOCK:
            self.parts.append("\n")
        if tag == self.tag:
            self.depth -= 1
            self.done = self.depth == 0

    def handle_data(self, data: str) -> None:
        if self.tag is not None and not self.done and not self.skip and not self.in_anchor:
            self.parts.append(data)


def html_to_text(html: str, *, main: tuple[str, str] = ("role", "main")) -> str | None:
    """The plain text of a Sphinx page's main content; see [Note: Sphinx HTML to text].

    Args:
        html: the page.
        main: the attribute ``(name, value)`` marking the main element.

    Returns:
        The text (no trailing blanks, at most one blank line in a row, stripped), or None when
        the page has no main element.
    """
    parser = _MainText(main)
    parser.feed(html)
    parser.close()
    if parser.tag is None:
        return None
    text = "".join(parser.parts).replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[ \t\f\v]+\n", "\n", text + "\n")
    return re.sub(r"\n{3,}", "\n\n", text).strip()


@dataclass(frozen=True, kw_only=True)
class PageText:
    """One HTML page of a package, as text."""

    path: str
    """The page's path relative to the package's ``html_root``, e.g. ``library/os.html``."""
    text: str | None
    """The text, or None if the page had no main element."""


def _wanted(rel: str, exclude: re.Pattern[str] | None) -> bool:
    parts = rel.split("/")
    if any(p.startswith("_") or p == "translations" for p in parts[:-1]):
        return False
    if _SKIP_NAMES.fullmatch(parts[-1]):
        return False
    return exclude is None or not exclude.search(rel)


def package_pages(deb: Path, pkg: DebPackage) -> Iterator[PageText | str]:
    """The wanted HTML pages of ``deb`` as text, in archive order.

    Args:
        deb: the verified ``.deb`` of ``pkg``.
        pkg: its pin (``html_root``, ``main``, ``exclude``).

    Returns:
        An iterator of :class:`PageText`, and of the path (a ``str``) of each wanted page that is
        a link, which is skipped (see [Note: pinned .deb packages]).
    """
    root = pkg.html_root.strip("/") + "/"
    exclude = re.compile(pkg.exclude) if pkg.exclude else None
    for info, data in iter_deb_members(deb):
        name = info.name.removeprefix("./")
        if not (name.startswith(root) and name.endswith(".html")):
            continue
        rel = name[len(root) :]
        if not _wanted(rel, exclude):
            continue
        if data is None:
            yield rel
            continue
        try:
            html = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{deb}: {name} is not UTF-8 ({e}); is this the pinned package?"
            ) from e
        yield PageText(path=rel, text=html_to_text(html, main=pkg.main))
