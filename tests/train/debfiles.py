"""Fake Debian packages for the corpus tests: tarballs and ``.deb`` files built in memory."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path


def member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """Add a regular file ``name`` holding ``data`` to ``tar``."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def symlink(tar: tarfile.TarFile, name: str, target: str) -> None:
    """Add a symlink ``name`` -> ``target`` to ``tar``."""
    link = tarfile.TarInfo(name)
    link.type, link.linkname = tarfile.SYMTYPE, target
    tar.addfile(link)


def write_deb(path: Path, data_tar: bytes, *, compression: str = "xz") -> None:
    """An ar archive (debian-binary, control.tar.xz, data.tar.<compression>) like a real .deb."""
    parts = [(b"debian-binary", b"2.0\n"), (b"control.tar.xz", b"\0" * 33)]
    parts.append((f"data.tar.{compression}".encode(), data_tar))
    out = bytearray(b"!<arch>\n")
    for name, blob in parts:
        head = name.ljust(16) + b"0".ljust(12) + b"0".ljust(6) + b"0".ljust(6)
        head += b"100644".ljust(8) + str(len(blob)).encode().ljust(10) + b"`\n"
        assert len(head) == 60
        out += head + blob + (b"\n" if len(blob) % 2 else b"")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(out))
